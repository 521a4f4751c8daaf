"""Random projections for FAVOR+ features (Choromanski et al., 2021, section 2.4).

The rows of the projection are the random directions ``w_1 ... w_m`` of the feature maps.
Every coupling stacks ``ceil(m / d)`` independent blocks of ``d`` unit directions and then
rescales the rows so that their norms are distributed as for i.i.d. Gaussian vectors
(``chi(d)``, unbiased) or are all ``sqrt(d)`` (the regularised softmax kernel, SMREG):

- ``"orthogonal"``: each block is the orthogonal factor of a QR decomposition of a ``d x d``
  Gaussian matrix (orthogonal random features, pairwise angles 90 degrees);
- ``"simplex"``: each block is a randomly rotated regular simplex, the ``d`` directions having
  pairwise cosine ``-1 / (d - 1)`` (simplex random features, Reid et al., ICML 2023, arXiv
  2301.13856): the weight-independent coupling of minimal kernel-estimator MSE for positive
  random features. Each direction is still uniform on the sphere, so with ``chi`` norms every
  row is marginally ``N(0, I_d)`` and the softmax-kernel estimator stays unbiased;
- ``"iid"``: plain Gaussian rows (no coupling).
"""

from __future__ import annotations

import math

import torch

ROW_NORMS = ("chi", "sqrt_d")
COUPLINGS = ("orthogonal", "simplex", "iid")


def _haar_orthogonal_block(dim: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """A (dim, dim) matrix with orthonormal rows, drawn from the Haar measure."""
    gaussian = torch.randn(dim, dim, generator=generator, device=device, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)  # q: (dim, dim), orthonormal columns
    # Fix the signs so that q is Haar-distributed rather than biased by the QR convention.
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.T


def _simplex_block(dim: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """A (dim, dim) matrix whose unit rows are the vertices of a randomly rotated regular simplex.

    The rows of ``sqrt(d / (d - 1)) * (I - 1/d)`` are unit vectors with pairwise cosine
    ``-1 / (d - 1)`` (they span the hyperplane orthogonal to the all-ones vector); a Haar rotation
    makes their orientation uniformly random. For ``dim == 1`` the "simplex" is the single row ``+-1``.
    """
    if dim == 1:
        return _haar_orthogonal_block(dim, generator, device)
    vertices = torch.eye(dim, dtype=torch.float64, device=device) - 1.0 / dim
    vertices = vertices * math.sqrt(dim / (dim - 1))  # (dim, dim), unit rows
    return vertices @ _haar_orthogonal_block(dim, generator, device)  # rotate every vertex: v R^T


_BLOCK_DRAWS = {"orthogonal": _haar_orthogonal_block, "simplex": _simplex_block}


def draw_projection(
    nb_features: int,
    head_dim: int,
    *,
    orthogonal: bool = True,
    row_norms: str = "chi",
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    coupling: str | None = None,
) -> torch.Tensor:
    """Draw the random projection ``W`` of shape ``(nb_features, head_dim)``.

    Args:
        nb_features: number of random features ``m`` (any positive number, also ``m > head_dim``).
        head_dim: dimension ``d`` of queries and keys.
        orthogonal: stack orthogonal blocks (the paper's ORFs) instead of i.i.d. Gaussian rows.
            Shorthand for ``coupling="orthogonal"`` / ``"iid"``; ignored when ``coupling`` is given.
        row_norms: ``"chi"`` rescales each row to the norm of a fresh Gaussian vector (unbiased
            softmax-kernel estimator); ``"sqrt_d"`` gives every row norm ``sqrt(head_dim)`` (SMREG).
        generator: a ``torch.Generator`` that makes the draw reproducible; the draw happens on
            the generator's device (CPU when none is given) and is then moved to ``device``.
        device, dtype: where the result lives (default: CPU, ``torch.get_default_dtype()``).
        coupling: how the directions within a block are coupled: ``"orthogonal"``, ``"simplex"``
            (simplex random features) or ``"iid"``; overrides ``orthogonal``.
    """
    if not isinstance(nb_features, int) or nb_features <= 0:
        raise ValueError(f"nb_features must be a positive integer, got {nb_features!r}.")
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}.")
    if row_norms not in ROW_NORMS:
        raise ValueError(f"row_norms must be one of {ROW_NORMS}, got {row_norms!r}.")
    if coupling is None:
        coupling = "orthogonal" if orthogonal else "iid"
    if coupling not in COUPLINGS:
        raise ValueError(f"coupling must be one of {COUPLINGS}, got {coupling!r}.")

    draw_device = generator.device if generator is not None else torch.device("cpu")
    if coupling in _BLOCK_DRAWS:
        nb_blocks = math.ceil(nb_features / head_dim)
        draw_block = _BLOCK_DRAWS[coupling]
        blocks = [draw_block(head_dim, generator, draw_device) for _ in range(nb_blocks)]
        directions = torch.cat(blocks, dim=0)[:nb_features]  # (m, d), unit rows
        if row_norms == "chi":
            fresh = torch.randn(nb_features, head_dim, generator=generator, device=draw_device, dtype=torch.float64)
            norms = fresh.norm(dim=1, keepdim=True)  # (m, 1), chi(d)-distributed
        else:
            norms = torch.full((nb_features, 1), math.sqrt(head_dim), dtype=torch.float64, device=draw_device)
        projection = directions * norms
    else:
        projection = torch.randn(
            nb_features, head_dim, generator=generator, device=draw_device, dtype=torch.float64
        )  # rows already have chi(d) norms
        if row_norms == "sqrt_d":
            projection = projection / projection.norm(dim=1, keepdim=True) * math.sqrt(head_dim)
    return projection.to(device=device or "cpu", dtype=dtype or torch.get_default_dtype())
