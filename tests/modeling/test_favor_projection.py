"""draw_projection: orthogonal blocks, row norms, i.i.d. rows, reproducibility, argument checks."""

import math

import pytest
import torch
from scipy import stats

from performer_hf.favor import draw_projection


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _blocks(W, d):
    """Split the rows of W into its d-row blocks (the last one may be partial)."""
    return list(W.split(d, dim=0))


@pytest.mark.parametrize("m,d", [(16, 16), (64, 16), (50, 16), (7, 16), (256, 64), (37, 5)])
def test_shape_and_rows_within_each_block_are_orthogonal(m, d):
    W = draw_projection(m, d, generator=_gen(), dtype=torch.float64)
    assert W.shape == (m, d)
    blocks = _blocks(W, d)
    assert len(blocks) == math.ceil(m / d)
    for block in blocks:
        gram = block @ block.T  # (rows, rows): diagonal = squared norms, off-diagonal = 0
        torch.testing.assert_close(gram, torch.diag(torch.diagonal(gram)), atol=1e-10, rtol=0)


def test_blocks_are_independent_draws():
    d = 16
    W = draw_projection(4 * d, d, generator=_gen(), dtype=torch.float64)
    units = W / W.norm(dim=1, keepdim=True)
    first, second = units[:d], units[d : 2 * d]
    cross = first @ second.T  # rows of different blocks: random cosines, not 0 and not +-1
    assert cross.abs().max() > 0.3
    assert cross.abs().max() < 1 - 1e-3
    # i.e. the rows of the whole matrix span R^d several times over, unlike a single repeated block
    assert not torch.allclose(first, second)


def test_iid_rows_are_not_orthogonal_and_look_gaussian():
    d = 16
    W = draw_projection(4096, d, orthogonal=False, generator=_gen(), dtype=torch.float64)
    gram = W[:d] @ W[:d].T
    off_diagonal = gram - torch.diag(torch.diagonal(gram))
    assert off_diagonal.abs().max() > 1.0  # i.i.d. Gaussian rows of norm ~4 have cosines ~0.25
    entries = W.flatten().numpy()
    assert stats.kstest(entries, "norm").pvalue > 0.01
    assert abs(entries.mean()) < 0.02 and abs(entries.std() - 1) < 0.02


@pytest.mark.parametrize("orthogonal", [True, False])
def test_chi_row_norms_follow_the_chi_distribution(orthogonal):
    d = 16
    W = draw_projection(2000, d, orthogonal=orthogonal, generator=_gen(3), dtype=torch.float64)
    norms = W.norm(dim=1).numpy()
    # the norms of d-dimensional standard Gaussian vectors: chi(d), mean ~ sqrt(d - 1/2)
    assert stats.kstest(norms, stats.chi(d).cdf).pvalue > 0.01
    assert norms.std() > 0.5  # not a constant sqrt(d)


@pytest.mark.parametrize("orthogonal", [True, False])
@pytest.mark.parametrize("m,d", [(48, 16), (10, 64)])
def test_sqrt_d_row_norms_are_exactly_sqrt_d(orthogonal, m, d):
    W = draw_projection(m, d, orthogonal=orthogonal, row_norms="sqrt_d", generator=_gen(), dtype=torch.float64)
    torch.testing.assert_close(W.norm(dim=1), torch.full((m,), math.sqrt(d), dtype=torch.float64))


def test_orthogonal_directions_are_haar_distributed():
    # With the QR sign convention left uncorrected, the (i, i) entries of every block have a
    # fixed sign; for Haar-random orthogonal blocks they average to zero (each has variance 1/d).
    d, nb_blocks = 16, 200
    W = draw_projection(d * nb_blocks, d, row_norms="sqrt_d", generator=_gen(5), dtype=torch.float64)
    units = W.view(nb_blocks, d, d) / math.sqrt(d)  # (blocks, rows, d)
    diagonal = torch.diagonal(units, dim1=1, dim2=2)  # (blocks, d)
    assert diagonal.mean().abs() < 0.02  # standard error 0.25 / 57 ~ 0.004
    torch.testing.assert_close(units.pow(2).mean(), torch.tensor(1 / d, dtype=torch.float64))


@pytest.mark.parametrize("orthogonal", [True, False])
def test_reproducible_from_a_generator_and_leaves_the_global_rng_alone(orthogonal):
    before = torch.random.get_rng_state()
    a = draw_projection(40, 16, orthogonal=orthogonal, generator=_gen(7))
    b = draw_projection(40, 16, orthogonal=orthogonal, generator=_gen(7))
    c = draw_projection(40, 16, orthogonal=orthogonal, generator=_gen(8))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_without_a_generator_draws_follow_the_global_seed():
    torch.manual_seed(11)
    a = draw_projection(20, 8)
    torch.manual_seed(11)
    b = draw_projection(20, 8)
    assert torch.equal(a, b)
    assert not torch.equal(a, draw_projection(20, 8))


def test_dtype_and_device():
    assert draw_projection(8, 4).dtype == torch.get_default_dtype()
    W = draw_projection(8, 4, dtype=torch.float64, device="cpu", generator=_gen())
    assert W.dtype == torch.float64 and W.device.type == "cpu"
    # the same draw in another dtype: identical up to rounding
    torch.testing.assert_close(draw_projection(8, 4, dtype=torch.bfloat16, generator=_gen()), W.to(torch.bfloat16))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"nb_features": 0, "head_dim": 4}, "nb_features"),
        ({"nb_features": 2.0, "head_dim": 4}, "nb_features"),
        ({"nb_features": 4, "head_dim": -1}, "head_dim"),
        ({"nb_features": 4, "head_dim": 4, "row_norms": "unit"}, "row_norms"),
    ],
)
def test_bad_arguments_raise_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        draw_projection(**kwargs)
