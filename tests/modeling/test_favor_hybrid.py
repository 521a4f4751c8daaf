"""hybrid_attention against an explicit O(L^2) reference: dense support mask, explicit kernel matrix."""

import pytest
import torch

import performer_hf.modeling.slabs as slabs_module
from performer_hf.favor import FAR_FIELDS, HybridSpec, draw_projection, exact_attention, hybrid_attention
from performer_hf.modeling import far_field_polynomial, hybrid_routing

from ..hybrid_reference import (
    CONFIGS,
    QUADRATIC,
    assert_rows_within_one_window_are_their_softmax,
    random_qkv,
    reference,
    right_padding,
)


@pytest.fixture(autouse=True)
def pytorch_implementation(monkeypatch):
    """This file tests the PyTorch implementation; tests/modeling/test_cpu_kernels.py tests the compiled one."""
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")


def _projection(m=24, d=8, seed=1):
    return draw_projection(m, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _kwargs(far_field, causal, config):
    kwargs = dict(far_field=far_field, causal=causal, **config)
    if far_field == "softmax_opt" and causal:
        kwargs["far_field_parameter"] = -0.05
    return kwargs


def _config_id(config):
    return "-".join(f"{k[:5]}{v}" for k, v in config.items())


# routing is bidirectional only (test_argument_errors checks that causal routing raises)
CASES = [
    (causal, config) for causal in (False, True) for config in CONFIGS if not (causal and "routed_blocks" in config)
]


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
@pytest.mark.parametrize("causal,config", CASES, ids=[f"causal{c}-{_config_id(cfg)}" for c, cfg in CASES])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_dense_reference(far_field, causal, config, padded):
    q, k, v = random_qkv()
    W = _projection()
    mask = right_padding(2, 45) if padded else None
    kwargs = _kwargs(far_field, causal, config)
    center = not causal and far_field != "softmax_hyperbolic"  # exercise both
    out = hybrid_attention(q, k, v, W, key_padding_mask=mask, center=center, chunk_size=8, **kwargs)
    ref = reference(q, k, v, W, mask=mask, center=center, **kwargs)
    if mask is not None:  # padded queries' outputs are unspecified
        out, ref = out * mask[:, None, :, None], ref * mask[:, None, :, None]
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
@pytest.mark.parametrize("causal", [False, True])
def test_exact_when_the_window_covers_the_sequence(far_field, causal):
    q, k, v = random_qkv(scale=2.0)
    kwargs = _kwargs(far_field, causal, dict(local_window=2 * 45 + 1))
    out = hybrid_attention(q, k, v, _projection(), **kwargs)
    torch.testing.assert_close(out, exact_attention(q, k, v, causal=causal), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("far_field", ["softmax", "poly2"])
def test_padding_equals_the_unpadded_sequence(far_field):
    q, k, v = random_qkv(batch=1, length=30)
    W = _projection()
    pad = [torch.cat([t, torch.randn(1, 2, 9, 8, dtype=torch.float64) * 50], dim=2) for t in (q, k, v)]
    mask = torch.arange(39)[None, :] < 30
    config = dict(local_window=5, num_global_tokens=1, routed_blocks=2, route_block_size=4, query_block_size=4)
    for causal in (False, True):
        if causal:
            config = dict(local_window=5, num_global_tokens=1)
        plain = hybrid_attention(q, k, v, W, far_field=far_field, causal=causal, center=not causal, **config)
        padded = hybrid_attention(
            *pad, W, far_field=far_field, causal=causal, center=not causal, key_padding_mask=mask, **config
        )
        torch.testing.assert_close(padded[:, :, :30], plain, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
def test_causal_outputs_ignore_the_future(far_field):
    q, k, v = random_qkv(length=40, scale=3.0)  # large norms: a leaky shift would show
    W = _projection()
    kwargs = _kwargs(far_field, True, dict(local_window=6, num_global_tokens=2))
    out = hybrid_attention(q, k, v, W, chunk_size=8, **kwargs)
    for cut in (1, 9, 23):
        changed = [t.clone() for t in (q, k, v)]
        for t in changed:
            t[:, :, cut:] = torch.randn_like(t[:, :, cut:]) * 10
        again = hybrid_attention(*changed, W, chunk_size=8, **kwargs)
        torch.testing.assert_close(again[:, :, :cut], out[:, :, :cut], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("far_field", ["softmax", "poly2", "softmax_opt"])
@pytest.mark.parametrize("splits", [[1] * 20, [7, 1, 1, 11], [3, 17]])
@pytest.mark.parametrize("window", [4, 0, 1, 9])
def test_decoding_with_state_equals_one_causal_pass(far_field, splits, window):
    q, k, v = random_qkv(length=sum(splits), scale=2.0)
    W = _projection()
    kwargs = _kwargs(far_field, True, dict(local_window=window, num_global_tokens=2))
    full = hybrid_attention(q, k, v, W, chunk_size=4, **kwargs)
    state, outs, start = None, [], 0
    for n in splits:
        part = [t[:, :, start : start + n] for t in (q, k, v)]
        out, state = hybrid_attention(*part, W, chunk_size=4, initial_state=state, return_state=True, **kwargs)
        outs.append(out)
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-9, atol=1e-11)
    assert state.keys.shape[2] == max(window - 1, 0) and state.global_keys.shape[2] == 2 and state.length == start


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
@pytest.mark.parametrize("window,length", [(4, 20), (9, 6), (0, 11), (1, 11)])
def test_the_prefill_state_alone_is_the_stateful_calls(far_field, window, length):
    """hybrid_prefill_state (a compiled prefill's state) against the state hybrid_attention returns with its output,
    field by field, left-padded; and decoding from it gives the same next output."""
    from performer_hf.modeling.favor_hybrid import hybrid_prefill_state

    q, k, v = random_qkv(length=length + 1, scale=2.0)
    W = _projection()
    mask = torch.ones(q.shape[0], length, dtype=torch.bool)
    mask[-1, :3] = False
    kwargs = _kwargs(far_field, True, dict(local_window=window, num_global_tokens=2))
    spec = HybridSpec(
        **{name: value for name, value in kwargs.items() if name not in ("causal", "far_field_parameter")}
    )
    extra = {name: kwargs[name] for name in ("causal", "far_field_parameter") if name in kwargs}
    prefix = [t[:, :, :length] for t in (q, k, v)]
    _, want = hybrid_attention(*prefix, W, spec, key_padding_mask=mask, return_state=True, **extra)
    got = hybrid_prefill_state(*prefix, W, spec, key_padding_mask=mask, **extra)
    assert got.length == want.length == length
    for name, value in want._asdict().items():
        if torch.is_tensor(value):
            torch.testing.assert_close(getattr(got, name), value, rtol=1e-10, atol=1e-12, msg=name)
    step = [t[:, :, length:] for t in (q, k, v)]
    torch.testing.assert_close(
        hybrid_attention(*step, W, spec, initial_state=got, **extra),
        hybrid_attention(*step, W, spec, initial_state=want, **extra),
        rtol=1e-10,
        atol=1e-12,
    )


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
@pytest.mark.parametrize("window,first", [(4, 2), (4, 9), (0, 5), (1, 3)])
def test_the_prefill_state_after_a_state_is_the_stateful_calls(far_field, window, first):
    """hybrid_prefill_state after a state (the queries after an exact prefix, compiled): the state hybrid_attention
    returns after the same call, field by field (a first call shorter and longer than the window)."""
    from performer_hf.modeling.favor_hybrid import hybrid_prefill_state

    q, k, v = random_qkv(length=first + 12, scale=2.0)
    W = _projection()
    kwargs = _kwargs(far_field, True, dict(local_window=window, num_global_tokens=3))
    spec = HybridSpec(
        **{name: value for name, value in kwargs.items() if name not in ("causal", "far_field_parameter")}
    )
    extra = {name: kwargs[name] for name in ("causal", "far_field_parameter") if name in kwargs}
    _, before = hybrid_attention(*(t[:, :, :first] for t in (q, k, v)), W, spec, return_state=True, **extra)
    rest = [t[:, :, first:] for t in (q, k, v)]
    _, want = hybrid_attention(*rest, W, spec, initial_state=before, return_state=True, **extra)
    got = hybrid_prefill_state(*rest, W, spec, initial_state=before, **extra)
    assert got.length == want.length == first + 12
    for name, value in want._asdict().items():
        if torch.is_tensor(value):
            torch.testing.assert_close(getattr(got, name), value, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_reference(far_field, causal):
    # causal exponential far fields: the fused scan (favor_attention.causal_exp_sums), with per-head FAVOR++
    # directions and the keys' centering terms
    q, k, v = (t.requires_grad_() for t in random_qkv(length=21))
    W = _projection()
    config = dict(local_window=3, num_global_tokens=1)
    if not causal:
        config.update(routed_blocks=2, route_block_size=3, query_block_size=4)
    kwargs = _kwargs(far_field, causal, config)
    if causal and far_field == "softmax_opt":
        kwargs["far_field_parameter"] = torch.tensor([-0.05, -0.2])  # one A per head
    centres = {"query_center": torch.randn(2, 8) * 0.3, "key_center": torch.randn(2, 8) * 0.3} if causal else {}
    fast = hybrid_attention(q, k, v, W, chunk_size=4, **centres, **kwargs)
    ref = reference(q, k, v, W, **centres, **kwargs)
    probe = torch.randn_like(ref)
    g_fast = torch.autograd.grad((fast * probe).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * probe).sum(), (q, k, v))
    for a, b in zip(g_fast, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("far_field", sorted(QUADRATIC))
@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("padded", [False, True])
def test_the_polynomial_state_from_features_matches_the_reference(far_field, config, padded, monkeypatch):
    # On accelerators the bidirectional polynomial state is built from explicit features, not outer products
    # (far_field_polynomial.from_features): the outputs and gradients are the dense reference's all the same.
    monkeypatch.setattr(far_field_polynomial, "from_features", lambda device: True)
    q, k, v = (t.requires_grad_() for t in random_qkv())
    mask = right_padding(2, 45) if padded else None
    kwargs = dict(far_field=far_field, center=True, **config)
    out, ref = hybrid_attention(q, k, v, key_padding_mask=mask, **kwargs), reference(q, k, v, mask=mask, **kwargs)
    if mask is not None:  # padded queries' outputs are unspecified
        out, ref = out * mask[:, None, :, None], ref * mask[:, None, :, None]
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    probe = torch.randn_like(ref)
    grads = torch.autograd.grad((out * probe).sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad((ref * probe).sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("slab_elements", [1, 1 << 27])
def test_both_polynomial_states_give_the_same_sums_and_gradients(slab_elements, monkeypatch):
    # outer products (a CPU) against features (accelerators), in one slab per row and in one slab for everything
    monkeypatch.setitem(slabs_module.SLAB_ELEMENTS["cpu"], "far", slab_elements)
    g = torch.Generator().manual_seed(0)
    w, u = (torch.randn(2, 3, 50, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    wv1 = torch.randn(2, 3, 50, 5, generator=g, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(2, 3, 50, 5, generator=g, dtype=torch.float64)
    results = []
    for features in (False, True):
        monkeypatch.setattr(far_field_polynomial, "from_features", lambda device, f=features: f)
        sums = far_field_polynomial.quadratic_apply(u, far_field_polynomial.quadratic_state(w, wv1, 0.25))
        results.append((sums, *torch.autograd.grad((sums * probe).sum(), (w, wv1, u))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_pair_products_and_their_gradients():
    # forward: u_a u_b for a <= b in triu order; backward (a gather, not autograd's scatter) and its own backward
    u = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    first, second = torch.triu_indices(6, 6)
    assert torch.equal(far_field_polynomial.pair_products(u), u[..., first] * u[..., second])
    assert torch.autograd.gradcheck(far_field_polynomial.pair_products, (u,))
    assert torch.autograd.gradgradcheck(far_field_polynomial.pair_products, (u,))


def test_float32_large_norms_stay_finite_and_close():
    q, k, v = random_qkv(length=300, head_dim=16, scale=4.0)  # logits in the hundreds
    W = _projection(64, 16)
    config = dict(local_window=9, num_global_tokens=1, routed_blocks=4, route_block_size=8, query_block_size=16)
    for far_field in ("softmax", "poly2"):
        out = hybrid_attention(q.float(), k.float(), v.float(), W.float(), far_field=far_field, center=True, **config)
        ref = reference(q, k, v, W, far_field=far_field, center=True, **config)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
@pytest.mark.parametrize("head_dim,own_logit", [(8, -30.0), (64, -8.0)])
def test_a_row_whose_support_holds_all_its_keys_is_their_softmax(far_field, head_dim, own_logit):
    """Bidirectionally the far field outside a query's support is its sum over every key minus its sum on the
    support. Where the support holds every key, that is rounding: it was taken as the far field (poly2, a lone token
    at logit -30: kernel 196 against an exact weight of 1e-13, outputs 2 from its value in float32). Such rows are
    the softmax over their keys, and so are their gradients."""
    assert_rows_within_one_window_are_their_softmax(far_field, head_dim, own_logit)


@pytest.mark.parametrize("far_field", sorted(set(FAR_FIELDS) - set(QUADRATIC)))
@pytest.mark.parametrize("seed", [2, 4])
def test_bidirectional_random_features_hold_at_logits_near_100_in_float32(far_field, seed):
    """A bidirectional random-feature far field summed every key under one shift, the largest key's: at logits
    near 100 (FAVOR++ fits A = -17 there) a query's features could all fall on keys 1e-60 below it, 0 in float32,
    which left rows 0 (2.2 from the reference) and NaN gradients. Each feature keeps its own largest key now: the
    float32 outputs are the float64 reference's, the gradients the float64 method's."""
    q, k, v = (t * scale for t, scale in zip(random_qkv(seed=seed), (10.0, 10.0, 1.0), strict=True))
    W = _projection()
    kwargs = dict(far_field=far_field, local_window=5)
    expected = reference(q, k, v, W, **kwargs)
    inputs = [t.float().requires_grad_() for t in (q, k, v)]
    out = hybrid_attention(*inputs, W.float(), **kwargs)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-4 * v.abs().max().item())
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = torch.autograd.grad((out * probe.float()).sum(), inputs)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    expected_grads = torch.autograd.grad((hybrid_attention(*inputs, W, **kwargs) * probe).sum(), inputs)
    for ours, theirs in zip(grads, expected_grads, strict=True):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours.double(), theirs, rtol=0, atol=1e-3 * theirs.abs().max().item())


def test_hybrid_beats_plain_favor_on_peaked_local_attention():
    # Attention concentrated on neighbours (a "previous token" head): the window takes the peaks.
    L, d = 128, 16
    g = torch.Generator().manual_seed(3)
    k = torch.randn(1, 1, L, d, generator=g, dtype=torch.float64) * 2
    q = torch.roll(k, shifts=1, dims=2) + 0.1 * torch.randn(1, 1, L, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, L, d, generator=g, dtype=torch.float64)
    W = _projection(64, d)
    exact = exact_attention(q, k, v)
    plain = hybrid_attention(q, k, v, W)
    hybrid = hybrid_attention(q, k, v, W, local_window=5)
    err = lambda out: ((out - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err(plain) > 0.9  # FAVOR+ alone: no better than uniform attention here
    assert err(hybrid) < 0.3


@pytest.mark.parametrize("padded", [False, True])
def test_routing_every_key_block_without_a_window_is_softmax_attention(padded):
    """Without a window (``local_window=0``) every key block is a routing candidate, the query block's own too:
    routing them all leaves the far field nothing, which is exact softmax attention. (The own block was left out as
    if a window covered it: 5.0 from exact attention here.)"""
    q, k, v = random_qkv(length=48, scale=2.0)
    mask = right_padding(2, 48, real=(48, 31)) if padded else None
    out = hybrid_attention(
        q, k, v, far_field="poly2", routed_blocks=12, route_block_size=4, query_block_size=4, key_padding_mask=mask
    )
    want = exact_attention(q, k, v, key_padding_mask=mask)
    real = 1.0 if mask is None else mask[:, None, :, None]
    torch.testing.assert_close(out * real, want * real, rtol=1e-9, atol=1e-10)


def test_routing_groups_choose_as_every_block_while_there_are_few_groups():
    # 45 tokens: 12 key blocks of 4. Groups of 4: 3 groups for 3 routed blocks, every block a candidate.
    # Groups of 1: the bound is the block's own score, the same ranking.
    q, k, v = random_qkv()
    mask = right_padding(2, 45)
    config = dict(
        far_field="poly2", local_window=5, num_global_tokens=1, routed_blocks=3, route_block_size=4, query_block_size=8
    )
    plain = hybrid_attention(q, k, v, key_padding_mask=mask, **config)
    keep = mask[:, None, :, None]
    for group_size in (4, 1):
        grouped = hybrid_attention(q, k, v, key_padding_mask=mask, route_group_size=group_size, **config)
        torch.testing.assert_close(grouped * keep, plain * keep, rtol=0, atol=1e-12)
    grouped = hybrid_attention(q, k, v, key_padding_mask=mask, route_group_size=2, **config)  # 6 groups: fewer
    assert not torch.allclose(grouped * keep, plain * keep)


def test_routing_groups_score_their_blocks_alike_through_every_blocks_score_or_their_gathered_means(monkeypatch):
    """A query block's candidate blocks (its routing groups' blocks) scored through one product with every key block's
    mean, their columns picked, or through their gathered means (``hybrid_routing._scores_every_block`` takes the
    one with fewer elements): the same routes, the same outputs."""
    q, k, v = random_qkv()
    mask = right_padding(2, 45)
    config = dict(
        far_field="poly2", local_window=5, num_global_tokens=1, routed_blocks=3, route_block_size=4, query_block_size=8
    )
    outputs = {}
    for every in (True, False):
        monkeypatch.setattr(hybrid_routing, "_scores_every_block", lambda blocks, nb_groups, every=every: every)
        outputs[every] = hybrid_attention(q, k, v, key_padding_mask=mask, route_group_size=2, **config)  # 6 groups
    keep = mask[:, None, :, None]
    torch.testing.assert_close(outputs[True] * keep, outputs[False] * keep, rtol=0, atol=1e-12)
    plain = hybrid_attention(q, k, v, key_padding_mask=mask, **config)  # every block a candidate: other routes
    assert not torch.allclose(outputs[True] * keep, plain * keep)


def test_argument_errors():
    q, k, v = random_qkv(length=10)
    W = _projection()
    with pytest.raises(ValueError, match="bidirectional only"):
        hybrid_attention(q, k, v, W, causal=True, routed_blocks=2)
    with pytest.raises(ValueError, match="leaks the future"):
        hybrid_attention(q, k, v, W, causal=True, center=True)
    with pytest.raises(ValueError, match="far_field_parameter"):
        hybrid_attention(q, k, v, W, causal=True, far_field="softmax_opt")
    with pytest.raises(ValueError, match="needs a projection"):
        hybrid_attention(q, k, v, None, far_field="softmax")
    with pytest.raises(ValueError, match="Unknown far_field"):
        hybrid_attention(q, k, v, W, far_field="nope")
    with pytest.raises(ValueError, match="local_window"):
        hybrid_attention(q, k, v, W, local_window=-1)
    with pytest.raises(ValueError, match="only apply to causal"):
        hybrid_attention(q, k, v, W, return_state=True)
    hybrid_attention(q, k, v, None, far_field="poly2")  # polynomial kernels need no projection


@pytest.mark.parametrize("far_field", ["softmax", "poly2"])
@pytest.mark.parametrize("causal", [False, True])
def test_results_do_not_depend_on_the_slab_size(far_field, causal, monkeypatch):
    # Key statistics, the polynomial far-field state and the query blocks run slab by slab: one row or block
    # per slab must give the same outputs and gradients as one slab for everything.
    q, k, v = random_qkv()
    mask = right_padding(2, 45)
    config = CONFIGS[3] if not causal else CONFIGS[1]
    kwargs = _kwargs(far_field, causal, config)
    results = []
    for slab_elements in (1, 1 << 24):
        monkeypatch.setitem(slabs_module.SLAB_ELEMENTS["cpu"], "blocks", slab_elements)
        monkeypatch.setitem(slabs_module.SLAB_ELEMENTS["cpu"], "far", slab_elements)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = hybrid_attention(*inputs, _projection(), key_padding_mask=mask, center=not causal, chunk_size=8, **kwargs)
        out = out * mask[:, None, :, None]  # padded queries' outputs are unspecified
        results.append((out, *torch.autograd.grad((out * torch.cos(out)).sum(), inputs)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_spec_and_its_fields_as_keywords_give_the_same_attention():
    q, k, v = (torch.randn(2, 3, 30, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    fields = dict(
        far_field="poly2",
        local_window=5,
        num_global_tokens=1,
        routed_blocks=2,
        route_block_size=4,
        query_block_size=4,
        center=True,
    )
    spec = HybridSpec(**fields)
    expected = hybrid_attention(q, k, v, **fields)
    assert torch.equal(hybrid_attention(q, k, v, None, spec), expected)
    # keywords override the spec's fields
    assert torch.equal(
        hybrid_attention(q, k, v, None, HybridSpec(**{**fields, "local_window": 3}), local_window=5), expected
    )
    with pytest.raises(ValueError, match="local_window must be an integer >= 0"):
        HybridSpec(local_window=-1)
    with pytest.raises(ValueError, match="routed_blocks is bidirectional only"):
        hybrid_attention(q, k, v, None, spec, causal=True)


@pytest.mark.parametrize("far_field", ["softmax_opt", "poly2", "softmax", "taylor2"])
def test_the_lagged_causal_far_field_equals_decoding_from_its_state(far_field):
    # Without an earlier state, the causal far field scans the keys lagged past each query's window and leaves
    # out the global tokens; decoding after a state subtracts the support's kernel terms per candidate. A prefix
    # run lagged (returning its state) then continued from that state must equal one lagged run over everything,
    # outputs and gradients (float64), for windows, global tokens and left padding.
    g = torch.Generator().manual_seed(0)
    projection = draw_projection(32, 8, generator=g).double()
    mask = torch.ones(2, 29, dtype=torch.bool)
    mask[1, :5] = False  # left padding
    parameter = -0.3 if far_field == "softmax_opt" else None
    for local_window, num_global_tokens in ((0, 0), (1, 0), (4, 1), (7, 2), (40, 1)):
        spec = HybridSpec(
            far_field=far_field, local_window=local_window, num_global_tokens=num_global_tokens, chunk_size=4
        )
        q, k, v = (torch.randn(2, 3, 29, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
        kwargs = {"causal": True, "far_field_parameter": parameter}
        whole = hybrid_attention(q, k, v, projection, spec, key_padding_mask=mask, **kwargs)
        head, state = hybrid_attention(
            *(t[:, :, :11] for t in (q, k, v)),
            projection,
            spec,
            key_padding_mask=mask[:, :11],
            return_state=True,
            **kwargs,
        )
        tail = hybrid_attention(
            *(t[:, :, 11:] for t in (q, k, v)),
            projection,
            spec,
            key_padding_mask=mask[:, 11:],
            initial_state=state,
            **kwargs,
        )
        keep = mask[:, None, :, None]
        lagged, stepwise = whole * keep, torch.cat([head, tail], dim=2) * keep
        torch.testing.assert_close(lagged, stepwise, rtol=1e-11, atol=1e-12)
        for a, b in zip(
            torch.autograd.grad(lagged.sum(), (q, k, v)), torch.autograd.grad(stepwise.sum(), (q, k, v)), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


GAINS = torch.tensor([0.3, 1.7], dtype=torch.float64)  # one per head


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
@pytest.mark.parametrize("causal,config", [(True, CONFIGS[1]), (False, CONFIGS[3])], ids=["causal", "bidirectional"])
def test_far_field_gain_scales_the_kernel_against_the_support(far_field, causal, config):
    q, k, v = random_qkv()
    W = _projection()
    mask = right_padding(2, 45)
    kwargs = _kwargs(far_field, causal, config)
    centres = {"query_center": torch.randn(2, 8) * 0.3, "key_center": torch.randn(2, 8) * 0.3} if causal else {}
    out = hybrid_attention(q, k, v, W, key_padding_mask=mask, far_field_gain=GAINS, chunk_size=8, **centres, **kwargs)
    ref = reference(q, k, v, W, mask=mask, far_field_gain=GAINS, **centres, **kwargs)
    plain = reference(q, k, v, W, mask=mask, **centres, **kwargs)
    real = mask[:, None, :, None]
    torch.testing.assert_close(out * real, ref * real, rtol=1e-9, atol=1e-10)
    assert (ref - plain).abs().amax() > 1e-3  # the gain changes the output


@pytest.mark.parametrize("far_field", ["softmax", "poly2", "softmax_opt"])
def test_far_field_gain_decoding_equals_one_causal_pass(far_field):
    q, k, v = random_qkv(length=20, scale=2.0)
    W = _projection()
    kwargs = dict(_kwargs(far_field, True, dict(local_window=4, num_global_tokens=2)), far_field_gain=GAINS)
    full = hybrid_attention(q, k, v, W, chunk_size=4, **kwargs)
    state, outs = None, []
    for start, stop in ((0, 7), (7, 8), (8, 20)):
        part = [t[:, :, start:stop] for t in (q, k, v)]
        out, state = hybrid_attention(*part, W, chunk_size=4, initial_state=state, return_state=True, **kwargs)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("far_field", ["softmax_opt", "poly2"])
def test_far_field_gain_gradient_matches_reference(far_field):
    q, k, v = random_qkv(length=21)
    W = _projection()
    kwargs = _kwargs(far_field, True, dict(local_window=3, num_global_tokens=1))
    gain = GAINS.clone().requires_grad_()
    probe = torch.randn(2, 2, 21, 8, dtype=torch.float64)
    fast = hybrid_attention(q, k, v, W, chunk_size=4, far_field_gain=gain, **kwargs)
    (g_fast,) = torch.autograd.grad((fast * probe).sum(), gain)
    (g_ref,) = torch.autograd.grad((reference(q, k, v, W, far_field_gain=gain, **kwargs) * probe).sum(), gain)
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("gain", [0.0, -1.0, [1.0, 0.0]])
def test_far_field_gain_must_be_positive(gain):
    q, k, v = random_qkv(length=12)
    with pytest.raises(ValueError, match="far_field_gain must be positive"):
        hybrid_attention(q, k, v, far_field="poly2", local_window=3, far_field_gain=gain)


def test_a_far_field_is_its_features_and_one_registry_entry(monkeypatch):
    # A kernel registered with a feature function alone (no exponential form, no polynomial shortcut) runs through
    # the generic paths: bidirectional and causal attention against the dense reference (which takes any
    # registered kernel through its features), cached decoding against one pass, and a model built from a config.
    import math

    from performer_hf import PerformerConfig, PerformerForCausalLM
    from performer_hf.favor import FarField

    def relu_features(u, projection, _parameter):
        return torch.relu(u @ projection.T) / math.sqrt(projection.shape[0]) + 1e-3, None

    monkeypatch.setitem(FAR_FIELDS, "relu_far", FarField("relu_far", "ReLU random features", relu_features))
    q, k, v = random_qkv(length=30)
    W = _projection()
    mask = right_padding(2, 30, real=(30, 21))
    keep = mask[:, None, :, None]
    for causal, config in ((False, CONFIGS[3]), (True, CONFIGS[1])):
        kwargs = dict(far_field="relu_far", causal=causal, **config)
        out = hybrid_attention(q, k, v, W, key_padding_mask=mask, chunk_size=8, **kwargs)
        torch.testing.assert_close(out * keep, reference(q, k, v, W, mask=mask, **kwargs) * keep, rtol=1e-9, atol=1e-10)
    kwargs = dict(far_field="relu_far", causal=True, local_window=4, num_global_tokens=1, chunk_size=4)
    head, state = hybrid_attention(*(t[:, :, :17] for t in (q, k, v)), W, return_state=True, **kwargs)
    tail = hybrid_attention(*(t[:, :, 17:] for t in (q, k, v)), W, initial_state=state, **kwargs)
    torch.testing.assert_close(torch.cat([head, tail], dim=2), hybrid_attention(q, k, v, W, **kwargs))
    config = PerformerConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        is_decoder=True,
        attention_method="hybrid",
        attention_kernel="relu_far",
        local_window=3,
    )
    logits = PerformerForCausalLM(config).eval()(torch.arange(20)[None] % 50).logits
    assert logits.shape == (1, 20, 50) and torch.isfinite(logits).all()


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
def test_a_causal_query_that_sees_no_key_gets_zero_output_and_gradients(far_field):
    """Left padding: the queries before a row's first real key see nothing. With a loss on every output (theirs too),
    they get zero outputs, and the gradients are finite and those of the same row without its padded start (the
    division by an empty denominator once sent them 1 / tiny: NaN through the far field)."""
    q, k, v = (t.requires_grad_() for t in random_qkv(batch=2, heads=2, length=40, head_dim=8, seed=5))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :9] = False
    kwargs = _kwargs(far_field, True, dict(local_window=4))  # global tokens go by position: the cut row's would differ
    kwargs.update(
        query_center=torch.zeros(2, 8, dtype=torch.float64), key_center=torch.zeros(2, 8, dtype=torch.float64)
    )
    probe = torch.linspace(-1, 1, 40 * 8, dtype=torch.float64).view(40, 8)
    out = hybrid_attention(q, k, v, _projection(), key_padding_mask=mask, **kwargs)
    grads = torch.autograd.grad((out * probe).sum(), (q, k, v))
    assert (out[1, :, :9] == 0).all()
    assert all(bool(g.isfinite().all()) for g in grads)
    assert all(bool((g[1, :, :9] == 0).all()) for g in grads)
    cut = [t[1:, :, 9:].detach().requires_grad_() for t in (q, k, v)]
    alone = hybrid_attention(*cut, _projection(), **kwargs)
    alone_grads = torch.autograd.grad((alone * probe[9:]).sum(), cut)
    for grad, want in zip(grads, alone_grads, strict=True):
        torch.testing.assert_close(grad[1:, :, 9:], want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
def test_causal_far_field_across_many_chunks_matches_dense_reference(far_field):
    """Chunks of 2 over 45 positions: the chunk scan's start states come from more than one group of SCAN_GROUP
    chunks, and each query's far field, value and gradient are still the dense reference's."""
    from performer_hf.modeling.causal_scan import SCAN_GROUP

    q, k, v = (t.requires_grad_() for t in random_qkv())
    assert -(-q.shape[2] // 2) > SCAN_GROUP  # 23 chunks: two groups, the second partial
    W = _projection()
    kwargs = _kwargs(far_field, True, dict(local_window=3, num_global_tokens=1))
    centres = {"query_center": torch.randn(2, 8) * 0.3, "key_center": torch.randn(2, 8) * 0.3}
    fast = hybrid_attention(q, k, v, W, chunk_size=2, **centres, **kwargs)
    ref = reference(q, k, v, W, **centres, **kwargs)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-10)
    probe = torch.randn_like(ref)
    g_fast = torch.autograd.grad((fast * probe).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * probe).sum(), (q, k, v))
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-8, atol=1e-9)


# (junk, dtype): 1e30's square overflows float32
JUNK = [(float("nan"), torch.float64), (float("inf"), torch.float64), (1e30, torch.float32)]
# (far_field, causal, CPU kernels): the compiled kernels serve the bidirectional polynomial far fields
PADDED_CASES = [(far, False, "0") for far in sorted(FAR_FIELDS)] + [(far, True, "0") for far in sorted(FAR_FIELDS)]
PADDED_CASES += [(far, False, "1") for far in sorted(QUADRATIC)]


@pytest.mark.parametrize("far_field,causal,cpu_kernels", PADDED_CASES)
@pytest.mark.parametrize("junk,dtype", JUNK, ids=["nan", "inf", "1e30-float32"])
def test_padded_tokens_may_hold_anything(far_field, causal, cpu_kernels, junk, dtype, monkeypatch):
    """Padding was applied by multiplication: a NaN, inf or huge number at a padded position (0 * inf) made the real
    queries' outputs NaN, bidirectionally and in causal left-padded rows; and a padded query whose polynomial features
    overflow (1e20 in float32) made the real keys' gradients NaN (0 * inf in the backward pass). The padded tokens
    must not count at all, in the outputs or the gradients."""
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", cpu_kernels)
    q, k, v = random_qkv()
    W = _projection()
    mask = right_padding(2, 45, real=(45, 3))
    if causal:  # left padding: the row's real tokens last
        mask = mask.flip(-1)
        config = _kwargs(far_field, True, dict(local_window=5, num_global_tokens=1))
    else:
        config = dict(far_field=far_field, local_window=5, num_global_tokens=1, routed_blocks=1, center=True)
        config.update(route_block_size=4, query_block_size=4)
    real = mask[:, None, :, None]
    probe = torch.randn(q.shape, dtype=dtype).masked_fill(~real, 0.0)  # a loss on the real outputs only

    def outputs_and_gradients(fill):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        inputs = [torch.where(real, t, fill) for t in leaves]
        out = hybrid_attention(*inputs, W.to(dtype), key_padding_mask=mask, chunk_size=8, **config)
        grads = torch.autograd.grad((out * probe).sum(), leaves)
        return [torch.where(real, t, 0.0).double() for t in (out, *grads)]

    # (the naive reference's own gradients are NaN: a causal padded query before its row's first real token sees no
    # key, 0 / 0; so the gradients are compared with those of zero padding)
    out, *grads = outputs_and_gradients(junk)
    clean_out, *clean_grads = outputs_and_gradients(0.0)
    ref = reference(q, k, v, W, mask=mask, **config)
    tolerance = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, torch.where(real, ref, 0.0), **tolerance)
    torch.testing.assert_close(clean_out, torch.where(real, ref, 0.0), **tolerance)
    for got, clean in zip(grads, clean_grads, strict=True):
        torch.testing.assert_close(got, clean, **tolerance)


def test_a_state_of_other_settings_is_refused_by_name():
    """A state continued under another window or number of global tokens ran to wrong outputs (0.38 and 1.47 off);
    one of another batch or far field ended in torch's size errors."""
    q, k, v = random_qkv(length=24)
    W = _projection()
    settings = dict(far_field="softmax", causal=True, local_window=5, num_global_tokens=1)

    def state_of(length=16, batch=2, **changed):
        part = [t[:batch, :, :length] for t in (q, k, v)]
        return hybrid_attention(*part, W, return_state=True, **{**settings, **changed})[1]

    rest = [t[:, :, 16:] for t in (q, k, v)]
    for state, changed, what in (
        (
            state_of(local_window=3),
            {},
            r"window buffer \(local_window=5: min\(16 tokens, 4\)\) is 2, this call needs 4",
        ),
        (state_of(num_global_tokens=0), {"num_global_tokens": 2}, r"global keys \(num_global_tokens=2\) is 0"),
        (state_of(batch=1), {}, r"batch x heads is \(1, 2\), this call needs \(2, 2\)"),
        (state_of(), {"far_field": "poly2"}, r"far-field features \(far_field='poly2'\) is 24, this call needs 45"),
    ):
        with pytest.raises(ValueError, match=f"initial_state does not continue this hybrid_attention call: its {what}"):
            hybrid_attention(*rest, W, initial_state=state, **{**settings, **changed})
    # a short prefix holds as much of a longer window as it has tokens: it continues either window alike
    short = state_of(length=2, local_window=3)
    torch.testing.assert_close(
        hybrid_attention(*rest, W, initial_state=short, **settings),
        hybrid_attention(*rest, W, initial_state=state_of(length=2), **settings),
        rtol=0,
        atol=0,
    )
