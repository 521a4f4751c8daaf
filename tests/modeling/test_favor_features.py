"""Feature maps: the registry, the formulas, and the statistics the paper proves about them.

Kernel estimates use many independent projections at once: ``draws`` consecutive groups of
``m`` rows of one big draw (for orthogonal features ``m`` is a multiple of ``d``, so each
group is made of whole, independent orthogonal blocks). All seeds are fixed, and every
statistical assertion holds with a wide margin (checked over many seeds when written).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from performer_hf.favor import FEATURE_MAPS, KERNELS, draw_projection, feature_map, get_feature_map

D = 16


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _pair(norm_x, norm_y, angle, d=D):
    """Two float64 vectors with the given norms and angle (radians) between them."""
    e1, e2 = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    e1[0], e2[1] = 1.0, 1.0
    return norm_x * e1, norm_y * (math.cos(angle) * e1 + math.sin(angle) * e2)


def _estimates(x, y, kernel, m, draws, *, orthogonal, seed):
    """(draws, P) estimates phi(x_p) . phi(y_p) of the kernel, one independent projection per draw.

    x, y: (P, d). Every draw uses m rows; the feature maps normalise by the total number of rows,
    which is undone here.
    """
    W = draw_projection(m * draws, x.shape[-1], orthogonal=orthogonal, generator=_gen(seed), dtype=torch.float64)
    products = feature_map(x, W, kernel) * feature_map(y, W, kernel)  # (P, m' * draws)
    if products.shape[-1] == 2 * m * draws:  # [f1(w.x) ..., f2(w.x) ...]: fold the halves
        products = products.view(-1, 2, m * draws).sum(dim=1)
    return products.view(-1, draws, m).sum(dim=-1).T * draws  # (draws, P)


def _mse(x, y, kernel, m, draws, *, orthogonal, seed=0):
    """Mean squared error of the estimates of exp(x . y), averaged over the draws: (P,)."""
    exact = torch.exp((x * y).sum(dim=-1))  # (P,)
    return (_estimates(x, y, kernel, m, draws, orthogonal=orthogonal, seed=seed) - exact).pow(2).mean(dim=0)


def _random_pairs(n, norm, seed):
    g = _gen(seed)
    x, y = (torch.randn(n, D, generator=g, dtype=torch.float64) for _ in range(2))
    return norm * F.normalize(x, dim=-1), norm * F.normalize(y, dim=-1)


# ---- registry and formulas -------------------------------------------------------------------


def test_registry_holds_the_documented_kernels():
    assert set(KERNELS) == set(FEATURE_MAPS) >= {"softmax", "softmax_hyperbolic", "softmax_trig", "relu", "elu"}
    for name, fmap in FEATURE_MAPS.items():
        assert fmap.name == name and get_feature_map(name) is fmap
    assert not FEATURE_MAPS["softmax_trig"].nonnegative
    assert not FEATURE_MAPS["elu"].uses_projection
    with pytest.raises(ValueError, match="softmax_hyperbolic"):  # the message lists the valid names
        get_feature_map("gaussian")


def test_feature_formulas():
    g = _gen(0)
    x = torch.randn(2, 5, D, generator=g, dtype=torch.float64) * 0.7  # (..., L, d)
    W = draw_projection(24, D, generator=g, dtype=torch.float64)
    m = W.shape[0]
    wx = torch.einsum("bld,md->blm", x, W)
    half_sq = 0.5 * (x**2).sum(-1, keepdim=True)
    expected = {
        "softmax": torch.exp(wx - half_sq) / math.sqrt(m),
        "softmax_hyperbolic": torch.cat([torch.exp(wx), torch.exp(-wx)], -1) * torch.exp(-half_sq) / math.sqrt(2 * m),
        "softmax_trig": torch.cat([torch.sin(wx), torch.cos(wx)], -1) * torch.exp(half_sq) / math.sqrt(m),
        "relu": torch.clamp(wx, min=0) / math.sqrt(m) + 1e-3,
        "elu": torch.where(x > 0, x + 1, torch.exp(x)),
    }
    for kernel, want in expected.items():
        torch.testing.assert_close(feature_map(x, W, kernel), want, rtol=1e-12, atol=1e-12, msg=kernel)


@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyperbolic", "relu", "elu"])
def test_positive_maps_are_positive_even_for_extreme_inputs(kernel):
    x = torch.randn(3, 40, D, generator=_gen(1)) * 5
    W = draw_projection(32, D, generator=_gen(2))
    phi = feature_map(x, W, kernel)
    assert (phi >= 0).all() and torch.isfinite(phi).all()


@pytest.mark.parametrize("kernel", ["softmax", "softmax_hyperbolic", "softmax_trig"])
@pytest.mark.parametrize("orthogonal", [True, False])
def test_softmax_estimators_are_unbiased(kernel, orthogonal, single_thread):
    # The mean over many independent draws converges to exp(x . y), for every pair.
    x, y = _random_pairs(12, norm=0.8, seed=3)
    estimates = _estimates(x, y, kernel, m=D, draws=3000, orthogonal=orthogonal, seed=4)  # (draws, P)
    exact = torch.exp((x * y).sum(-1))
    standard_error = estimates.std(dim=0) / math.sqrt(estimates.shape[0])
    assert ((estimates.mean(dim=0) - exact).abs() < 4.5 * standard_error + 1e-12).all()


# ---- the paper's statistics ------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["softmax", "softmax_trig"])
@pytest.mark.parametrize("orthogonal", [True, False])
def test_mse_falls_as_the_number_of_features_grows(kernel, orthogonal, single_thread):
    # Averaged over pairs, the MSE of these Monte-Carlo estimators scales like 1 / m: each 4x
    # more features cut it about 4x (3.6 to 4.4 over many seeds).
    x, y = _random_pairs(32, norm=1.0, seed=5)
    mse = [_mse(x, y, kernel, m, draws=12_800 // m, orthogonal=orthogonal).mean().item() for m in (16, 64, 256)]
    for larger_m, smaller_m in zip(mse[1:], mse[:-1], strict=True):
        assert 3.0 < smaller_m / larger_m < 5.5


@pytest.mark.parametrize("m", [16, 64])
def test_orthogonal_features_beat_iid_features(m, single_thread):
    # Theorem 2 (m <= d): MSE(ort) <= MSE(iid) - 2 (m - 1) / (m (d + 2)) (SM(x, y) - exp(-(|x|^2 + |y|^2) / 2))^2.
    # For m = k d, the estimate averages k independent blocks: the gap is 2 (d - 1) / (m (d + 2)) (...)^2.
    x, y = _random_pairs(64, norm=1.0, seed=6)
    draws = 25_600 // m
    iid = _mse(x, y, "softmax", m, draws, orthogonal=False, seed=7)
    ort = _mse(x, y, "softmax", m, draws, orthogonal=True, seed=8)
    sm = torch.exp((x * y).sum(-1))
    gap = 2 * (min(m, D) - 1) / (m * (D + 2)) * (sm - torch.exp(-(x.pow(2) + y.pow(2)).sum(-1) / 2)) ** 2
    assert ort.mean() < 0.92 * iid.mean()  # about 0.8 over many seeds
    assert ort.mean() < (iid - 0.5 * gap).mean()  # at least half the gap the theorem promises
    assert (ort < iid).float().mean() > 0.6  # for most pairs, not only on average (about 0.8)


def _lemma2_mse(x, y, m):
    """Lemma 2's closed forms for i.i.d. features: (positive, trigonometric)."""
    sq_norms = (x.pow(2) + y.pow(2)).sum(-1)
    s2, z2 = (x + y).pow(2).sum(-1), (x - y).pow(2).sum(-1)
    positive = torch.exp(-sq_norms) * (torch.exp(2 * s2) - torch.exp(s2)) / m
    trig = torch.exp(sq_norms) * (1 - torch.exp(-z2)) ** 2 / (2 * m)
    return positive, trig


def test_positive_features_beat_trigonometric_ones_where_the_kernel_is_small(single_thread):
    m, draws = 16, 4000
    # Small kernel values: wide angles; SM(x, y) = exp(x . y) between 0.14 and 0.5.
    small = [_pair(1.0, 1.0, math.radians(a)) for a in (135, 150, 180)] + [_pair(1.4, 1.4, math.radians(170))]
    x, y = (torch.stack(t) for t in zip(*small, strict=True))
    assert (torch.exp((x * y).sum(-1)) < 0.6).all()
    positive = _mse(x, y, "softmax", m, draws, orthogonal=False, seed=9)
    trig = _mse(x, y, "softmax_trig", m, draws, orthogonal=False, seed=10)
    assert (10 * positive < trig).all()
    # ... by the margins Lemma 2 predicts
    want_positive, want_trig = _lemma2_mse(x, y, m)
    torch.testing.assert_close(trig, want_trig, rtol=0.1, atol=0)
    torch.testing.assert_close(positive, want_positive, rtol=0.25, atol=1e-12)  # 0 for y = -x

    # Where the kernel is large (x = y) it is the other way round: trig is exact there.
    x, y = _pair(1.0, 1.0, 0.0)
    x, y = x[None], y[None]
    assert _mse(x, y, "softmax_trig", m, draws, orthogonal=False).item() < 1e-20
    assert _mse(x, y, "softmax", m, draws, orthogonal=False).item() > 1.0


def test_hyperbolic_features_beat_positive_ones_with_the_same_projection(single_thread):
    # Lemma 2: MSE(hyp) = (1 - exp(-|x + y|^2)) / 2 * MSE(positive), and it is never worse.
    x, y = _random_pairs(32, norm=1.0, seed=11)
    positive = _mse(x, y, "softmax", 16, 2000, orthogonal=False, seed=12)
    hyperbolic = _mse(x, y, "softmax_hyperbolic", 16, 2000, orthogonal=False, seed=12)
    assert hyperbolic.mean() < 0.6 * positive.mean()
