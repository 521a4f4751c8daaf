"""The far field of hybrid attention: the kernel's sums over the keys outside each query's exact support.

Bidirectionally (:class:`BidirectionalFar`) the state holds every key, one shift per batch and head, and each
query's sums leave out its support by subtracting the kernel's values there (:meth:`FarQueries.complement`, from
the exact logits for the polynomial kernels, from feature products otherwise). Causally a chunked scan reads only
the keys lagged past each query's window (:func:`.lagged_far_field`), so nothing needs subtracting. Either way the
queries see a :class:`FarQueries`, whose complement is a :class:`.PartialSums` for :func:`.merge`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .causal_scan import EMPTY_SHIFT, causal_scan
from .hybrid_exact import CandidateSet, PartialSums
from .hybrid_keys import Keys

Tensor = torch.Tensor

# The far field outside a query's support is its sum over every key minus its sum on the support. A remainder
# within rounding of the first is taken as no mass at all: a row whose support holds all its keys (poly2 at logit
# -30: kernel 196 on an exact weight of 1e-13) otherwise took the rounding residue as its far field (6.5e8 from the
# value in float32). Rounding a sum of n terms leaves about sqrt(n) eps times the sum of their magnitudes; the far
# sum adds keys x features terms in two stages (FarQueries.rounding: sqrt(keys + features) times a bound on that
# sum). Residues measured on single-key rows (head_dim 16-128, centred or not) stayed within 1.4 eps times
# it; a larger multiple also dropped remainders that float32 resolves (poly2 at logits near 100, one query 0.02 from
# the float64 reference with 2 eps, 0.46 with 4 eps).
COMPLEMENT_ULPS = 2


def complement_floor(rounding: Tensor) -> Tensor:
    """The far field's mass at or below which its remainder outside the support is rounding: ``rounding`` (...),
    the far sum's rounding scale (:attr:`FarQueries.rounding`), times ``COMPLEMENT_ULPS * eps``."""
    return rounding.detach() * (COMPLEMENT_ULPS * torch.finfo(rounding.dtype).eps)


def outside_support(far_sum: Tensor, on_support: Tensor, rounding: Tensor, shift: Tensor) -> PartialSums:
    """The far field's sums (..., dv + 1) over the keys outside the support relative to ``exp(shift)`` (..., 1),
    from those over every key and those on the support: none (with the lowest shift, which a merge passes over)
    where the remaining mass is within rounding (:func:`complement_floor`)."""
    rest = far_sum - on_support
    outside = rest[..., -1:] > complement_floor(rounding)  # (..., 1)
    lowest = torch.finfo(shift.dtype).min
    return PartialSums(torch.where(outside, rest, torch.zeros_like(rest)), shift.masked_fill(~outside, lowest))


class FarQueries(NamedTuple):
    """The far field as the queries see it, each (B, H, L, X) or split into query blocks alike."""

    qf: Tensor | None  # query features (random-feature kernels whose state holds the support), or None
    rq: Tensor  # the queries' centering log-weights
    scale: Tensor  # log of each query's far-field factor: its feature scale or centering weight, plus the gain
    key_shift: Tensor  # the keys' shift
    far_sum: Tensor  # kernel sums relative to exp(scale + key_shift)
    # far_sum's mass's rounding scale (its rounding error is a small multiple of eps times it): sqrt(terms added)
    # times a bound on their magnitudes, relative to the same shift; None where far_sum leaves out the support
    rounding: Tensor | None
    excludes_support: bool  # whether far_sum leaves out the support already

    def split(self, split_fn) -> list[FarQueries]:
        """The same for each slab of query blocks: ``split_fn`` maps a (B, H, L, X) tensor to its slabs."""
        parts = [None if t is None else split_fn(t) for t in self[:-1]]
        count = len(parts[4])  # far_sum's slabs
        parts = [[None] * count if p is None else p for p in parts]
        return [FarQueries(*slab, self.excludes_support) for slab in zip(*parts, strict=True)]

    def complement(self, logits: list[Tensor], sets: list[CandidateSet], quadratic: float | None) -> PartialSums:
        """The far field over the keys outside each query's support: its sums minus the kernel's values on the
        support (none to subtract when ``excludes_support``). ``logits``: the exact logits of ``sets``."""
        shift = self.scale + self.key_shift  # (.., bq, 1)
        if self.excludes_support or not sets:
            return PartialSums(self.far_sum, shift)
        on_support = 0
        for lg, candidates in zip(logits, sets, strict=True):
            on_support = on_support + self._kernel(lg, candidates, quadratic) @ candidates.keys[1]
        return outside_support(self.far_sum, on_support, self.rounding, shift)

    def _kernel(self, logits: Tensor, candidates: CandidateSet, quadratic: float | None) -> Tensor:
        """The kernel between each query and its support's keys, relative to ``exp(scale + key_shift)`` (0 off the
        support): (.., bq, C)."""
        support = candidates.support
        klog = candidates.keys[2].transpose(-2, -1).clamp_min(torch.finfo(logits.dtype).min)  # (.., 1, C); finite
        if quadratic is not None:
            t = (logits - self.rq - klog).masked_fill(~support, 0.0)  # (x_i - a) . (y_j - c), from the exact logits
            pair = torch.addcmul(1 + t, t, t, value=quadratic)
        else:
            pair = self.qf @ candidates.keys[3].transpose(-2, -1)
        return (pair * torch.exp(klog - self.key_shift[..., :1, :])).masked_fill(~support, 0.0)  # a per-key factor


class BidirectionalFar:
    """The far-field state over all keys (one key shift per batch and head) and its sums for every query.

    Polynomial kernels build the state through ``polynomial`` (a pair ``(state(w, wv1, c2), apply(u, state))``: the
    PyTorch functions of :mod:`.far_field_polynomial`, whose form depends on the device, or the compiled CPU ones);
    random-feature kernels through their features.
    """

    def __init__(self, call, polynomial):
        far, keys = call.ctx.far, call.keys
        shift = keys.klog.amax(dim=(-2, -1), keepdim=True).detach()  # (B, H, 1, 1)
        self.shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        weighted = keys.values1 * torch.exp(keys.klog - self.shift)  # (B, H, S, dv + 1); padded keys -> 0
        self.u, self.rq, self.log_gain, self.polynomial = call.x - call.ctx.a, call.rq, call.log_gain, polynomial
        self.quadratic = far.quadratic
        if far.quadratic is not None:
            w = keys.y - call.ctx.c  # (B, H, S, d)
            self.state = polynomial[0](w, weighted, far.quadratic)
            # the key weights' moments in |w| (B, H, 3, 1): the features' products add up to 1 + t + c2 t^2 from
            # terms whose magnitudes sum to at most 1 + |u| |w| + c2 |u|^2 |w|^2 (Cauchy-Schwarz; the exact sum,
            # with |u| . |w|, costs two (L x d x d) products per head: 10% of the default's forward at 8K tokens)
            norms = w.detach().norm(dim=-1, keepdim=True)  # (B, H, S, 1)
            mass = weighted[..., -1:].detach()
            self.moments = torch.cat([mass, norms * mass, norms.square() * mass], dim=-1).sum(dim=2)[..., None]
            self.qf = None
            features = 1 + w.shape[-1] * (w.shape[-1] + 3) // 2  # [1, u, (u_a u_b)_{a <= b}]
        else:
            self.state = keys.feats.transpose(-2, -1) @ weighted  # (B, H, D, dv + 1)
            self.qf, self.q_scale = call.ctx.features(self.u, self.rq)  # (B, H, L, D), (B, H, L, 1)
            features = self.qf.shape[-1]
        self.terms = (keys.y.shape[2] + features) ** 0.5  # sqrt(n) of the far sums' two stages of sums

    def queries(self) -> FarQueries:
        """The far field as every query sees it (whole sequence)."""
        key_shift = self.shift.expand(*self.rq.shape[:3], 1)
        if self.qf is None:
            far_sum = self.polynomial[1](self.u, self.state)
            size = self.u.detach().norm(dim=-1, keepdim=True)  # (B, H, L, 1)
            powers = torch.cat([torch.ones_like(size), size, self.quadratic * size.square()], dim=-1)
            rounding = (powers @ self.moments) * self.terms  # (B, H, L, 1)
            scale = self.rq + self.log_gain
            return FarQueries(None, self.rq, scale, key_shift, far_sum, rounding, excludes_support=False)
        scale = self.q_scale + self.log_gain
        far_sum = self.qf @ self.state  # positive terms: its mass is their magnitude
        rounding = far_sum[..., -1:] * self.terms
        return FarQueries(self.qf, self.rq, scale, key_shift, far_sum, rounding, excludes_support=False)


def causal_far_sums(qf, kf, klog, v1, chunk_size: int, state: tuple[Tensor, Tensor] | None):
    """Causal far-field sums (:func:`.causal_scan`): query i reads every key j <= i, scaled to the running
    shift s_i.

    qf: (B, H, L, D); kf: (B, H, L, D); klog: (B, H, L, 1); v1: (B, H, L, dv + 1); state: (kv, shift) before
    position 0 or None -> (F (B, H, L, dv + 1), shifts s (B, H, L), final state kv (B, H, D, dv + 1), final
    shift (B, H)).
    """
    B, H = qf.shape[:2]
    far_kv, far_shift = (None, None) if state is None else state
    prev = qf.new_full((B, H), EMPTY_SHIFT) if far_shift is None else far_shift.to(qf.dtype)
    row = klog.squeeze(-1).detach().nan_to_num(neginf=EMPTY_SHIFT)  # (B, H, L)
    shifts = torch.cummax(torch.maximum(row, prev.unsqueeze(-1)), dim=-1).values  # (B, H, L): s_j
    kfs = kf * torch.exp(klog - shifts.unsqueeze(-1))  # (B, H, L, D), relative to s_j
    out, kv, shift = causal_scan(qf, kfs, v1, shifts, chunk_size, far_kv, prev)
    return out, shifts, kv, shift


def add_keys(kv: Tensor, shift: Tensor, keys: Keys) -> tuple[Tensor, Tensor]:
    """A causal far-field state (kv (B, H, D, dv + 1) relative to shift (B, H)) with ``keys`` (features) added."""
    if not keys.y.shape[2]:
        return kv, shift
    row = keys.klog.squeeze(-1).detach().nan_to_num(neginf=EMPTY_SHIFT)  # (B, H, S)
    added_shift = row.amax(dim=-1).clamp_min(EMPTY_SHIFT)  # (B, H)
    added = (keys.feats * torch.exp(keys.klog - added_shift[..., None, None])).transpose(-2, -1) @ keys.values1
    return add_states((kv, shift), (added, added_shift))


def add_states(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The sum of two causal far-field states over different keys, each (kv (B, H, D, dv + 1) relative to its shift
    (B, H)), relative to the larger shift."""
    (kv, shift), (other, other_shift) = first, second
    merged = torch.maximum(shift, other_shift)  # (B, H)
    scale, other_scale = (torch.exp(s - merged)[..., None, None] for s in (shift, other_shift))
    return kv * scale + other * other_scale, merged
