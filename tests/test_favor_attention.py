"""favor_attention against the O(L^2) references in performer_hf.favor_reference."""

import pytest
import torch

from performer_hf.favor import (
    KERNELS,
    draw_projection,
    exact_attention,
    explicit_feature_attention,
    favor_attention,
)

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
