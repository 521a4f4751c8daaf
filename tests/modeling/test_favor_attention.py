"""favor_attention against the O(L^2) references in performer_hf.favor_reference."""

import dataclasses

import pytest
import torch

import performer_hf.modeling.slabs as slabs_module
from performer_hf.favor import (
    KERNELS,
    draw_projection,
    exact_attention,
    explicit_feature_attention,
    favor_attention,
    hybrid_attention,
)
from performer_hf.modeling.favor_features import FEATURE_MAPS

POSITIVE_KERNELS = [k for k in KERNELS if k != "softmax_trig"]


def _qkv(batch=2, heads=3, length=37, head_dim=16, scale=0.5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, head_dim, generator=g, dtype=dtype) * scale for _ in range(3)]


def _projection(m=48, d=16, seed=1):
    return draw_projection(m, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("kernel", POSITIVE_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length,chunk", [(1, 4), (37, 8), (64, 16), (23, 128)])
def test_matches_explicit_feature_reference(kernel, causal, length, chunk):
    q, k, v = _qkv(length=length)
    W = _projection()
    fast = favor_attention(q, k, v, W, causal=causal, kernel=kernel, chunk_size=chunk)
    ref = explicit_feature_attention(q, k, v, W, causal=causal, kernel=kernel)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", POSITIVE_KERNELS)
def test_gradients_match_reference(kernel):
    q, k, v = (t.requires_grad_() for t in _qkv(length=21))
    W = _projection()
    for causal in (False, True):
        fast = favor_attention(q, k, v, W, causal=causal, kernel=kernel, chunk_size=8)
        ref = explicit_feature_attention(q, k, v, W, causal=causal, kernel=kernel)
        probe = torch.randn_like(ref)
        g_fast = torch.autograd.grad((fast * probe).sum(), (q, k, v))
        g_ref = torch.autograd.grad((ref * probe).sum(), (q, k, v))
        for a, b in zip(g_fast, g_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the 1e-6 query stabilizer


def test_causal_equals_bidirectional_on_every_prefix():
    q, k, v = _qkv(length=19)
    W = _projection()
    causal = favor_attention(q, k, v, W, causal=True, chunk_size=4)
    for i in range(19):
        prefix = favor_attention(q[:, :, : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], W)
        torch.testing.assert_close(causal[:, :, i], prefix[:, :, i], rtol=1e-9, atol=1e-9)


def test_no_information_from_the_future():
    q, k, v = _qkv(length=40, dtype=torch.float32)
    W = _projection().float()
    base = favor_attention(q, k, v, W, causal=True, chunk_size=16)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 25:] *= 40.0  # huge future keys would dominate any shared stabilizer shift
    v2[:, :, 25:] = 1e4
    changed = favor_attention(q, k2, v2, W, causal=True, chunk_size=16)
    assert torch.equal(changed[:, :, :25], base[:, :, :25])


def test_padding_gives_the_unpadded_outputs():
    q, k, v = _qkv(batch=1, length=29)
    W = _projection()
    for causal in (False, True):
        alone = favor_attention(q, k, v, W, causal=causal, chunk_size=8)
        pad = 11
        padded = [torch.cat([t, torch.randn(1, 3, pad, 16, dtype=t.dtype) * 9], dim=2) for t in (q, k, v)]
        mask = torch.ones(1, 29 + pad, dtype=torch.bool)
        mask[:, 29:] = False
        out = favor_attention(*padded, W, causal=causal, key_padding_mask=mask, chunk_size=8)
        torch.testing.assert_close(out[:, :, :29], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernel", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("junk", [float("nan"), float("inf"), 1e200], ids=["nan", "inf", "1e200"])
def test_padded_tokens_may_hold_anything(kernel, causal, junk):
    """Padded keys were left out by multiplying their features by zero: a NaN or inf there made every real output
    of relu, elu and softmax_trig NaN; and, causally, a padded query whose features overflow (0 * inf in the backward
    pass) made the real keys' gradients NaN. Real outputs and gradients equal those of zero padding. (Bidirectionally
    the mask marks keys only: q may be another sequence's, whose queries are used as given.)"""
    q, k, v = _qkv(length=20)
    W = _projection()
    mask = torch.arange(20)[None] < torch.tensor([20, 12])[:, None]  # (B, L): the second row padded from 12 on
    mask = mask.flip(-1) if causal else mask  # causal rows are left-padded
    real = mask[:, None, :, None]
    probe = torch.randn(2, 3, 20, 16, dtype=torch.float64).masked_fill(~real, 0.0)  # a loss on real outputs only

    def outputs_and_gradients(fill):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        inputs = [torch.where(real, t, fill) for t in leaves]
        inputs[0] = inputs[0] if causal else leaves[0]  # bidirectionally the queries are used as given
        out = favor_attention(*inputs, W, kernel=kernel, causal=causal, key_padding_mask=mask, chunk_size=8)
        grads = torch.autograd.grad((out * probe).sum(), leaves)
        return [torch.where(real, t, 0.0) for t in (out, *grads)]

    for got, clean in zip(outputs_and_gradients(junk), outputs_and_gradients(0.0), strict=True):
        torch.testing.assert_close(got, clean, rtol=1e-9, atol=1e-10)


def test_cross_attention_queries_are_used_as_given_whatever_the_key_mask():
    """Bidirectionally the key mask marks keys only: a real query at the index of a padded key (cross-attention of
    equal lengths) was scrubbed as if it were a padded token's (entries over 1e4 zeroed: 0.177 off with a small
    scaling). The output equals that of the same keys with one more padded key, and the naive reference."""
    q, k, v = _qkv(batch=1, length=6)
    q = q * 4e4  # real queries of large entries, which a small logit scale makes ordinary
    W = _projection()
    mask = torch.tensor([[True, True, True, True, False, False]])
    out = favor_attention(q, k, v, W, kernel="relu", key_padding_mask=mask, scaling=1e-5)
    longer = [torch.cat([t, t[:, :, :1]], dim=2) for t in (k, v)]
    out_longer = favor_attention(
        q, *longer, W, kernel="relu", key_padding_mask=torch.cat([mask, mask[:, :1] & False], 1), scaling=1e-5
    )
    torch.testing.assert_close(out, out_longer, rtol=1e-9, atol=1e-10)
    reference = explicit_feature_attention(q, k, v, W, kernel="relu", key_padding_mask=mask, scaling=1e-5)
    torch.testing.assert_close(out, reference, rtol=1e-7, atol=1e-9)


def test_incremental_decoding_with_state_matches_full_pass():
    q, k, v = _qkv(length=33)
    W = _projection()
    full = favor_attention(q, k, v, W, causal=True, chunk_size=8)
    out, state = favor_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], W, causal=True, return_state=True)
    steps = [out]
    for t in range(20, 33):
        sl = slice(t, t + 1)
        out, state = favor_attention(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], W, causal=True, initial_state=state, return_state=True
        )
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=2), full, rtol=1e-9, atol=1e-9)


def test_softmax_kernel_approaches_exact_attention_with_many_features():
    q, k, v = _qkv(length=64, scale=0.3)
    exact = exact_attention(q, k, v)
    errors = []
    for m in (16, 4096):
        W = draw_projection(m, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        approx = favor_attention(q, k, v, W)
        errors.append(((approx - exact).norm() / exact.norm()).item())
    assert errors[1] < 0.02 < errors[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_stay_finite(dtype):
    q, k, v = (t.to(dtype) * 20 for t in _qkv(length=300, dtype=torch.float32))
    W = _projection().to(dtype)
    for causal in (False, True):
        out = favor_attention(q, k, v, W, causal=causal)
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_bad_inputs_raise_clear_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="Unknown FAVOR kernel"):
        favor_attention(q, k, v, _projection(), kernel="nope")
    with pytest.raises(ValueError, match="projection must have shape"):
        favor_attention(q, k, v, _projection(d=8))
    with pytest.raises(ValueError, match="key_padding_mask"):
        favor_attention(q, k, v, _projection(), key_padding_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="causal"):
        favor_attention(q, k, v, _projection(), return_state=True)


# ---- a grid of shapes, outputs and gradients against the explicit-feature reference ------------

# (name, batch, heads, length, head_dim, value_dim, nb_features, chunk, padding)
GRID = [
    ("single token", 1, 1, 1, 8, 8, 8, 4, None),
    ("odd length, m > d, chunk does not divide L", 2, 3, 37, 16, 16, 48, 8, "right"),
    ("m not a multiple of d", 3, 2, 65, 8, 8, 20, 16, "right"),
    ("L below one chunk", 2, 2, 23, 16, 16, 64, 128, None),
    ("value dim != head dim, left padding", 2, 2, 50, 16, 24, 32, 7, "left"),
    ("chunk of one, scattered padding", 2, 2, 19, 8, 8, 16, 1, "random"),
]


def _padding_mask(kind, batch, length, seed=0):
    """(batch, length) bool mask, True = real token; every row keeps at least a few real tokens."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.bool)
    for b in range(batch):
        n_pad = int(torch.randint(1, max(2, length // 3), (1,), generator=g)) if length > 3 else 0
        if kind == "right":
            mask[b, length - n_pad :] = False
        elif kind == "left":
            mask[b, :n_pad] = False
        else:
            mask[b] = torch.rand(length, generator=g) > 0.3
            mask[b, -1] = True
    return mask


def _grid_inputs(batch, heads, length, head_dim, value_dim, nb_features, padding, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, length, head_dim, generator=g, dtype=torch.float64) * 0.5 for _ in range(2))
    v = torch.randn(batch, heads, length, value_dim, generator=g, dtype=torch.float64)
    mask = _padding_mask(padding, batch, length, seed)
    if mask is not None:  # padded positions hold garbage that must not matter
        garbage = ~mask[:, None, :, None]
        k = k.masked_fill(garbage, 7.0)
        v = v.masked_fill(garbage, -1e3)
    W = draw_projection(nb_features, head_dim, generator=g, dtype=torch.float64)
    return q, k, v, W, mask


def _visible_queries(mask, causal, batch, length):
    """(batch, length) bool: queries that see at least one real key (elsewhere the reference is 0/0)."""
    if mask is None:
        return torch.ones(batch, length, dtype=torch.bool)
    return mask.cumsum(dim=1) > 0 if causal else mask.any(dim=1, keepdim=True).expand(batch, length)


def _reference_grads(q, k, v, W, mask, probe, causal, kernel):
    """Gradients of sum(reference * probe) w.r.t. q, k, v, batch element by batch element.

    A causal query before the first real key sees nothing: the reference divides 0 by 0 there,
    and its NaN would leak into every gradient. Such positions (and the padded keys before them)
    only get zero gradients, so each element is cut to start at its first real token.
    """
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for b in range(q.shape[0]):
        start = 0 if mask is None or not causal else int(mask[b].long().argmax())
        parts = [t[b : b + 1, :, start:].detach().requires_grad_() for t in (q, k, v)]
        sub_mask = None if mask is None else mask[b : b + 1, start:]
        ref = explicit_feature_attention(*parts, W, causal=causal, kernel=kernel, key_padding_mask=sub_mask)
        part_grads = torch.autograd.grad((ref * probe[b : b + 1, :, start:]).sum(), parts)
        for grad, part in zip(grads, part_grads, strict=True):
            grad[b : b + 1, :, start:] = part
    return grads


@pytest.mark.parametrize("kernel", POSITIVE_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", GRID, ids=[c[0] for c in GRID])
def test_grid_outputs_and_gradients_match_the_reference(case, causal, kernel):
    _, batch, heads, length, head_dim, value_dim, m, chunk, padding = case
    q, k, v, W, mask = _grid_inputs(batch, heads, length, head_dim, value_dim, m, padding)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fast = favor_attention(q, k, v, W, causal=causal, kernel=kernel, key_padding_mask=mask, chunk_size=chunk)
    ref = explicit_feature_attention(q, k, v, W, causal=causal, kernel=kernel, key_padding_mask=mask)
    assert fast.shape == (batch, heads, length, value_dim)
    seen = _visible_queries(mask, causal, batch, length)[:, None, :, None].expand_as(fast)
    # tolerances: the 1e-6 query stabilizer (relative to each query's largest feature) is not in the reference
    torch.testing.assert_close(fast[seen], ref[seen], rtol=1e-4, atol=3e-5)
    assert (fast[~seen] == 0).all()  # a query with no visible key gets a zero output, not NaN

    probe = torch.randn(fast.shape, generator=torch.Generator().manual_seed(1), dtype=fast.dtype)
    g_fast = torch.autograd.grad((fast * probe).sum(), (q, k, v))
    g_ref = _reference_grads(q, k, v, W, mask, probe, causal, kernel)
    for name, a, b in zip("qkv", g_fast, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=3e-5, msg=f"d/d{name}")
    if mask is not None:  # padded keys and values receive exactly no gradient
        padded = ~mask[:, None, :, None]
        assert (g_fast[1].masked_select(padded) == 0).all() and (g_fast[2].masked_select(padded) == 0).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_cross_attention_and_custom_scaling_match_the_reference(kernel):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 13, 16, generator=g, dtype=torch.float64) * 0.5
    k, v = (torch.randn(2, 2, 29, 16, generator=g, dtype=torch.float64) * 0.5 for _ in range(2))
    W = _projection()
    for scaling in (None, 0.05):
        fast = favor_attention(q, k, v, W, kernel=kernel, scaling=scaling)
        ref = explicit_feature_attention(q, k, v, W, kernel=kernel, scaling=scaling)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_including_the_projection(kernel, causal):
    # Finite differences: an independent check of every hand-written backward, also for W.
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) * 0.5 for _ in range(3))
    W = draw_projection(6, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(1, 7, dtype=torch.bool)
    mask[0, 3] = False
    inputs = tuple(t.requires_grad_() for t in (q, k, v, W))

    def fn(q, k, v, W):
        return favor_attention(q, k, v, W, causal=causal, kernel=kernel, key_padding_mask=mask, chunk_size=3)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-3, fast_mode=True)


@pytest.mark.parametrize("kernel", POSITIVE_KERNELS)
def test_causal_output_does_not_depend_on_the_chunk_size(kernel):
    q, k, v = _qkv(length=45)
    W = _projection()
    outs = [favor_attention(q, k, v, W, causal=True, kernel=kernel, chunk_size=c) for c in (1, 5, 16, 45, 64)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-10, atol=1e-12)


def test_no_gradient_flows_from_the_future():
    q, k, v = (t.requires_grad_() for t in _qkv(length=40))
    out = favor_attention(q, k, v, _projection(), causal=True, chunk_size=16)
    t = 23
    g_q, g_k, g_v = torch.autograd.grad(out[:, :, :t].sum(), (q, k, v))
    assert (g_k[:, :, t:] == 0).all() and (g_v[:, :, t:] == 0).all() and (g_q[:, :, t:] == 0).all()
    assert (g_k[:, :, :t] != 0).any()


def test_state_carries_across_uneven_pieces_with_padding():
    q, k, v = _qkv(length=50)
    W = _projection()
    mask = torch.ones(2, 50, dtype=torch.bool)
    mask[0, 10:14] = False
    mask[1, :3] = False
    full = favor_attention(q, k, v, W, causal=True, key_padding_mask=mask, chunk_size=8)
    state, pieces = None, []
    for a, b in ((0, 7), (7, 8), (8, 31), (31, 50)):
        out, state = favor_attention(
            q[:, :, a:b],
            k[:, :, a:b],
            v[:, :, a:b],
            W,
            causal=True,
            key_padding_mask=mask[:, a:b],
            initial_state=state,
            return_state=True,
            chunk_size=8,
        )
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=2), full, rtol=1e-9, atol=1e-9)


def test_gradients_flow_through_the_recurrent_state():
    q, k, v = (t.requires_grad_() for t in _qkv(length=30))
    W = _projection()
    probe = torch.randn(2, 3, 30, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    full = favor_attention(q, k, v, W, causal=True, chunk_size=8)
    first, state = favor_attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], W, causal=True, return_state=True)
    second = favor_attention(q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], W, causal=True, initial_state=state)
    g_full = torch.autograd.grad((full * probe).sum(), (q, k, v))
    g_split = torch.autograd.grad((torch.cat([first, second], dim=2) * probe).sum(), (q, k, v))
    for a, b in zip(g_full, g_split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_large_norm_inputs_stay_finite_and_accurate_in_float32(causal):
    q, k, v = _qkv(length=200, dtype=torch.float64)
    q, k = q * 30, k * 30  # log-features in the thousands: a naive exp overflows
    W = _projection()
    ref = favor_attention(q, k, v, W, causal=causal)
    out = favor_attention(q.float(), k.float(), v.float(), W.float(), causal=causal)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_inputs_match_float32(dtype, causal):
    q, k, v = _qkv(length=300, dtype=torch.float32)
    W = _projection().float()
    ref = favor_attention(q, k, v, W, causal=causal)
    out = favor_attention(q.to(dtype), k.to(dtype), v.to(dtype), W.to(dtype), causal=causal)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_autocast_forward_and_backward_match_float32(kernel, causal):
    """Mixed-precision training calls the kernel under autocast: it must still compute in float32."""
    q, k, v = (t.float().requires_grad_() for t in _qkv(length=150))
    W = _projection().float()
    ref = favor_attention(q, k, v, W, causal=causal, kernel=kernel, chunk_size=32)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = favor_attention(q, k, v, W, causal=causal, kernel=kernel, chunk_size=32)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    torch.testing.assert_close(out, ref)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad)


def _saved_bytes(length, causal, kernel, heads, head_dim, m):
    """Bytes of the distinct storages autograd keeps for backward in one favor_attention call."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=g).requires_grad_() for _ in range(3))
    W = draw_projection(m, head_dim, generator=g)
    storages = {}

    def pack(t):
        storage = t.untyped_storage()  # views of one tensor share it: count it once
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        favor_attention(q, k, v, W, causal=causal, kernel=kernel, chunk_size=64)
    return sum(storages.values())


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_memory_saved_for_backward_is_linear_and_has_no_L_m_d_tensor(causal, kernel):
    L, heads, d, m = 1024, 2, 64, 64
    small = _saved_bytes(L, causal, kernel, heads, d, m)
    large = _saved_bytes(2 * L, causal, kernel, heads, d, m)
    assert large <= 2.1 * small  # linear in L
    per_feature_map = heads * L * m * 4  # one float32 (L, m) tensor per head
    assert small < 12 * per_feature_map  # a few feature-sized tensors ...
    assert small < (d + 1) * per_feature_map / 4  # ... far from the L x m x (d + 1) prefix sums of a naive cumsum


def test_bad_chunk_size_and_state_arguments():
    q, k, v = _qkv()
    W = _projection()
    with pytest.raises(ValueError, match="chunk_size"):
        favor_attention(q, k, v, W, causal=True, chunk_size=0)
    _, state = favor_attention(q, k, v, W, causal=True, return_state=True)
    with pytest.raises(ValueError, match="causal"):
        favor_attention(q, k, v, W, initial_state=state)
    with pytest.raises(ValueError, match="as many queries as keys"):
        favor_attention(q[:, :, :5], k, v, W, causal=True)


@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyperbolic"])
@pytest.mark.parametrize("causal", [False, True])
def test_results_do_not_depend_on_the_slab_size(kernel, causal, monkeypatch):
    # The exponential kernels run slab by slab (a few chunks at a time); one slab per position or
    # chunk, a few chunks, or the whole sequence must give the same outputs and gradients.
    q, k, v, W, mask = _grid_inputs(2, 3, 61, 16, 16, 24, "random")
    m = W.shape[0] * (2 if kernel == "softmax_hyperbolic" else 1)
    results = []
    for slab_elements in (1, 2 * 3 * m * 8 * 3, 2**21):  # 1 position / 1 chunk, 3 chunks, everything
        monkeypatch.setitem(slabs_module.SLAB_ELEMENTS["cpu"], "features", slab_elements)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, state = (
            favor_attention(
                *inputs, W, causal=True, kernel=kernel, key_padding_mask=mask, chunk_size=8, return_state=True
            )
            if causal
            else (favor_attention(*inputs, W, kernel=kernel, key_padding_mask=mask), None)
        )
        grads = torch.autograd.grad((out * torch.cos(out)).sum(), inputs)
        results.append((out, *grads, *(state or ())))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_causal_exp_sums_gradients_with_per_head_directions_bias_and_key_terms(monkeypatch):
    # The fused causal scan as hybrid attention calls it (FAVOR++: per-head directions and a per-feature bias;
    # the keys' centering terms; left-out keys; a length off the chunk grid; two slabs): every input's gradient,
    # bias and directions included, against finite differences. The sums are taken back to absolute scale
    # (times exp(query shift + key shift)), which is what the attention reads; the shifts are constants there.
    from performer_hf.modeling.favor_exp import ExpFeatures, ScanKeys, causal_exp_sums

    monkeypatch.setitem(slabs_module.SLAB_ELEMENTS["cpu"], "features", 1)  # one chunk per slab
    g = torch.Generator().manual_seed(0)
    B, H, L, d, m = 2, 2, 11, 3, 5

    def rand(*shape, scale=0.5):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    q, k, v1 = rand(B, H, L, d), rand(B, H, L, d), rand(B, H, L, 4)
    directions, bias, key_row = rand(H, m, d), rand(H, 1, m), rand(B, H, L, 1)
    mask = torch.rand(B, L, generator=g) > 0.2

    def absolute(q, k, v1, directions, bias, key_row):
        scan = causal_exp_sums(q, ScanKeys(k, v1, key_row, mask), ExpFeatures(directions, bias), chunk_size=4)
        return scan.sums * torch.exp(scan.q_shifts + scan.shifts).unsqueeze(-1)

    assert torch.autograd.gradcheck(absolute, (q, k, v1, directions, bias, key_row), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "FAVOR++ per head"])
@pytest.mark.parametrize("masked", [False, True], ids=["real", "left out"])
def test_one_position_after_a_state_equals_the_scan_over_everything(per_head, masked, monkeypatch):
    # A decoding step (one position after a state, no gradient) takes its own few operations, not the chunked
    # scan: its sums and the state after it equal, at absolute scale, the scan's over the whole sequence at its last
    # position (per-head directions and bias, the keys' centering terms, a left-out last key).
    from performer_hf.modeling import favor_exp
    from performer_hf.modeling.favor_exp import ExpFeatures, ScanKeys, causal_exp_sums

    g = torch.Generator().manual_seed(3)
    B, H, L, d, m = 2, 3, 10, 4, 6

    def rand(*shape, scale=0.7):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    q, k, v1, row = rand(B, H, L, d), rand(B, H, L, d), rand(B, H, L, 5), rand(B, H, L, 1)
    directions = rand(H, m, d) if per_head else rand(m, d)
    features = ExpFeatures(directions, rand(H, 1, m, scale=0.2) if per_head else None, 1e-3)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, -1] = not masked

    def keys(span):
        return ScanKeys(k[:, :, span], v1[:, :, span], row[:, :, span], mask[:, span])

    with torch.no_grad():
        whole = causal_exp_sums(q, keys(slice(None)), features, chunk_size=4)
        head = causal_exp_sums(q[:, :, :-1], keys(slice(None, -1)), features, chunk_size=4)
        monkeypatch.setattr(favor_exp._CausalExp, "apply", None)  # the step must not run the scan
        step = causal_exp_sums(q[:, :, -1:], keys(slice(-1, None)), features, 4, (head.kv, head.shift))

    def absolute(scan, position):
        sums = scan.sums[:, :, position] * torch.exp(scan.q_shifts + scan.shifts)[:, :, position, None]
        return sums, scan.kv * torch.exp(scan.shift)[..., None, None]

    for ours, reference in zip(absolute(step, 0), absolute(whole, -1), strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("scaling", [-0.5, 0.0, float("inf"), float("nan")])
def test_a_logit_scale_that_is_not_positive_and_finite_is_refused_by_name(scaling):
    """The kernels multiply queries and keys by the root of ``scaling``: a negative one failed deep in torch (complex
    numbers), a NaN ran to NaN outputs."""
    q = torch.randn(1, 2, 10, 8)
    W = draw_projection(16, 8)
    with pytest.raises(ValueError, match="favor_attention takes a positive, finite scaling"):
        favor_attention(q, q, q, W, scaling=scaling)
    with pytest.raises(ValueError, match="hybrid_attention takes a positive, finite scaling"):
        hybrid_attention(q, q, q, None, far_field="poly2", local_window=3, scaling=scaling)


def test_inputs_of_no_token_are_refused_by_name():
    """A zero-length call divided by zero (causal FAVOR+) or failed in amax (the hybrid)."""
    q = torch.randn(1, 2, 0, 8)
    with pytest.raises(ValueError, match="favor_attention got no query"):
        favor_attention(q, q, q, draw_projection(16, 8), causal=True)
    with pytest.raises(ValueError, match=r"hybrid_attention \(self-attention\) got no query"):
        hybrid_attention(q, q, q, None, far_field="poly2", local_window=3)


# The exponential maps' query stabilizer is added after each query's row-max shift m_i (exp(log phi - m_i) + 1e-6):
# the output depends on m_i. Their gradients held m_i constant; at the logits a real model reaches (q and k times 3
# here) the query Jacobian was off by 8e-4 (bidirectional) to 2e-3 (causal) of its size, 5.5e-2 at times 4.
EXP_KERNELS = ["softmax", "softmax_hyperbolic"]


def _large_logit_inputs(length=8, seed=0):
    """q, k, v (1, 2, length, 4) float64 with q and k times 3 (logits of a real model), a (8, 4) projection and a key
    mask with one padded key, all leaves."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, length, 4, generator=g, dtype=torch.float64) for _ in range(3))
    W = draw_projection(8, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(1, length, dtype=torch.bool)
    mask[0, 2] = False
    return (q * 3).requires_grad_(), (k * 3).requires_grad_(), v.requires_grad_(), W, mask


@pytest.mark.parametrize("kernel", EXP_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_are_the_derivative_of_the_output_through_the_query_stabilizer(kernel, causal):
    # Finite differences of favor_attention itself (the stabilizer included), over several causal chunks.
    q, k, v, W, mask = _large_logit_inputs()

    def fn(q, k, v):
        return favor_attention(q, k, v, W, causal=causal, kernel=kernel, key_padding_mask=mask, chunk_size=3)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


@pytest.mark.parametrize("kernel", EXP_KERNELS)
def test_gradients_through_the_initial_state_are_the_derivative_of_the_output(kernel):
    q, k, v, W, _ = _large_logit_inputs(length=9, seed=1)

    def fn(q, k, v):
        first, state = favor_attention(
            q[:, :, :4], k[:, :, :4], v[:, :, :4], W, causal=True, kernel=kernel, return_state=True, chunk_size=2
        )
        second = favor_attention(
            q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], W, causal=True, kernel=kernel, initial_state=state, chunk_size=2
        )
        return torch.cat([first, second], dim=2)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


@pytest.mark.parametrize("causal", [False, True])
def test_the_plain_autograd_path_differentiates_through_the_query_stabilizer(causal, monkeypatch):
    # The maps without an exponential form take _features; the softmax map sent there (its exp_directions removed)
    # has a stabilizer, whose row max must stay in the graph there too.
    monkeypatch.setitem(FEATURE_MAPS, "softmax", dataclasses.replace(FEATURE_MAPS["softmax"], exp_directions=None))
    q, k, v, W, mask = _large_logit_inputs()

    def fn(q, k, v):
        return favor_attention(q, k, v, W, causal=causal, key_padding_mask=mask, chunk_size=3)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


@pytest.mark.parametrize("kernel", EXP_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_detached_key_shifts_cancel_exactly(kernel, causal):
    # Keys whose norms rise along the sequence move the causal running shift at most positions (and set the
    # bidirectional one): the key shifts stay constants for autograd, and the keys' and values' gradients are still
    # the derivative of the output.
    q, k, v, W, mask = _large_logit_inputs(length=10, seed=1)
    rising = (k.detach() * torch.linspace(0.3, 1.5, 10, dtype=torch.float64)[:, None]).requires_grad_()

    def fn(k, v):
        return favor_attention(q, k, v, W, causal=causal, kernel=kernel, key_padding_mask=mask, chunk_size=3)

    assert torch.autograd.gradcheck(fn, (rising, v), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


def test_integer_inputs_are_refused_by_name():
    """Integer q, k, v ran and the output was cast back to their dtype: truncated (-1 for -1.43)."""
    q = (torch.randn(1, 2, 6, 8) * 3).round().long()
    with pytest.raises(ValueError, match="favor_attention takes floating-point q, k, v"):
        favor_attention(q, q, q, draw_projection(16, 8))
    with pytest.raises(ValueError, match=r"hybrid_attention \(self-attention\) takes floating-point q, k, v"):
        hybrid_attention(q, q, q, None, far_field="poly2", local_window=3)


@pytest.mark.parametrize("kernel", sorted(FEATURE_MAPS))
def test_every_maps_state_continues_its_own_calls(kernel):
    """The state check reads each map's feature width from the map: a state continues calls of its own settings."""
    q, k, v = _qkv(length=20)
    W = _projection()
    full = favor_attention(q, k, v, W, causal=True, kernel=kernel)
    first, state = favor_attention(*(t[:, :, :12] for t in (q, k, v)), W, causal=True, kernel=kernel, return_state=True)
    rest = favor_attention(*(t[:, :, 12:] for t in (q, k, v)), W, causal=True, kernel=kernel, initial_state=state)
    torch.testing.assert_close(torch.cat([first, rest], dim=2), full, rtol=1e-10, atol=1e-12)


def test_a_state_of_other_calls_is_refused_by_name():
    """A state of other heads or another projection ended in torch's size errors; one of other value widths too."""
    q, k, v = _qkv()
    W = _projection()

    def state_of(q, k, v, W):
        return favor_attention(q, k, v, W, causal=True, return_state=True)[1]

    for state, what in (
        (state_of(q[:, :1], k[:, :1], v[:, :1], W), r"batch x heads is \(2, 1\), this call needs \(2, 3\)"),
        (state_of(q[:1], k[:1], v[:1], W), r"batch x heads is \(1, 3\), this call needs \(2, 3\)"),
        (state_of(q, k, v, _projection(m=32)), r"features \(kernel='softmax' with 48 projection rows\) is 32"),
        (state_of(q, k, v[..., :3], W), "value width \\+ 1 is 4, this call needs 17"),
    ):
        with pytest.raises(ValueError, match=f"initial_state does not continue this favor_attention call: its {what}"):
            favor_attention(q, k, v, W, causal=True, initial_state=state)
    with pytest.raises(ValueError, match="features"):  # the hyperbolic map has twice the features of the positive one
        favor_attention(q, k, v, W, causal=True, kernel="softmax_hyperbolic", initial_state=state_of(q, k, v, W))
