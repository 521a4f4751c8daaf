"""The compiled CPU kernel of hybrid attention against the PyTorch implementation and the dense reference."""

import dataclasses
import functools
import logging

import pytest
import torch

import performer_hf.modeling.cpu_kernels as cpu_kernels
from performer_hf.favor import exact_attention
from performer_hf.modeling import far_field_polynomial
from performer_hf.modeling.favor_hybrid import hybrid_attention
from performer_hf.modeling.hybrid_keys import Keys, pad_keys
from performer_hf.modeling.hybrid_routing import group_bounds, key_blocks, query_blocks, route

from ..hybrid_reference import (
    CONFIGS,
    QUADRATIC,
    assert_rows_within_one_window_are_their_softmax,
    random_qkv,
    reference,
    right_padding,
)


def test_the_kernel_builds_on_this_machine():
    # CI machines have a C++ compiler: a build failure must fail here, not silently fall back everywhere.
    kernels = cpu_kernels.hybrid_kernels()
    assert kernels is not None
    assert kernels.max_value_width >= 129


def _spy_on_kernel(monkeypatch) -> list:
    """Record the calls that reach the compiled support sums."""
    kernels = cpu_kernels.hybrid_kernels()
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(kernels, name)

        def hybrid_support_sums(self, *args):
            calls.append(args)
            return kernels.hybrid_support_sums(*args)

    monkeypatch.setattr("performer_hf.modeling.hybrid_backends.hybrid_kernels", Spy)
    return calls


@pytest.mark.parametrize("far_field", sorted(QUADRATIC))
@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_matches_dense_reference_in_float64(far_field, config, padded, monkeypatch):
    calls = _spy_on_kernel(monkeypatch)
    q, k, v = random_qkv()
    mask = right_padding(2, 45) if padded else None
    out = hybrid_attention(q, k, v, key_padding_mask=mask, far_field=far_field, center=True, **config)
    ref = reference(q, k, v, mask=mask, far_field=far_field, center=True, **config)
    assert len(calls) == 1  # the kernel ran
    if mask is not None:
        out, ref = out * mask[:, None, :, None], ref * mask[:, None, :, None]
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)


def test_kernel_routing_every_key_block_without_a_window_is_softmax_attention(monkeypatch):
    """The compiled kernels' routing without a window: the query block's own key block is a candidate too, so that
    routing every block is exact softmax attention."""
    calls = _spy_on_kernel(monkeypatch)
    q, k, v = random_qkv(length=48, scale=2.0)
    out = hybrid_attention(q, k, v, far_field="poly2", routed_blocks=12, route_block_size=4, query_block_size=4)
    assert len(calls) == 1  # the kernel ran
    torch.testing.assert_close(out, exact_attention(q, k, v), rtol=1e-9, atol=1e-10)


def _long_inputs(length=700, heads=3, head_dim=16, value_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, heads, length, head_dim, generator=g) * 1.5 for _ in range(2))
    v = torch.randn(2, heads, length, value_dim, generator=g)
    mask = torch.arange(length)[None, :] < torch.tensor([length, length - 123])[:, None]
    return q, k, v, mask


@pytest.mark.parametrize(
    "settings",
    [
        dict(local_window=17, num_global_tokens=1, routed_blocks=24, route_block_size=8, query_block_size=16),
        dict(local_window=32, num_global_tokens=3, routed_blocks=5, route_block_size=16, query_block_size=8),
        dict(local_window=0, num_global_tokens=0, routed_blocks=7, route_block_size=5, query_block_size=7),
        dict(
            local_window=17,
            num_global_tokens=1,
            routed_blocks=6,
            route_block_size=8,
            route_group_size=4,
            query_block_size=16,
        ),
    ],
    ids=["default-conversion", "wide-window", "routing-only", "routing-groups"],
)
@pytest.mark.parametrize("value_dim", [16, 40])
def test_kernel_matches_pytorch_in_float32(settings, value_dim, monkeypatch):
    q, k, v, mask = _long_inputs(value_dim=value_dim)
    kwargs = dict(key_padding_mask=mask, far_field="poly2", center=True, **settings)
    calls = _spy_on_kernel(monkeypatch)
    fused = hybrid_attention(q, k, v, **kwargs)
    assert len(calls) == 1
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    plain = hybrid_attention(q, k, v, **kwargs)
    keep = mask[:, None, :, None]
    torch.testing.assert_close(fused * keep, plain * keep, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("far_field", sorted(QUADRATIC))
@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_gradients_match_dense_reference_in_float64(far_field, config, padded, monkeypatch):
    # Training runs the compiled support sums and their compiled backward.
    calls = _spy_on_kernel(monkeypatch)
    q, k, v = (t.requires_grad_() for t in random_qkv())
    mask = right_padding(2, 45) if padded else None
    keep = 1.0 if mask is None else mask[:, None, :, None]  # padded queries' outputs are unspecified
    probe = torch.randn(q.shape[:3] + v.shape[-1:], generator=torch.Generator().manual_seed(9), dtype=v.dtype)
    grads = []
    for attention in (hybrid_attention, reference):
        out = (
            attention(q, k, v, key_padding_mask=mask, far_field=far_field, center=True, **config)
            if attention is hybrid_attention
            else attention(q, k, v, mask=mask, far_field=far_field, center=True, **config)
        )
        grads.append(torch.autograd.grad((out * keep * probe).sum(), (q, k, v)))
    assert len(calls) == 1  # the kernel ran
    for fast, slow in zip(*grads, strict=True):
        torch.testing.assert_close(fast, slow, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("config", [CONFIGS[3], CONFIGS[7]], ids=["routed", "routing-groups"])
def test_kernel_takes_the_far_field_gain(config, monkeypatch):
    # learned per-head gains (attention transfer) run in the compiled kernels, outputs and gradients, the gain's too
    calls = _spy_on_kernel(monkeypatch)
    q, k, v = (t.requires_grad_() for t in random_qkv())
    gain = torch.tensor([0.3, 1.7], dtype=torch.float64, requires_grad=True)  # one per head
    mask = right_padding(2, 45)
    keep = mask[:, None, :, None]
    kwargs = dict(far_field="poly2", center=True, far_field_gain=gain, **config)
    out = hybrid_attention(q, k, v, key_padding_mask=mask, **kwargs) * keep
    ref = reference(q, k, v, mask=mask, **kwargs) * keep
    assert len(calls) == 1
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    for fast, slow in zip(
        torch.autograd.grad((out * probe).sum(), (q, k, v, gain)),
        torch.autograd.grad((ref * probe).sum(), (q, k, v, gain)),
        strict=True,
    ):
        torch.testing.assert_close(fast, slow, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("value_dim", [16, 40])
def test_kernel_gradients_match_pytorch_in_float32(value_dim, monkeypatch):
    q, k, v, mask = _long_inputs(length=300, value_dim=value_dim)
    kwargs = dict(
        key_padding_mask=mask,
        far_field="poly2",
        center=True,
        local_window=17,
        num_global_tokens=1,
        routed_blocks=6,
        route_block_size=8,
        query_block_size=16,
    )
    keep = mask[:, None, :, None]
    probe = torch.randn(q.shape[:3] + v.shape[-1:], generator=torch.Generator().manual_seed(9))
    grads = []
    for enabled in ("1", "0"):
        monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", enabled)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = hybrid_attention(*inputs, **kwargs)
        grads.append(torch.autograd.grad((out * keep * probe).sum(), inputs))
    for fused, plain in zip(*grads, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("far_field", sorted(QUADRATIC))
@pytest.mark.parametrize("head_dim,own_logit", [(8, -30.0), (64, -8.0)])
def test_a_row_whose_support_holds_all_its_keys_is_their_softmax(far_field, head_dim, own_logit, monkeypatch):
    """As tests/modeling/test_favor_hybrid.py checks in PyTorch: the kernel took the rounding of its sums over every
    key minus those on the support as the far field (poly2, a lone token at logit -30: outputs 5.9 from its value);
    it is none there now."""
    calls = _spy_on_kernel(monkeypatch)
    assert_rows_within_one_window_are_their_softmax(far_field, head_dim, own_logit)
    assert len(calls) == 1


def test_the_far_state_is_the_state_accelerators_build_from_features(monkeypatch):
    # one layout for the polynomial state: the kernels' (B, H, F, dv + 1) sums are PyTorch's from explicit features
    monkeypatch.setattr(far_field_polynomial, "from_features", lambda device: True)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 3, 50, 8, generator=g, dtype=torch.float64)
    wv1 = torch.randn(2, 3, 50, 5, generator=g, dtype=torch.float64)
    compiled = cpu_kernels.hybrid_kernels().quadratic_far_state(w, wv1, 0.25)
    torch.testing.assert_close(compiled, far_field_polynomial.quadratic_state(w, wv1, 0.25), rtol=1e-12, atol=1e-12)


def test_top_blocks_matches_topk():
    kernels = cpu_kernels.hybrid_kernels()
    scores = torch.randn(2, 3, 5, 40, generator=torch.Generator().manual_seed(0))
    scores[0, 0, 0, 10:] = float("-inf")  # only 10 finite: the other choices are -1
    chosen = kernels.top_blocks(scores, 12)
    top = scores.topk(12, dim=-1)
    expected = top.indices.masked_fill(~torch.isfinite(top.values), -1)
    assert torch.equal(chosen.sort(dim=-1).values, expected.sort(dim=-1).values)
    assert (chosen[0, 0, 0] == -1).sum() == 2


def test_routed_candidates_match_grouped_routing_in_pytorch():
    # 600 keys: 75 key blocks of 8 in 19 groups of 4 (the last partial), 6 groups kept per query block
    kernels = cpu_kernels.hybrid_kernels()
    x, y = (torch.randn(2, 3, 608, 16, generator=torch.Generator().manual_seed(seed)) for seed in (0, 1))
    mask = torch.arange(608)[None, :] < torch.tensor([600, 437])[:, None]
    keys = Keys(y, None, None, mask, None)
    blocks = key_blocks(pad_keys(keys, 0, -608 % 8), 8, group_size=4)
    xq, q_mask = x.view(2, 3, 38, 16, 16), mask.view(2, 38, 16)
    chosen, real = route(xq, q_mask, blocks, 0, 8, 8, 8, 6)
    queries = query_blocks(xq, q_mask, 0, 8, 8)
    groups = kernels.top_blocks(group_bounds(queries, blocks, 8, 6).contiguous(), 6)
    tensors = [
        queries.means.contiguous(),
        blocks.means,
        blocks.has_keys,
        groups,
        queries.window_lo.flatten(),
        queries.window_hi.flatten(),
    ]
    compiled = kernels.routed_candidates(tensors, [8, 4, 6])
    rows = q_mask.any(-1)[:, None, :].expand(2, 3, 38)  # query blocks past the padding tie everywhere: skipped
    expected = chosen.masked_fill(~real, -1).sort(dim=-1).values[rows]
    assert torch.equal(compiled.sort(dim=-1).values[rows], expected)
    ungrouped, _ = route(xq, q_mask, key_blocks(pad_keys(keys, 0, -608 % 8), 8), 0, 8, 8, 8, 6)
    assert not torch.equal(ungrouped.sort(dim=-1).values[rows], expected)  # the groups changed some choices


def test_disabled_kernels_use_pytorch(monkeypatch):
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    assert cpu_kernels.hybrid_kernels() is None
    q, k, v = random_qkv()
    out = hybrid_attention(q, k, v, far_field="poly2", local_window=5)
    torch.testing.assert_close(out, reference(q, k, v, far_field="poly2", local_window=5), rtol=1e-9, atol=1e-10)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def broken_build(**_):
        raise RuntimeError("Error building extension 'performer_hf_hybrid': no compiler here")

    monkeypatch.setattr(cpp_extension, "load", broken_build)
    # a fresh cache, so that this process's successful build is not reused
    monkeypatch.setattr(cpu_kernels, "_compiled_kernels", functools.cache(cpu_kernels._compiled_kernels.__wrapped__))
    q, k, v = random_qkv()
    with caplog.at_level(logging.WARNING, logger="performer_hf.modeling.cpu_kernels"):
        out = hybrid_attention(q, k, v, far_field="poly2", local_window=5)
        hybrid_attention(q, k, v, far_field="poly2", local_window=5)
    torch.testing.assert_close(out, reference(q, k, v, far_field="poly2", local_window=5), rtol=1e-9, atol=1e-10)
    warnings = [r for r in caplog.records if "kernel unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no compiler here" in warnings[0].getMessage()


@pytest.fixture
def decode_kernel_calls(monkeypatch) -> list:
    """The arguments of every call of the compiled sparse decoding step that sparse_attention makes."""
    kernels, calls = cpu_kernels.hybrid_kernels(), []

    class Spy:
        def sparse_decode_step(self, *args):
            calls.append(args)
            return kernels.sparse_decode_step(*args)

    monkeypatch.setattr("performer_hf.modeling.sparse_attention.hybrid_kernels", Spy)
    return calls


@pytest.mark.parametrize("head_dim", [8, 64, 72])  # below, at and beyond the kernel's 16-lane dot products
@pytest.mark.parametrize("left_padded", [False, True])
def test_sparse_decoding_step_kernel_matches_the_reference(head_dim, left_padded, decode_kernel_calls):
    """One float32 query per head over a key/value cache, without gradients: the compiled step runs and matches
    the float64 one-query-at-a-time reference, for every keep-all geometry of the sparse tests."""
    from performer_hf.modeling.sparse_attention import sparse_attention

    from ..sparse_reference import reference_sparse
    from .test_sparse_attention import KEEP_ALL

    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 6, 93, head_dim, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(2, 2, 93, head_dim, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    mask = torch.arange(93)[None] >= torch.tensor([[0], [17 if left_padded else 0]])
    for spec in KEEP_ALL.values():
        expected = reference_sparse(q, k, v, spec, mask)[:, :, -1:]
        with torch.no_grad():
            step = sparse_attention(q[:, :, -1:].float(), k.float(), v.float(), spec, mask if left_padded else None)
        torch.testing.assert_close(step.double(), expected, rtol=1e-5, atol=1e-5)
    assert len(decode_kernel_calls) == len(KEEP_ALL) - 1  # "select everything" reads every key: SDPA, not the kernel


@pytest.mark.parametrize("name", ["latest ranking", "window and globals only", "latest, globals beyond a block"])
def test_bounded_decoding_step_kernel_matches_the_block_walk(name, decode_kernel_calls):
    """Bounded decoding one float32 token at a time without gradients, as the cache layer runs it (the compiled
    step, the stored keys grown in place) against the float64 block walk from the same prefill: the same outputs,
    and the pool keeps the same blocks with the same scores at every step, across blocks that leave the window and
    left padding."""
    from performer_hf.modeling.sparse_attention import sparse_attention
    from performer_hf.modeling.sparse_spec import SparseSpec

    spec = {
        "latest ranking": SparseSpec(8, 2, 4, select_blocks=2, budget=3, ranking="latest"),
        "window and globals only": SparseSpec(8, 2, 4, select_blocks=0),
        "latest, globals beyond a block": SparseSpec(12, 6, 4, select_blocks=3, budget=4, ranking="latest"),
    }[name]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 80, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 80, 64, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.arange(80)[None] >= torch.tensor([[0], [7]])
    prompt = 41
    _, walked = sparse_attention(
        q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], spec, mask[:, :prompt], return_state=True
    )
    compiled = type(walked)(*(t.float() if torch.is_tensor(t) and t.is_floating_point() else t for t in walked))
    for t in range(prompt, 80):
        args = [x[:, :, t : t + 1] for x in (q, k, v)]
        expected, walked = sparse_attention(*args, spec, mask[:, t : t + 1], walked, return_state=True)
        with torch.no_grad():
            out, compiled = sparse_attention(
                *(x.float() for x in args), spec, mask[:, t : t + 1], compiled, return_state=True, grow_in_place=True
            )
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        for ours, theirs in zip(compiled, walked, strict=True):
            if torch.is_tensor(ours) and ours.is_floating_point():
                torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(ours, theirs) if torch.is_tensor(ours) else ours == theirs
    assert len(decode_kernel_calls) == 80 - prompt


@pytest.fixture
def block_kernel_calls(monkeypatch) -> list:
    """The query heads per key head (G) of every call of the compiled blocks of sparse attention that
    sparse_attention makes: one block of queries, or the loop over a call's blocks."""
    kernels, calls = cpu_kernels.hybrid_kernels(), []

    class Spy:
        def sparse_block_attend(self, logits, values, masks, candidates, geometry):
            calls.append(geometry[0])
            return kernels.sparse_block_attend(logits, values, masks, candidates, geometry)

        def sparse_walk_attend(self, q, keys, *args):
            calls.append(q.shape[1] // keys.shape[1])
            return kernels.sparse_walk_attend(q, keys, *args)

    monkeypatch.setattr("performer_hf.modeling.sparse_attention.hybrid_kernels", Spy)
    return calls


@pytest.mark.parametrize("head_dim", [8, 64, 72])  # the value rows below, at and beyond a vector's width
@pytest.mark.parametrize("heads", [4, 2], ids=["grouped", "one per key head"])
def test_sparse_block_kernel_matches_the_reference(head_dim, heads, block_kernel_calls):
    """A float32 prefill without gradients (the compiled block of queries, every query block walked) against the
    float64 one-query-at-a-time reference, for every geometry of the sparse tests (bounded pools, budgets, global
    tokens beyond a block, no selection), with right and left padding."""
    from performer_hf.modeling.sparse_attention import sparse_attention

    from ..sparse_reference import reference_sparse
    from .test_sparse_attention import SPECS, _inputs

    q, k, v, mask = _inputs(heads=heads, length=70, dim=head_dim, seed=head_dim)  # 2 key heads, row 1 right-padded
    mask[0, :5] = False  # row 0 left-padded
    # laid out as a model's projections give them: (B, L, H, D) memory, viewed (B, H, L, D)
    q32, k32, v32 = (t.float().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    for name, spec in SPECS.items():
        expected = reference_sparse(q, k, v, spec, mask)
        with torch.no_grad():
            out = sparse_attention(q32, k32, v32, spec, mask)
        real = mask[:, None, :, None]
        torch.testing.assert_close(out.double() * real, expected * real, rtol=1e-5, atol=1e-5, msg=name)
    assert block_kernel_calls and set(block_kernel_calls) == {heads // 2}  # G


@pytest.mark.parametrize("first", [0, 13, 40])  # the whole call, a partial first block, after whole blocks
def test_the_compiled_walk_matches_the_walk_block_by_block(first, monkeypatch):
    """The compiled loop over a call's blocks of queries (``csrc/sparse_walk.cpp``) against the Python loop over the
    same blocks (each through the block kernel), float32, for every geometry of the sparse tests whose candidates
    are the stored keys before the window, left and right padding: the same context, choice and log-sum-exps."""
    from performer_hf.modeling.sparse_attention import _BlockWalk, _cpu_kernels
    from performer_hf.modeling.sparse_spec import SparseState

    from .test_sparse_attention import SPECS, _inputs

    kernels, walked = cpu_kernels.hybrid_kernels(), []

    class Spy:  # the block kernel as it is; the compiled loop counted (a fallback to Python would compare it to itself)
        sparse_block_attend = staticmethod(kernels.sparse_block_attend)

        def sparse_walk_attend(self, *args):
            walked.append(args[-1])  # geometry
            return kernels.sparse_walk_attend(*args)

    monkeypatch.setattr("performer_hf.modeling.sparse_attention.hybrid_kernels", Spy)

    q, k, v, mask = (t.float() if t.is_floating_point() else t for t in _inputs(length=70, dim=16, seed=first))
    mask[0, :5] = False  # row 0 left-padded, row 1 right-padded
    assert _cpu_kernels(q, k, v) is not None
    latest = {
        f"{name}, latest": dataclasses.replace(spec, ranking="latest") for name, spec in SPECS.items() if spec.budget
    }
    compared = 0
    for name, spec in {**SPECS, **latest}.items():
        n, state = spec.num_global_tokens, SparseState.empty(k, v, spec.block_size)
        walk = _BlockWalk(k, v, mask, (k[:, :, :n], v[:, :, :n], mask[:, :n]), state, spec)
        if walk.pool_alone:  # candidates from a pool: the Python loop alone
            continue
        with torch.no_grad():
            compiled, blockwise = walk.walk(q[:, :, first:], first), walk._walk_blocks(q[:, :, first:], first)
        torch.testing.assert_close(compiled[0], blockwise[0], rtol=1e-6, atol=1e-6, msg=name)
        assert torch.equal(compiled[1], blockwise[1]), name
        torch.testing.assert_close(compiled[2], blockwise[2], rtol=1e-6, atol=1e-6, msg=name)
        compared += 1
        assert len(walked) == compared, name
    assert compared == 5


@pytest.mark.parametrize(
    ("block", "G", "W", "D"),
    [(8, 3, 24, 64), (64, 5, 150, 80)],  # blocks of whole 64-key steps, heads past a register tile, partial steps
    ids=["small blocks", "64-key blocks"],
)
def test_sparse_block_kernel_chooses_what_pytorch_chooses(block, G, W, D, monkeypatch):
    """One block of queries over a pool of 150 candidate blocks, 8 read (the kernel's products: tiles, the last
    partial; one block every key of which is hidden): the kernel's context, window probabilities, choice and
    log-sum-exps against the PyTorch steps' on the same float32 inputs."""
    from performer_hf.modeling import sparse_attention as module
    from performer_hf.modeling.sparse_spec import SparseSpec

    spec = SparseSpec(local_window=block, num_global_tokens=2, block_size=block, select_blocks=8)
    g = torch.Generator().manual_seed(7)
    B, Hkv, nq, C = 2, 3, 8, 150 * block
    queries = torch.randn(B, Hkv, G, nq, D, generator=g) * 2
    pool_keys, pool_values = torch.randn(2, B, Hkv, C, D, generator=g).unbind(0)
    pool_mask = torch.rand(B, C, generator=g) > 0.1  # some keys hidden
    pool_mask[:, 5 * block : 6 * block] = False  # every key of block 5
    pool_mask = pool_mask[:, None].expand(B, Hkv, C)
    window_keys, window_values = torch.randn(2, B, Hkv, W, D, generator=g).unbind(0)
    window_visible = (torch.arange(W) <= torch.arange(nq)[:, None] + W - nq)[None, None].expand(B, 1, nq, W)
    global_keys, global_values = torch.randn(2, B, Hkv, 2, D, generator=g).unbind(0)
    parts = [
        (global_keys, global_values, torch.tensor([[True, False], [True, True]])[:, None, None]),
        (window_keys, window_values, window_visible),
    ]
    candidates = (pool_keys, pool_values, pool_mask)
    compiled = module._attend_forward(queries, parts, candidates, spec)
    monkeypatch.setattr(module, "hybrid_kernels", lambda: None)
    eager = module._attend_forward(queries, parts, candidates, spec)
    assert compiled[2].shape == (B, Hkv, nq, 150) and bool((compiled[2].sum(-1) == 8).all())
    assert not compiled[2][..., 5].any()
    assert torch.equal(compiled[2], eager[2])
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(compiled[3], eager[3], rtol=1e-6, atol=1e-5)  # each row's log-sum-exp, for backward


def test_sparse_training_through_the_block_kernel_matches_the_reference(block_kernel_calls):
    """Float32 gradients whose forward ran in the compiled block kernel, against the float64 reference's."""
    from performer_hf.modeling.sparse_attention import sparse_attention

    from ..sparse_reference import reference_sparse
    from .test_sparse_attention import SPECS, _gradients, _inputs

    q, k, v, mask = _inputs(length=46, dim=16)
    for name in ("window+globals+select", "bounded pool"):
        ours = _gradients(sparse_attention, SPECS[name], *(t.float() for t in (q, k, v)), mask)
        expected = _gradients(reference_sparse, SPECS[name], q, k, v, mask)
        for got, want in zip(ours, expected, strict=True):
            # float32 sums of gradients up to ~50: 1.2e-5 apart where they cancel, on an AVX-512 CPU
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=name)
    assert block_kernel_calls
