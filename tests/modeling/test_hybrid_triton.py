"""The Triton kernels of bidirectional hybrid attention's support sums (``hybrid_triton``) against the CPU kernels
(the same contract, in float64) and the dense reference: on a CPU through Triton's interpreter (``tests/conftest.py``
sets ``TRITON_INTERPRET=1`` where there is no CUDA device), on CUDA compiled."""

import pytest
import torch
import triton

import performer_hf.modeling.favor_hybrid as favor_hybrid
from performer_hf.modeling import cpu_kernels, far_field_polynomial, far_field_triton, hybrid_backends, hybrid_triton
from performer_hf.modeling.attention_methods import ATTENTION_METHODS
from performer_hf.modeling.favor_hybrid import hybrid_attention
from performer_hf.modeling.hybrid_spec import HybridSpec

from ..compiled_check import assert_one_graph_as_eager, assert_strides_do_not_matter
from ..flex_reference import bfloat16_tolerances, sdpa_bfloat16_errors
from ..hybrid_reference import CONFIGS, random_qkv, reference, right_padding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("x", "rq", "q_scale", "far_sum", "y", "values1", "klog")  # the inputs with gradients


def _inputs(geometry, d=16, dv=8, length=45, routed=2, seed=0):
    """The support sums' inputs for ``geometry`` ([left, right, nb_global, block_q, block_k]): float32 tensors in
    NAMES' order plus key_shift, the key mask (the second row padded from 40) and random distinct routes (-1 for a
    few), on DEVICE: the far field's mass over all keys above the support's."""
    g = torch.Generator().manual_seed(seed)
    B, H, L = 2, 2, length
    block_q, block_k = geometry[3], geometry[4]
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 40:] = False
    x, y = (torch.randn(B, H, L, d, generator=g) * 0.5 for _ in range(2))
    rq = torch.randn(B, H, L, generator=g) * 0.1
    q_scale = rq + 0.3
    far_sum = torch.rand(B, H, L, dv + 1, generator=g) * 20.0
    far_sum[..., -1] = 100.0 + torch.rand(B, H, L, generator=g) * 400.0  # the kernel's mass on a support: 1-260
    values1 = torch.cat([torch.randn(B, H, L, dv, generator=g), torch.ones(B, H, L, 1)], -1) * mask[:, None, :, None]
    klog = torch.randn(B, H, L, generator=g) * 0.1
    key_shift = torch.randn(B, H, generator=g) * 0.1
    N, key_blocks = -(-L // block_q), -(-L // block_k)
    routes = torch.stack([torch.randperm(key_blocks, generator=g)[:routed] for _ in range(B * H * N)])
    routes = routes.view(B, H, N, routed)
    routes[0, 0, ::3, :1] = -1  # blocks without a first choice
    tensors = [t.to(DEVICE) for t in (x, rq, q_scale, far_sum, y, values1, klog)]
    return tensors, key_shift.to(DEVICE), mask.to(DEVICE), routes.to(DEVICE)


def _floor(far_sum):
    """A far-field floor (B, H, L) for the kernels (the mass at or below which what remains of the far field outside
    the support does not count): half the far mass, which the kernel's mass on the support of some queries of
    :func:`_inputs` passes (up to 17% of them)."""
    return 0.5 * far_sum[..., -1].detach()


def _cpu_kernels(tensors, key_shift, mask, routes, geometry, quadratic, probe):
    """The CPU kernels' sums and gradients in float64 (``probe``: the output gradient)."""
    kernels = cpu_kernels.hybrid_kernels()
    x, rq, q_scale, far_sum, y, values1, klog = (t.detach().cpu().double() for t in tensors)
    inputs = [x, rq, q_scale, far_sum, key_shift.cpu().double(), y.transpose(-2, -1).contiguous(), values1, klog]
    inputs += [mask.cpu(), routes.cpu().long(), _floor(far_sum)]
    sums = kernels.hybrid_support_sums(inputs, geometry, quadratic)
    return [sums, *kernels.hybrid_support_sums_backward(probe.cpu().double(), inputs, geometry, quadratic)]


def _triton(tensors, key_shift, mask, routes, geometry, quadratic, probe):
    leaves = [t.clone().requires_grad_() for t in tensors]
    x, rq, q_scale, far_sum, y, values1, klog = leaves
    sums = hybrid_triton.support_sums(
        x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, _floor(far_sum), routes, geometry, quadratic
    )
    return [sums, *torch.autograd.grad((sums * probe).sum(), leaves)]


def _assert_relatively_close(got, want, names, tol):
    for name, a, b in zip(names, got, want, strict=True):
        error = (a.detach().cpu().double() - b).abs().max() / b.abs().max()
        assert error < tol, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize(
    "geometry,d,dv,routed,length",
    [
        ([8, 8, 1, 16, 8], 32, 32, 3, 45),  # the converter's preset (window 17, a global token, blocks of 8 per 16)
        ([8, 8, 1, 16, 8], 16, 8, 12, 120),  # 129 candidates per block: three steps, the softmax's shift rising
        ([3, 3, 2, 8, 4], 16, 8, 2, 45),  # query blocks padded to the smallest tile
        ([2, 2, 0, 5, 3], 16, 9, 3, 45),  # blocks that do not divide the length or each other; no global key
        ([0, -1, 3, 8, 4], 16, 8, 0, 45),  # global keys only: no window, no routing
    ],
)
def test_the_kernels_give_the_cpu_kernels_sums_and_gradients(geometry, d, dv, routed, length):
    """Sums and the gradients of every input against the CPU kernels in float64: padded keys, routes of -1, routed
    blocks that overlap the window or hold a global key (their keys' gradients a program per routed key block), and
    queries whose far field outside the support counts beside queries for which it is within the floor (a far mass of
    0 at every other position, or not half of it above the support's)."""
    tensors, key_shift, mask, routes = _inputs(geometry, d, dv, length, routed)
    far_sum = tensors[NAMES.index("far_sum")]
    far_sum[:, :, ::2] = 0.0
    probe = torch.randn(2, 2, length, dv + 1, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = _cpu_kernels(tensors, key_shift, mask, routes, geometry, 0.25, probe)
    got = _triton(tensors, key_shift, mask, routes, geometry, 0.25, probe)
    _assert_relatively_close(got, want, ("sums", *NAMES), 1e-5)


@pytest.mark.parametrize("kernels", [_triton, _cpu_kernels], ids=["triton", "cpu kernels"])
def test_padded_keys_rows_never_reach_real_queries_nor_real_keys(kernels):
    """The support sums use no padded key's row (the Triton kernels load a chunk's rows beside the key mask, then zero
    those of padded keys; the CPU kernels pack them as zeros): NaN there changes no real query's sums or gradient, and
    no real key's gradient. (The kernels' contract: the far field's state is its caller's.)"""
    geometry, length = [8, 8, 1, 16, 8], 45
    tensors, key_shift, mask, routes = _inputs(geometry, 16, 8, length, 3)
    probe = torch.randn(2, 2, length, 9, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = kernels(tensors, key_shift, mask, routes, geometry, 0.25, probe)
    poisoned = [t.clone() for t in tensors]
    for name in ("y", "values1", "klog"):
        poisoned[NAMES.index(name)][1, :, 40:] = float("nan")  # the second row's padded keys
    got = kernels(poisoned, key_shift, mask, routes, geometry, 0.25, probe)
    real = mask[:, None, :].expand(2, 2, length).cpu()  # (B, H, L): the real queries and keys
    for name, a, b in zip(("sums", *NAMES), got, want, strict=True):
        torch.testing.assert_close(a.detach().cpu()[real], b.detach().cpu()[real], rtol=0, atol=0, msg=name)


def test_the_routed_blocks_gradients_in_pieces_are_the_cpu_kernels(monkeypatch):
    """The routed key blocks' gradients with each block's choosers cut in pieces of two, several programs adding into
    one block's keys: the CPU kernels' in float64 (blocks that divide neither the length nor each other)."""
    monkeypatch.setattr(hybrid_triton, "CHOOSERS_PER_PROGRAM", 2)
    geometry, length = [2, 2, 0, 5, 3], 45
    tensors, key_shift, mask, routes = _inputs(geometry, 16, 8, length, 3)
    choosers = [torch.bincount(head[head >= 0].cpu()).max() for head in routes.flatten(0, 1)]  # per (batch, head)
    assert max(choosers) > 4  # a block cut in three pieces or more
    probe = torch.randn(2, 2, length, 9, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = _cpu_kernels(tensors, key_shift, mask, routes, geometry, 0.25, probe)
    got = _triton(tensors, key_shift, mask, routes, geometry, 0.25, probe)
    _assert_relatively_close(got, want, ("sums", *NAMES), 1e-5)


def test_the_routes_inverted_give_each_key_blocks_choosers_once_in_pieces(monkeypatch):
    """``routed_pieces``: every (query block, key block) route once, in pieces of at most CHOOSERS_PER_PROGRAM
    choosers of one key block; the rows past the pieces take nothing. Against loops over the routes."""
    monkeypatch.setattr(hybrid_triton, "CHOOSERS_PER_PROGRAM", 3)
    g = torch.Generator().manual_seed(0)
    B, H, N, R, key_blocks = 2, 3, 9, 4, 7
    routes = torch.stack([torch.randperm(key_blocks, generator=g)[:R] for _ in range(B * H * N)]).view(B, H, N, R)
    routes[0, 1, ::2, 1:] = -1  # fewer choices
    routes[1, 2, :, 0] = 5  # a key block every query block chose
    pieces, choosers = hybrid_triton.routed_pieces(routes.to(DEVICE), key_blocks)
    pieces, choosers = pieces.cpu(), choosers.cpu()
    got = []
    for block, first, end in pieces.tolist():
        assert end - first <= 3
        got += [(block, int(n)) for n in choosers[first:end]]
    want = [
        (bh * key_blocks + int(routes.view(B * H, N, R)[bh, n, r]), n)
        for bh in range(B * H)
        for n in range(N)
        for r in range(R)
        if routes.view(B * H, N, R)[bh, n, r] >= 0
    ]
    assert sorted(got) == sorted(want)
    assert len(got) == len(want)  # each once
    assert (pieces[:, 2] > pieces[:, 1]).sum() == sum(
        -(-count // 3)
        for count in torch.bincount(torch.tensor([block for block, _ in want]), minlength=B * H * key_blocks).tolist()
    )


def test_the_operators_take_rows_of_any_strides():
    """Both operators give the same outputs for rows that are not contiguous (inductor may pad them), and their fake
    outputs have the real ones' strides."""
    tensors, key_shift, mask, routes = _inputs([8, 8, 1, 16, 8], d=32, dv=32, routed=1)
    x, rq, q_scale, far_sum, y, values1, klog = tensors
    ops, settings = torch.ops.performer_hf, ([8, 8, 1, 16, 8], 0.25, "pytorch")
    rows = [x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, _floor(far_sum), routes.to(torch.int32)]
    assert_strides_do_not_matter(ops.hybrid_support_sums.default, [*rows, *settings])
    _, shift, kernel_mass = ops.hybrid_support_sums(*rows, *settings)
    grad = torch.randn_like(far_sum)
    assert_strides_do_not_matter(ops.hybrid_support_sums_backward.default, [grad, *rows, shift, kernel_mass, *settings])


def test_launches_whose_tiles_exceed_shared_memory_take_smaller_chunks_and_remember(monkeypatch):
    """A launch the GPU refuses for its shared memory runs again in chunks of 32, then 16 candidates; later launches
    of that kind start from the chunk that fitted. The smaller chunks give the CPU kernels' sums and gradients (in
    the interpreter; the default chunk's are tested above)."""
    launched = []

    class Kernel:  # refuses chunks above 16, as a GPU with little shared memory would for wide tiles
        def __getitem__(self, grid):
            def run(*args, CH, **settings):
                launched.append(CH)
                if CH > 16:
                    raise triton.runtime.OutOfResources(CH * 4096, 65536, "shared memory")

            return run

    kernel = Kernel()
    monkeypatch.setattr(far_field_triton, "_FITTING", {})
    hybrid_triton._launch(kernel, (1, 1), (), {"D": 32})
    hybrid_triton._launch(kernel, (1, 1), (), {"D": 32})
    assert launched == [64, 32, 16, 16]
    geometry = [8, 8, 1, 16, 8]
    tensors, key_shift, mask, routes = _inputs(geometry, 16, 8, 45, 3)
    probe = torch.randn(2, 2, 45, 9, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = _cpu_kernels(tensors, key_shift, mask, routes, geometry, 0.25, probe)
    monkeypatch.setattr(hybrid_triton, "CHUNK", 16)  # four chunks of 16 for 57 candidates
    monkeypatch.setattr(far_field_triton, "_FITTING", {})
    got = _triton(tensors, key_shift, mask, routes, geometry, 0.25, probe)
    _assert_relatively_close(got, want, ("sums", *NAMES), 1e-5)


@pytest.mark.parametrize("config", CONFIGS[3:], ids=range(3, len(CONFIGS)))
def test_hybrid_attention_through_the_kernels_matches_the_dense_reference(config, monkeypatch):
    """Bidirectional hybrid attention with its support sums in the kernels (as on CUDA, float32), padded keys, against
    the dense reference in float64: outputs and the gradients of queries, keys and values."""
    triton = hybrid_backends.TritonBackend("pytorch")
    monkeypatch.setattr(favor_hybrid, "choose_backend", lambda call, causal: triton)
    q, k, v = random_qkv(head_dim=16)
    mask = right_padding(2, 45)
    fast_inputs = [t.float().to(DEVICE).requires_grad_() for t in (q, k, v)]
    fast = hybrid_attention(*fast_inputs, key_padding_mask=mask.to(DEVICE), far_field="poly2", center=True, **config)
    ref_inputs = [t.requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_inputs, mask=mask, far_field="poly2", center=True, **config)
    fast, ref = fast.cpu() * mask[:, None, :, None], ref * mask[:, None, :, None]  # padded queries: unspecified
    probe = torch.randn_like(ref)
    got = (fast, *torch.autograd.grad((fast * probe).sum(), fast_inputs))
    want = (ref, *torch.autograd.grad((ref * probe).sum(), ref_inputs))
    _assert_relatively_close(got, want, ("out", "q", "k", "v"), 1e-5)


def test_compiled_the_kernels_are_operators_of_the_graph():
    """Under ``torch.compile`` the kernels are custom operators, opaque to tracing: one graph without breaks, with
    eager's sums and gradients."""
    geometry = [3, 3, 1, 8, 4]
    tensors, key_shift, mask, routes = _inputs(geometry)

    def sums(*tensors):
        x, rq, q_scale, far_sum, y, values1, klog = tensors
        return hybrid_triton.support_sums(
            x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, _floor(far_sum), routes, geometry, 0.5
        )

    assert_one_graph_as_eager(sums, [t.clone().requires_grad_() for t in tensors])


def test_compiled_hybrid_attention_through_the_kernels_is_one_graph(monkeypatch):
    """The whole bidirectional call through the backend (routing, the far field, the support sums) traces into one
    graph, with eager's output and gradients (as ``device_compile`` traces it on CUDA)."""
    triton = hybrid_backends.TritonBackend("pytorch")
    monkeypatch.setattr(favor_hybrid, "choose_backend", lambda call, causal: triton)
    q, k, v = (t.float().requires_grad_() for t in random_qkv(head_dim=16))

    def attend(q, k, v):
        return hybrid_attention(q, k, v, far_field="poly2", center=True, **CONFIGS[3])

    assert_one_graph_as_eager(attend, (q, k, v), rtol=1e-5, atol=1e-6)


def test_cuda_calls_take_the_kernels_where_they_serve(monkeypatch):
    """On CUDA (eager or traced) a bidirectional call with a polynomial far field goes to the kernels where they serve
    it; causal calls do not, nor calls they do not serve (another far field, PERFORMER_HF_TRITON=0, see below)."""
    calls = []
    monkeypatch.setattr(
        favor_hybrid, "choose_backend", lambda call, causal: calls.append(call) or hybrid_backends.PYTORCH
    )
    q, k, v = random_qkv(head_dim=16)
    hybrid_attention(q.float(), k.float(), v.float(), far_field="poly2", center=True, **CONFIGS[3])
    projection = torch.randn(16, 16)
    hybrid_attention(q.float(), k.float(), v.float(), projection, far_field="softmax", center=True, **CONFIGS[3])
    polynomial, random_features = calls
    monkeypatch.setattr(hybrid_backends, "triton_serves", lambda x, width, block: True)  # as on CUDA
    takes = lambda call, causal=False: isinstance(  # noqa: E731
        hybrid_backends._cuda_backend(call, causal), hybrid_backends.TritonBackend
    )
    assert takes(polynomial) and not takes(polynomial, causal=True) and not takes(random_features)
    assert hybrid_backends._cuda_backend(polynomial, False).precision == "pytorch"  # float32 inputs
    bfloat16 = polynomial._replace(k=polynomial.k.bfloat16())  # the model's keys (the rest computes in float32)
    assert hybrid_backends._cuda_backend(bfloat16, False).precision == "tf32"
    monkeypatch.setattr(hybrid_backends, "triton_serves", lambda x, width, block: False)
    assert not takes(polynomial)


def test_the_backend_runs_both_kernels_in_its_precision(monkeypatch):
    """A backend's precision reaches the support sums and the far field's kernels (the hybrid with a float32 model,
    as on CUDA; the products in TF32 for bfloat16 and float16 models, :func:`float32_precision`)."""
    precisions = []
    for name in ("state", "apply"):  # the far field's kernels, called with the precision last
        original = getattr(far_field_triton, f"quadratic_{name}")
        spy = lambda *args, original=original: precisions.append(args[-1]) or original(*args)  # noqa: E731
        monkeypatch.setattr(far_field_polynomial, f"triton_{name}", spy)
    support_sums = hybrid_triton.support_sums
    monkeypatch.setattr(
        hybrid_backends, "triton_support_sums", lambda *args: precisions.append(args[-1]) or support_sums(*args)
    )
    monkeypatch.setattr(far_field_polynomial, "triton_serves", lambda x, width: True)
    triton = hybrid_backends.TritonBackend("tf32")  # not the default: it must be passed along
    monkeypatch.setattr(favor_hybrid, "choose_backend", lambda call, causal: triton)
    q, k, v = (t.float() for t in random_qkv(head_dim=16))
    hybrid_attention(q, k, v, far_field="poly2", center=True, **CONFIGS[3])
    assert precisions == ["tf32"] * 3
    assert (
        far_field_triton.float32_precision(torch.bfloat16) == far_field_triton.float32_precision(torch.half) == "tf32"
    )


def test_only_cuda_float32_queries_of_tile_dims_are_served(monkeypatch):
    x = torch.zeros(1, 1, 4, 32)
    assert not hybrid_triton.serves(x, 33, 16)  # a CPU: the CPU kernels or PyTorch
    if torch.cuda.is_available():
        x = x.cuda()
        assert hybrid_triton.serves(x, 33, 16)
        assert not hybrid_triton.serves(x.double(), 33, 16)
        assert not hybrid_triton.serves(x[..., :24], 33, 16)  # not a power of two
        assert hybrid_triton.serves(x, 129, 16)  # 128 in the tile, the masses' column apart
        assert not hybrid_triton.serves(x, 130, 16)  # wider values than a tile
        assert not hybrid_triton.serves(x, 33, 128)  # query blocks of more than 64
        monkeypatch.setenv("PERFORMER_HF_TRITON", "0")
        assert not hybrid_triton.serves(x, 33, 16)


@pytest.mark.cuda
def test_cuda_kernels_match_the_cpu_in_float32_and_bfloat16(monkeypatch):
    """On a GPU: forward and backward of the converter's bidirectional preset at 4K tokens through the kernels against
    the float32 CPU path."""
    preset = ATTENTION_METHODS["hybrid"].presets["bidirectional"]
    settings = {name: preset[field] for name, field in HybridSpec.config_fields().items() if field in preset}
    q, k, v = (t.float() for t in random_qkv(batch=2, heads=4, length=4096, head_dim=32, seed=11))
    grad = torch.randn(2, 4, 4096, 32, generator=torch.Generator().manual_seed(12))
    calls = []
    support_sums = hybrid_triton.support_sums
    monkeypatch.setattr(hybrid_backends, "triton_support_sums", lambda *args: calls.append(1) or support_sums(*args))

    def run(device, dtype, inputs=(q, k, v)):
        inputs = [t.detach().to(device, dtype).requires_grad_() for t in inputs]
        out = hybrid_attention(*inputs, **settings)
        (out.float() * grad.to(device)).sum().backward()
        return [t.detach().float().cpu() for t in (out, *(i.grad for i in inputs))]

    reference_cpu = run("cpu", torch.float32)
    rounded_cpu = run("cpu", torch.float32, [t.bfloat16().float() for t in (q, k, v)])
    bfloat16 = bfloat16_tolerances(rounded_cpu, reference_cpu, sdpa_bfloat16_errors(q, k, v, grad, False))
    for dtype, tolerances in ((torch.float32, [1e-4] * 4), (torch.bfloat16, bfloat16)):
        for got, want, tolerance in zip(run("cuda", dtype), reference_cpu, tolerances, strict=True):
            assert torch.isfinite(got).all()
            assert (got - want).norm() / want.norm() < tolerance, dtype
    assert len(calls) == 2  # the kernels served both
