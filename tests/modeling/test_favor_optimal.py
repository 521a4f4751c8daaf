"""FAVOR++ (optimal positive random features): unbiasedness, the closed-form parameter, lower variance."""

import math

import pytest
import torch

from performer_hf.favor import draw_projection, feature_map
from performer_hf.modeling.favor_optimal import optimal_log_features, optimal_parameter, pair_statistic


def _unit_pair(d, norm, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = (
        torch.nn.functional.normalize(torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64), dim=-1) * norm
        for _ in "xy"
    )
    return x, y


def _estimates(x, y, a, draws=1500, m=16):
    out = []
    for seed in range(draws):
        W = draw_projection(
            m, x.shape[-1], coupling="iid", generator=torch.Generator().manual_seed(seed), dtype=torch.float64
        )
        out.append((optimal_log_features(x, W, a).exp() @ optimal_log_features(y, W, a).exp().transpose(-2, -1)).item())
    return torch.tensor(out)


@pytest.mark.parametrize("a", [-0.3, -0.05, 0.0, 0.06])
def test_unbiased_for_any_parameter(a):
    x, y = _unit_pair(6, 1.0)
    est = _estimates(x, y, a)
    truth = math.exp((x * y).sum().item())
    assert abs(est.mean().item() - truth) < 4 * est.std().item() / math.sqrt(len(est))


def test_parameter_zero_is_favor_plus():
    x, _ = _unit_pair(8, 2.0)
    W = draw_projection(32, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(optimal_log_features(x, W, 0.0).exp(), feature_map(x, W, "softmax"))


def _log_second_moment(a, rho, d):
    # log E[f^2(w, x) f^2(w, y)] + |x|^2 + |y|^2 for mean |x + y|^2 = rho d (the quantity A* minimises)
    return d * math.log(1 - 4 * a) - d / 2 * math.log(1 - 8 * a) + 2 * (1 - 4 * a) / (1 - 8 * a) * rho * d


@pytest.mark.parametrize("rho", [0.0, 0.1, 1.0, 7.5])
def test_closed_form_minimises_the_log_second_moment(rho):
    d = 16
    best = optimal_parameter(rho).item()
    assert best <= 0
    grid = torch.linspace(-3.0, 0.124, 20001, dtype=torch.float64)
    values = torch.tensor([_log_second_moment(a.item(), rho, d) for a in grid], dtype=torch.float64)
    assert _log_second_moment(best, rho, d) <= values.min().item() + 1e-9
    assert abs(grid[values.argmin()].item() - best) < 1e-2 * (1 + abs(best))


def test_lower_error_than_favor_plus_at_large_norms():
    d = 8
    x, y = _unit_pair(d, 2.0, seed=2)
    truth = math.exp((x * y).sum().item())
    a = optimal_parameter(pair_statistic(x, y)).item()
    assert a < -0.1
    mse_opt = (_estimates(x, y, a, draws=800) - truth).pow(2).mean()
    mse_plus = (_estimates(x, y, 0.0, draws=800) - truth).pow(2).mean()
    assert mse_opt < 0.5 * mse_plus


def test_pair_statistic_matches_brute_force_with_padding():
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(2, 3, 9, 4, generator=g, dtype=torch.float64) for _ in "xy")
    mask = torch.arange(9)[None, :] < torch.tensor([[9], [5]])
    got = pair_statistic(x, y, mask)
    for b, n in enumerate((9, 5)):
        pairs = (x[b, :, :n, None, :] + y[b, :, None, :n, :]).pow(2).sum(-1)  # (H, n, n)
        torch.testing.assert_close(got[b], pairs.mean((-2, -1)) / 4)


def test_parameter_must_be_below_one_eighth():
    x, _ = _unit_pair(4, 1.0)
    with pytest.raises(ValueError, match="below 1/8"):
        optimal_log_features(x, torch.randn(4, 4, dtype=torch.float64), 0.2)
    with pytest.raises(ValueError, match="cannot be negative"):
        optimal_parameter(-1.0)
