"""Simplex random features (Reid et al., ICML 2023): geometry, marginals, unbiasedness, lower MSE."""

import math

import pytest
import torch
from scipy import stats

from performer_hf.favor import draw_projection, feature_map


def _draw(m, d, seed=0, **kwargs):
    return draw_projection(
        m, d, coupling="simplex", generator=torch.Generator().manual_seed(seed), dtype=torch.float64, **kwargs
    )


@pytest.mark.parametrize("m,d", [(16, 16), (64, 16), (50, 16), (7, 16), (256, 32), (12, 5)])
def test_directions_within_a_block_form_a_regular_simplex(m, d):
    W = _draw(m, d)
    assert W.shape == (m, d)
    units = W / W.norm(dim=1, keepdim=True)
    for block in units.split(d, dim=0):
        cos = block @ block.T  # (rows, rows)
        expected = torch.full_like(cos, -1.0 / (d - 1))
        expected.fill_diagonal_(1.0)
        torch.testing.assert_close(cos, expected, atol=1e-12, rtol=0)


def test_a_full_block_sums_to_zero_and_blocks_are_independent():
    d = 16
    units = _draw(3 * d, d, row_norms="sqrt_d") / math.sqrt(d)
    first, second = units[:d], units[d : 2 * d]
    torch.testing.assert_close(first.sum(0), torch.zeros(d, dtype=torch.float64), atol=1e-12, rtol=0)
    cross = first @ second.T
    assert cross.abs().max() < 1 - 1e-3 and cross.abs().max() > 0.3


def test_rows_are_marginally_standard_gaussian():
    d = 8
    W = _draw(8000, d, seed=1)
    assert stats.kstest(W.norm(dim=1).numpy(), stats.chi(d).cdf).pvalue > 0.01
    # every direction is uniform on the sphere: a fixed coordinate of a unit row has mean 0, variance 1/d
    first = (W / W.norm(dim=1, keepdim=True))[:, 0]
    assert abs(first.mean().item()) < 0.02
    assert abs(first.pow(2).mean().item() - 1 / d) < 0.01
    assert stats.kstest(W.flatten().numpy(), "norm").pvalue > 0.01


def test_sqrt_d_row_norms():
    W = _draw(40, 16, row_norms="sqrt_d")
    torch.testing.assert_close(W.norm(dim=1), torch.full((40,), 4.0, dtype=torch.float64))


def test_unbiased_with_lower_mse_than_orthogonal_and_iid():
    # The softmax kernel exp(x . y) estimated by positive random features, m = d = 8, 3000 draws.
    d, draws = 8, 3000
    g = torch.Generator().manual_seed(0)
    x, y = (torch.nn.functional.normalize(torch.randn(1, d, generator=g, dtype=torch.float64), dim=-1) for _ in "xy")
    truth = math.exp((x @ y.T).item())
    mse = {}
    for coupling in ("iid", "orthogonal", "simplex"):
        estimates = []
        for seed in range(draws):
            W = draw_projection(
                d, d, coupling=coupling, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
            )
            estimates.append((feature_map(x, W) @ feature_map(y, W).T).item())
        estimates = torch.tensor(estimates)
        standard_error = estimates.std().item() / math.sqrt(draws)
        assert abs(estimates.mean().item() - truth) < 4 * standard_error  # unbiased
        mse[coupling] = (estimates - truth).pow(2).mean().item()
    assert mse["simplex"] < 0.95 * mse["orthogonal"] < 0.95**2 * mse["iid"]


def test_coupling_keyword_and_backward_compatibility():
    gen = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    default = draw_projection(40, 8, generator=gen())
    torch.testing.assert_close(draw_projection(40, 8, coupling="orthogonal", generator=gen()), default)
    torch.testing.assert_close(
        draw_projection(40, 8, orthogonal=False, generator=gen()),
        draw_projection(40, 8, coupling="iid", generator=gen()),
    )
    # coupling wins over the legacy flag
    torch.testing.assert_close(
        draw_projection(40, 8, orthogonal=False, coupling="simplex", generator=gen()),
        draw_projection(40, 8, coupling="simplex", generator=gen()),
    )
    torch.testing.assert_close(_draw(40, 8, seed=9), _draw(40, 8, seed=9))
    with pytest.raises(ValueError, match="coupling must be one of"):
        draw_projection(8, 8, coupling="hexagonal")
    assert draw_projection(3, 1, coupling="simplex").abs().gt(0).all()  # d = 1: a single +-1 direction
