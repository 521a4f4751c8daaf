"""The causal scan's Triton kernels (``favor_exp_triton``) against the PyTorch scan (``favor_exp._CausalExp``) and
the dense references: on a CPU through Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` where
there is no CUDA device), on CUDA compiled. Float32 kernels against float64 PyTorch."""

import functools

import pytest
import torch

from performer_hf.favor import draw_projection, favor_attention, hybrid_attention
from performer_hf.modeling import favor_exp, favor_exp_triton
from performer_hf.modeling.attention_methods import ATTENTION_METHODS
from performer_hf.modeling.favor_exp import ExpFeatures, ScanKeys
from performer_hf.modeling.hybrid_spec import HybridSpec

from ..compiled_check import assert_one_graph_as_eager, assert_strides_do_not_matter
from ..flex_reference import bfloat16_tolerances, sdpa_bfloat16_errors
from ..hybrid_reference import random_qkv, reference, right_padding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _scan_inputs(length, d, m, width, per_head, bias, row, mask, state, seed=0):
    """Queries, keys, values, features (directions, bias), key rows, mask and state of a (2, 3)-headed scan, float64
    on the CPU; the values' last column is positive, as the callers' (ones) are, and not constant: the kernels hold it
    apart (``far_field_triton.value_tiles``) where the others fill a tile."""
    g = torch.Generator().manual_seed(seed)
    B, H = 2, 3
    q, k = (torch.randn(B, H, length, d, generator=g, dtype=torch.float64) * 0.5 for _ in range(2))
    v1 = torch.cat(
        [torch.randn(B, H, length, width - 1, generator=g), torch.rand(B, H, length, 1, generator=g) + 0.5], -1
    ).double()
    directions = torch.randn(*((H,) if per_head else ()), m, d, generator=g, dtype=torch.float64) * 0.7
    bias = torch.randn(H, 1, m, generator=g, dtype=torch.float64) * 0.3 if bias else None
    if row:  # rising along the sequence: the keys' running max (their shift) grows at most positions
        row = torch.randn(B, H, length, 1, generator=g, dtype=torch.float64) + 0.1 * torch.arange(length)[:, None]
    else:
        row = None
    mask = torch.rand(B, length, generator=g) > 0.2 if mask else None
    if state:
        state = (torch.rand(B, H, m, width, generator=g, dtype=torch.float64), torch.randn(B, H, generator=g).double())
    return q, k, v1, (directions, bias), row, mask, state or None


def _absolute(scan, reference_shifts):
    """A scan's sums and state relative to fixed shifts (its own shifts differ by rounding), for comparing scans."""
    sums, q_shifts, shifts, kv, shift = scan
    query_shift, state_shift = reference_shifts
    return sums * torch.exp(q_shifts + shifts - query_shift)[..., None], kv * torch.exp(shift - state_shift)[
        ..., None, None
    ]


def _sums_and_gradients(scan_fn, leaves, probes, reference_shifts):
    sums, kv = _absolute(scan_fn(*leaves), reference_shifts)
    loss = (sums * probes[0]).sum() + (kv * probes[1]).sum()
    return (sums, kv, *torch.autograd.grad(loss, [t for t in leaves if t is not None and t.requires_grad]))


CASES = {
    "FAVOR++ (per-head directions, bias, key rows, padding, a state)": dict(
        length=100, d=16, m=80, width=9, per_head=True, bias=True, row=True, mask=True, state=True, stabilizer=0.0
    ),
    "plain FAVOR+ (shared directions, a stabilizer)": dict(
        length=70, d=16, m=64, width=17, per_head=False, bias=False, row=False, mask=False, state=False, stabilizer=1e-3
    ),
    "decoder heads (32 dims, 33 value columns)": dict(
        length=64, d=32, m=64, width=33, per_head=True, bias=True, row=True, mask=False, state=False, stabilizer=0.0
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("segment", [None, 32], ids=["one walk", "segments of 32"])
def test_the_kernels_give_the_scans_sums_state_and_gradients(case, segment, monkeypatch):
    """Sums, state after the call and the gradients of queries, keys, values, key rows and the state before, against
    the PyTorch scan in float64 (lengths past one chunk and not a multiple of it, features past one program's block
    and not a multiple of it), walked whole or in segments that run in parallel (2 to 4 here); each chunk's sums
    over blocks of 16 features, or of 32 (80 features: the last block partial)."""
    if segment:
        monkeypatch.setattr(favor_exp_triton, "MIN_SEGMENT", segment)
        monkeypatch.setattr(favor_exp_triton, "SUM_FEATURES", 32)
    settings = dict(CASES[case])
    stabilizer = settings.pop("stabilizer")
    q, k, v1, (directions, bias), row, mask, state = _scan_inputs(**settings)
    segments = favor_exp_triton.segments(6, directions.shape[-2], q.shape[2])[0]
    assert (segments > 1) == bool(segment)
    g = torch.Generator().manual_seed(1)
    probes = (
        torch.randn(*v1.shape, generator=g).double(),
        torch.randn(2, 3, directions.shape[-2], v1.shape[-1]).double(),
    )

    def pytorch(q, k, v1, row, kv0):
        keys, features = ScanKeys(k, v1, row, mask), ExpFeatures(directions, bias, stabilizer)
        return favor_exp.causal_exp_sums(q, keys, features, 32, None if state is None else (kv0, state[1]))

    def kernels(q, k, v1, row, kv0):
        f32 = (directions.float(), None if bias is None else bias.float())
        scan_state = None if state is None else (kv0, state[1].float())
        return favor_exp_triton.causal_exp_sums(q, k, v1, *f32, stabilizer, row, mask, scan_state)

    exact = [None if t is None else t.clone().requires_grad_() for t in (q, k, v1, row, state and state[0])]
    with torch.no_grad():
        scan = pytorch(*exact)
    shifts = (scan.q_shifts + scan.shifts, scan.shift)
    want = _sums_and_gradients(pytorch, exact, probes, shifts)
    leaves = [None if t is None else t.detach().float().to(DEVICE).requires_grad_() for t in exact]
    on_device = (shifts[0].float().to(DEVICE), shifts[1].float().to(DEVICE))
    got = _sums_and_gradients(kernels, leaves, [p.float().to(DEVICE) for p in probes], on_device)
    for a, b in zip(got, want, strict=True):
        error = (a.cpu().double() - b).abs().max() / b.abs().max()
        assert error < 1e-5, f"relative error {error:.2e}"


@pytest.mark.parametrize(
    "segment", [None, 32], ids=["one walk, 64 rows a program", "segments of 32, 32 rows a program"]
)
@pytest.mark.parametrize("case", ["padded keys, a stabilizer", "32 dims, 33 value columns"])
def test_the_bidirectional_kernels_give_the_sums_and_gradients(case, segment, monkeypatch):
    """Bidirectional sums (their ratio, what attention divides) and the gradients of queries, keys and values, against
    the PyTorch form in float64: more queries than keys, features past one program's block and not a multiple of
    it, the keys summed whole or in segments, the rows' kernel over 64 rows a program (as at head dims up to 32) or
    32 (wider), the last partial."""
    assert favor_exp_triton.rows_per_program(32) == 64
    if segment:
        monkeypatch.setattr(favor_exp_triton, "MIN_SEGMENT", segment)
        monkeypatch.setattr(favor_exp_triton, "WIDE_ROWS", 32)
    padded = case.startswith("padded")
    d, m, width = (16, 80, 9) if padded else (32, 64, 33)
    q, _, _, (directions, _), _, _, _ = _scan_inputs(100, d, m, width, False, False, False, False, False)
    _, k, v1, _, _, mask, _ = _scan_inputs(90, d, m, width, False, False, False, padded, False, seed=1)
    stabilizer = 1e-3 if padded else 0.0
    probe = torch.randn(2, 3, 100, width - 1, generator=torch.Generator().manual_seed(2)).double()

    def ratio(sums):
        return sums[..., :-1] / sums[..., -1:]

    exact = [t.clone().requires_grad_() for t in (q, k, v1)]
    pytorch = favor_exp.bidirectional_exp_sums(*exact, ExpFeatures(directions, None, stabilizer), mask)
    want = _outputs_and_gradients(lambda *leaves: ratio(pytorch), exact, probe)
    leaves = _float_leaves(q, k, v1)
    on_device = (directions.float().to(DEVICE), None, stabilizer, None if mask is None else mask.to(DEVICE))

    def kernels(q, k, v1):
        return ratio(favor_exp_triton.bidirectional_exp_sums(q, k, v1, *on_device))

    _assert_relatively_close(_outputs_and_gradients(kernels, leaves, probe.float().to(DEVICE)), want)


@pytest.fixture
def kernels_serve(monkeypatch):
    """The scan takes the kernels (as on CUDA) wherever it is called in float32 or lower (float64 calls keep PyTorch:
    the tests' reference; served too, they compared the kernels with themselves); counts the calls served."""
    calls = []

    def serves(q, *args):
        served = q.dtype != torch.float64
        calls.extend([1] if served else [])
        return served

    monkeypatch.setattr(favor_exp, "triton_serves", serves)
    return calls


@pytest.fixture
def key_state_launches(monkeypatch):
    """Counts the calls of the kernels' key state (``exp_key_state``), which run as they would."""
    launched, kernels = [], favor_exp.triton_exp_key_state
    monkeypatch.setattr(favor_exp, "triton_exp_key_state", lambda *args: launched.append(1) or kernels(*args))
    return launched


def _assert_same_state(kv: torch.Tensor, shift: torch.Tensor, want_kv: torch.Tensor, want_shift: torch.Tensor):
    """A state (kv relative to exp(shift)) from the kernels against a float64 one, to float32's rounding."""
    kv, shift = kv.cpu().double(), shift.cpu().double()
    assert (shift - want_shift).abs().max() < 1e-5
    relative = kv * torch.exp(shift - want_shift)[..., None, None]
    error = (relative - want_kv).abs().max() / want_kv.abs().max()
    assert error < 1e-5, f"relative error {error:.2e}"


def _float_leaves(*tensors):
    return [t.detach().float().to(DEVICE).requires_grad_() for t in tensors]


def _outputs_and_gradients(function, leaves, probe):
    out = function(*leaves)
    return (out, *torch.autograd.grad((out * probe).sum(), leaves))


def _assert_relatively_close(got, want, tol=1e-5):
    for a, b in zip(got, want, strict=True):
        error = (a.detach().cpu().double() - b).abs().max() / b.abs().max()
        assert error < tol, f"relative error {error:.2e}"


def test_bidirectional_favor_through_the_kernels_matches_pytorch(kernels_serve):
    """Plain bidirectional FAVOR+ (a padded batch) with its sums in the kernels against PyTorch in float64: outputs and
    the gradients of queries, keys and values."""
    q, k, v = random_qkv(length=75, head_dim=16)
    W = draw_projection(96, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mask = right_padding(2, 75, real=(75, 60))
    probe = torch.randn(2, 2, 75, 16, generator=torch.Generator().manual_seed(3)).double() * mask[:, None, :, None]

    def favor(q, k, v):
        return favor_attention(q, k, v, W.to(q.dtype).to(q.device), key_padding_mask=mask.to(q.device))

    got = _outputs_and_gradients(favor, _float_leaves(q, k, v), probe.float().to(DEVICE))
    assert len(kernels_serve) == 1
    want = _outputs_and_gradients(favor, [t.clone().requires_grad_() for t in (q, k, v)], probe)
    _assert_relatively_close(
        [got[0] * mask.to(DEVICE)[:, None, :, None], *got[1:]], [want[0] * mask[:, None, :, None], *want[1:]]
    )


def test_causal_favor_through_the_kernels_matches_pytorch(kernels_serve):
    """Causal FAVOR+ (a padded batch) with its scan in the kernels against the PyTorch scan in float64: outputs and
    the gradients of queries, keys and values; and a call continued from another's state equals one call."""
    q, k, v = random_qkv(length=75, head_dim=16)
    W = draw_projection(96, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mask = right_padding(2, 75, real=(75, 60))
    probe = torch.randn(2, 2, 75, 16, generator=torch.Generator().manual_seed(3)).double()

    def favor(q, k, v):
        projection = W.to(q.dtype).to(q.device)
        return favor_attention(q, k, v, projection, causal=True, key_padding_mask=mask.to(q.device))

    got = _outputs_and_gradients(favor, _float_leaves(q, k, v), probe.float().to(DEVICE))
    assert len(kernels_serve) == 1
    kernels_serve.clear()
    want = _outputs_and_gradients(favor, [t.clone().requires_grad_() for t in (q, k, v)], probe)
    assert not kernels_serve  # the float64 reference keeps PyTorch
    _assert_relatively_close(got, want)

    q32, k32, v32 = (t.float().to(DEVICE) for t in (q, k, v))
    W32 = W.float().to(DEVICE)
    first, state = favor_attention(q32[:, :, :40], k32[:, :, :40], v32[:, :, :40], W32, causal=True, return_state=True)
    rest = favor_attention(q32[:, :, 40:], k32[:, :, 40:], v32[:, :, 40:], W32, causal=True, initial_state=state)
    whole = favor_attention(q32, k32, v32, W32, causal=True)
    torch.testing.assert_close(torch.cat([first, rest], dim=2), whole, rtol=1e-5, atol=1e-6)
    assert len(kernels_serve) == 3


@pytest.mark.parametrize("causal", [False, True])
def test_the_kernels_differentiate_through_the_query_stabilizer(causal, monkeypatch):
    """FAVOR+ at the logits a real model reaches (q and k times 3: a query's features spread over orders of magnitude,
    so its 1e-6 stabilizer, relative to the largest, weighs) through the kernels in float32 against the PyTorch form
    in float64, whose gradients gradcheck (test_favor_attention). The kernels held each query's largest log-feature
    constant: the queries' gradients were 2.4e-2 (bidirectional) and 0.56 (causal) of their largest off. Each
    query's largest feature may lie past the first block of 64 (96 features)."""
    calls = []
    monkeypatch.setattr(favor_exp, "triton_serves", lambda q, *args: calls.append(q.dtype) or q.dtype == torch.float32)
    q, k, v = random_qkv(length=75, head_dim=16, scale=3.0)  # (v too: the ratio does not mind)
    W = draw_projection(96, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    probe = torch.randn(2, 2, 75, 16, generator=torch.Generator().manual_seed(3)).double()

    def favor(q, k, v):
        return favor_attention(q, k, v, W.to(q.dtype).to(q.device), causal=causal)

    got = _outputs_and_gradients(favor, _float_leaves(q, k, v), probe.float().to(DEVICE))
    want = _outputs_and_gradients(favor, [t.clone().requires_grad_() for t in (q, k, v)], probe)
    assert calls == [torch.float32, torch.float64]  # the kernels, then PyTorch
    _assert_relatively_close(got, want)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("segment", [None, 32], ids=["one walk", "segments of 32"])
def test_the_key_state_is_the_scans_state_after_every_key(case, segment, monkeypatch):
    """``exp_key_state`` (a decoding cache's state, without the sums) against the state after the PyTorch scan in
    float64 (``favor_exp.causal_exp_sums``) and its PyTorch form: the same kv relative to the same shift, keys with
    rows and padded or not, summed whole or in segments."""
    if segment:
        monkeypatch.setattr(favor_exp_triton, "MIN_SEGMENT", segment)
    settings = {**CASES[case], "state": False}
    stabilizer = settings.pop("stabilizer")
    q, k, v1, (directions, bias), row, mask, _ = _scan_inputs(**settings)
    features, keys = ExpFeatures(directions, bias, stabilizer), ScanKeys(k, v1, row, mask)
    scan = favor_exp.causal_exp_sums(q, keys, features, 32)
    pytorch_kv, pytorch_shift = favor_exp.exp_key_state(keys, features)
    torch.testing.assert_close(pytorch_shift, scan.shift, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pytorch_kv, scan.kv, rtol=1e-10, atol=1e-12)
    on_device = [None if t is None else t.float().to(DEVICE) for t in (k, v1, directions, bias, row)]
    kv, shift = favor_exp_triton.exp_key_state(*on_device, None if mask is None else mask.to(DEVICE))
    _assert_same_state(kv, shift, scan.kv, scan.shift)


def test_the_key_state_takes_the_kernels_where_no_gradient_is_asked(kernels_serve, key_state_launches):
    """``favor_exp.exp_key_state`` (a decoding cache's state without the sums: the causal hybrid's, of the keys that
    leave its window) through the kernels equals the state after the PyTorch scan in float64, keys padded; with a
    gradient asked for, it keeps PyTorch (the kernels' operator has none)."""
    settings = {**CASES["FAVOR++ (per-head directions, bias, key rows, padding, a state)"], "state": False}
    stabilizer = settings.pop("stabilizer")
    q, k, v1, (directions, bias), row, mask, _ = _scan_inputs(**settings)
    scan = favor_exp.causal_exp_sums(q, ScanKeys(k, v1, row, mask), ExpFeatures(directions, bias, stabilizer), 32)
    on_device = [t.float().to(DEVICE) for t in (k, v1, row, directions, bias)]
    features = ExpFeatures(*on_device[3:], stabilizer)
    with torch.no_grad():
        kv, shift = favor_exp.exp_key_state(ScanKeys(*on_device[:3], mask.to(DEVICE)), features)
    assert key_state_launches == [1]
    _assert_same_state(kv, shift, scan.kv, scan.shift)
    leaves = _float_leaves(k, v1)
    kv, shift = favor_exp.exp_key_state(ScanKeys(*leaves, on_device[2], mask.to(DEVICE)), features)
    kv.sum().backward()
    assert key_state_launches == [1] and leaves[0].grad is not None
    _assert_same_state(kv.detach(), shift, scan.kv, scan.shift)  # PyTorch's state: the same


DECODER = dict(far_field="softmax_opt", local_window=6, num_global_tokens=1, far_field_parameter=-0.05, causal=True)


def test_the_causal_hybrid_through_the_kernels_matches_the_dense_reference(kernels_serve):
    """The causal hybrid with a FAVOR++ far field (the decoder preset's form: a window, a global token, fixed centres),
    its lagged far field in the kernels, a padded batch: outputs against the dense reference in float64, gradients
    against the PyTorch scan's in float64."""
    q, k, v = random_qkv(length=70, head_dim=16)
    W = draw_projection(64, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mask = right_padding(2, 70, real=(70, 52))
    centres = [torch.randn(2, 16, generator=torch.Generator().manual_seed(seed)).double() * 0.3 for seed in (4, 5)]
    probe = torch.randn(2, 2, 70, 16, generator=torch.Generator().manual_seed(3)).double() * mask[:, None, :, None]

    def hybrid(q, k, v):
        to = dict(dtype=q.dtype, device=q.device)
        query_center, key_center = (c.to(**to) for c in centres)
        kwargs = dict(key_padding_mask=mask.to(q.device), query_center=query_center, key_center=key_center)
        return hybrid_attention(q, k, v, W.to(**to), **DECODER, **kwargs) * mask.to(q.device)[:, None, :, None]

    got = _outputs_and_gradients(hybrid, _float_leaves(q, k, v), probe.float().to(DEVICE))
    assert len(kernels_serve) == 1
    want = _outputs_and_gradients(hybrid, [t.clone().requires_grad_() for t in (q, k, v)], probe)
    dense = reference(q, k, v, W, mask=mask, query_center=centres[0], key_center=centres[1], **DECODER)
    _assert_relatively_close(got[:1], [dense * mask[:, None, :, None]])
    _assert_relatively_close(got[1:], want[1:])


def test_the_causal_hybrids_prefill_state_takes_the_kernels(kernels_serve, key_state_launches):
    """``hybrid_prefill_state`` of the decoder preset's form (a FAVOR++ far field around fixed centres, a window, a
    global token), a padded batch: its far field's state through the kernels equals the state ``hybrid_attention``
    returns in float64, and its window buffer and global keys are the same keys."""
    from performer_hf.modeling.favor_hybrid import hybrid_prefill_state

    q, k, v = random_qkv(length=70, head_dim=16)
    W = draw_projection(64, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mask = right_padding(2, 70, real=(70, 52))
    centres = [torch.randn(2, 16, generator=torch.Generator().manual_seed(seed)).double() * 0.3 for seed in (4, 5)]
    settings = {name: value for name, value in DECODER.items() if name not in ("far_field_parameter", "causal")}
    spec, parameter = HybridSpec(**settings), DECODER["far_field_parameter"]

    def kwargs(device, dtype):
        query_center, key_center = (c.to(device, dtype) for c in centres)
        return dict(key_padding_mask=mask.to(device), query_center=query_center, key_center=key_center)

    _, want = hybrid_attention(
        q, k, v, W, spec, far_field_parameter=parameter, return_state=True, causal=True, **kwargs("cpu", q.dtype)
    )
    with torch.no_grad():
        on_device = [t.float().to(DEVICE) for t in (q, k, v, W)]
        got = hybrid_prefill_state(*on_device, spec, far_field_parameter=parameter, **kwargs(DEVICE, torch.float32))
    assert key_state_launches == [1]
    _assert_same_state(got.far_kv, got.far_shift, want.far_kv, want.far_shift)
    for name in ("keys", "values", "key_mask", "global_keys", "global_values", "global_mask"):
        torch.testing.assert_close(getattr(got, name).cpu(), getattr(want, name).to(getattr(got, name).dtype))
    assert got.length == want.length == 70


@pytest.mark.parametrize("segment", [None, 16], ids=["one walk", "segments of 16"])
def test_the_kernels_compile_into_one_graph_as_eager(kernels_serve, segment, monkeypatch):
    """Causal and bidirectional FAVOR+ through the kernels' operators compiled (aot_eager) equal eager, in one graph
    each (the causal segments' start states an output whose shape the traced graph must know)."""
    if segment:
        monkeypatch.setattr(favor_exp_triton, "MIN_SEGMENT", segment)
    q, k, v = _float_leaves(*random_qkv(length=40, head_dim=16))
    W = draw_projection(64, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for causal in (True, False):
        function = functools.partial(favor_attention, projection=W, causal=causal)
        assert_one_graph_as_eager(function, [q, k, v], rtol=1e-5, atol=1e-6)
    assert kernels_serve


def test_the_operators_take_rows_of_any_strides(monkeypatch):
    """Every operator gives the same outputs for rows that are not contiguous (inductor may pad them), and its fake
    outputs have the real ones' strides: on a GPU, a compiled backward stopped at inductor's check of the
    bidirectional gradients' strides, which followed transposed inputs in the fake and not in the kernels."""
    monkeypatch.setattr(favor_exp_triton, "MIN_SEGMENT", 32)  # 96 positions: 3 segments
    g = torch.Generator().manual_seed(0)
    B, H, L, d, m, E = 1, 2, 96, 16, 64, 9
    q, k = (torch.randn(B, H, L, d, generator=g) * 0.3 for _ in range(2))
    v1, grad = (torch.randn(B, H, L, E, generator=g) for _ in range(2))
    q_off, k_off = (torch.randn(B, H, L, generator=g) - 1 for _ in range(2))
    q_top = torch.randint(m, (B, H, L), generator=g, dtype=torch.int32)
    directions, bias = torch.randn(m, d, generator=g) * 0.3, torch.randn(H, 1, m, generator=g) * 0.1
    kv0, shift0, shifts = torch.rand(B, H, m, E, generator=g), torch.zeros(B, H), torch.zeros(B, H, L)
    q, k, v1, grad, q_off, q_top, k_off, directions, bias, kv0, shift0, shifts = (
        t.to(DEVICE) for t in (q, k, v1, grad, q_off, q_top, k_off, directions, bias, kv0, shift0, shifts)
    )
    ops, features = torch.ops.performer_hf, (directions, bias)
    assert_strides_do_not_matter(ops.exp_row_max_v2.default, [q, *features, "pytorch"])
    scan = [q, k, v1, q_off, q_top, k_off, shifts, *features, kv0, shift0, 1e-3, "pytorch"]
    assert_strides_do_not_matter(ops.causal_exp_scan_v2.default, scan)
    starts = ops.causal_exp_scan_v2(*scan)[2]
    assert starts.shape[2] == 3
    scan_backward = [grad, kv0, q, k, v1, q_off, q_top, k_off, shifts, *features, starts, shift0, 1e-3, "pytorch"]
    assert_strides_do_not_matter(ops.causal_exp_scan_backward_v2.default, scan_backward)
    sums = [q, k, v1, q_off, q_top, k_off, *features, 1e-3, "pytorch"]
    assert_strides_do_not_matter(ops.bidirectional_exp_sums_v2.default, sums)
    kv = ops.bidirectional_exp_sums_v2(*sums)[1]
    sums_backward = [grad, q, k, v1, q_off, q_top, k_off, *features, kv, 1e-3, "pytorch"]
    assert_strides_do_not_matter(ops.bidirectional_exp_sums_backward_v2.default, sums_backward)
    assert_strides_do_not_matter(ops.exp_key_state.default, [k, k_off, v1, *features, "pytorch"])


def test_only_cuda_float32_queries_of_tile_dims_and_fixed_features_are_served(monkeypatch):
    directions = torch.randn(64, 32)
    x = torch.randn(1, 2, 8, 32)
    if torch.cuda.is_available():
        x, directions = x.cuda(), directions.cuda()
        assert favor_exp_triton.serves(x, 33, directions, None)
        assert not favor_exp_triton.serves(x.double(), 33, directions.double(), None)  # float32 only
        assert not favor_exp_triton.serves(x[..., :24], 33, directions[:, :24], None)  # a power of two
        assert favor_exp_triton.serves(x, 129, directions, None)  # 128 columns, the normaliser's apart
        assert not favor_exp_triton.serves(x, 130, directions, None)  # a tile of at most 128 value columns
        assert not favor_exp_triton.serves(x, 33, directions.requires_grad_(), None)  # a learned parameter
        with torch.no_grad():
            assert favor_exp_triton.serves(x, 33, directions, None)
        monkeypatch.setenv("PERFORMER_HF_TRITON", "0")
        assert not favor_exp_triton.serves(x, 33, directions.detach(), None)
    else:
        assert not favor_exp_triton.serves(x, 33, directions, None)  # no CUDA


CUDA_CALLS = ["the converter's causal hybrid preset", "causal FAVOR+", "bidirectional FAVOR+"]


@pytest.mark.cuda
@pytest.mark.parametrize("call", CUDA_CALLS)
def test_cuda_kernels_match_the_cpu_in_float32_and_bfloat16(call, monkeypatch):
    """On a GPU, at 4K tokens (2 x 4 heads: the walks cut into 8 segments), forward and backward through the kernels
    against the float32 CPU path: the converter's causal preset (FAVOR++ far field, a window of 64, a global token),
    and plain FAVOR+ both ways."""
    preset = ATTENTION_METHODS["hybrid"].presets["causal"]
    settings = {name: preset[field] for name, field in HybridSpec.config_fields().items() if field in preset}
    q, k, v = (t.float() for t in random_qkv(batch=2, heads=4, length=4096, head_dim=32, seed=11))
    grad = torch.randn(2, 4, 4096, 32, generator=torch.Generator().manual_seed(12))
    W = draw_projection(256, 32, generator=torch.Generator().manual_seed(13))
    centres = [torch.randn(4, 32, generator=torch.Generator().manual_seed(seed)) * 0.1 for seed in (14, 15)]
    calls = []
    for name in ("triton_causal_exp_sums", "triton_bidirectional_exp_sums"):
        kernels = getattr(favor_exp, name)
        monkeypatch.setattr(favor_exp, name, lambda *args, kernels=kernels: calls.append(1) or kernels(*args))
    causal = call != "bidirectional FAVOR+"

    def attend(q, k, v):
        device = q.device
        if call.startswith("the converter's"):
            query_center, key_center = (c.to(device) for c in centres)
            kwargs = dict(query_center=query_center, key_center=key_center, far_field_parameter=-0.05, **settings)
            return hybrid_attention(q, k, v, W.to(device), causal=True, **kwargs)
        return favor_attention(q, k, v, W.to(device), causal=causal)

    def run(device, dtype, inputs=(q, k, v)):
        inputs = [t.detach().to(device, dtype).requires_grad_() for t in inputs]
        out = attend(*inputs)
        (out.float() * grad.to(device)).sum().backward()
        return [t.detach().float().cpu() for t in (out, *(i.grad for i in inputs))]

    reference_cpu = run("cpu", torch.float32)
    rounded_cpu = run("cpu", torch.float32, [t.bfloat16().float() for t in (q, k, v)])
    bfloat16 = bfloat16_tolerances(rounded_cpu, reference_cpu, sdpa_bfloat16_errors(q, k, v, grad, causal))
    for dtype, tolerances in ((torch.float32, [1e-4] * 4), (torch.bfloat16, bfloat16)):
        for got, want, tolerance in zip(run("cuda", dtype), reference_cpu, tolerances, strict=True):
            assert torch.isfinite(got).all()
            assert (got - want).norm() / want.norm() < tolerance, dtype
    assert len(calls) == 2  # the kernels served both
