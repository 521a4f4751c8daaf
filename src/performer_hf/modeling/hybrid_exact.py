"""The exact part of hybrid attention and the merge of the parts under one normaliser.

Each part returns un-normalised sums ``[numerator, denominator]`` relative to a shift of its own
(:class:`PartialSums`): the exact part softmax's sums over each query's support, relative to its largest logit;
the far field the kernel's sums over the rest (:mod:`.hybrid_far_field`). :func:`merge` brings them to one
shift, so that one division normalises the whole distribution (as MoBA merges attention parts through their
log-sum-exp). Shifts are constants for autograd: they cancel in the division.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .hybrid_keys import NEG_INF, Keys

Tensor = torch.Tensor


class PartialSums(NamedTuple):
    """Un-normalised attention sums of one part: ``sums * exp(shift)`` is ``sum_j w_ij [v_j, 1]`` over its keys."""

    sums: Tensor  # (..., dv + 1): numerator | denominator
    shift: Tensor  # (..., 1), detached


class CandidateSet(NamedTuple):
    """Keys a block of queries may compute exactly, and which of them each query does (its support).

    ``keys``: per-key tensors (``Keys.fields``: y, values1, klog and, where the far field needs them, the
    far-field features), each (B, H, n, C, X) for n query blocks of C candidates; ``support``: (B, H, n, bq, C)
    bool, whether candidate c is in query i's exact support.
    """

    keys: list[Tensor]
    support: Tensor


def exact_logits(xq: Tensor, sets: list[CandidateSet]) -> list[Tensor]:
    """xq (B, H, n, bq, d) scaled queries -> their logits against each set's candidates, (B, H, n, bq, C) each."""
    return [xq @ candidates.keys[0].transpose(-2, -1) for candidates in sets]


def exact_sums(logits: list[Tensor], sets: list[CandidateSet]) -> PartialSums:
    """Softmax's sums over each query's support (the candidates its support mask keeps), relative to its largest
    exact logit; zero for queries with an empty support."""
    exact = [lg.masked_fill(~candidates.support, NEG_INF) for lg, candidates in zip(logits, sets, strict=True)]
    shift = torch.stack([ex.detach().amax(dim=-1, keepdim=True) for ex in exact]).amax(0)  # (B, H, n, bq, 1)
    shift = shift.clamp_min(torch.finfo(shift.dtype).min)  # finite: an empty support gives exp(-inf) = 0
    sums = 0
    for ex, candidates in zip(exact, sets, strict=True):
        sums = sums + torch.exp(ex - shift) @ candidates.keys[1]  # (B, H, n, bq, dv + 1)
    return PartialSums(sums, shift)


def merge(*parts: PartialSums) -> Tensor:
    """The parts' sums relative to their largest shift: one attention distribution. -> (..., dv + 1)"""
    shift = parts[0].shift
    for part in parts[1:]:
        shift = torch.maximum(shift, part.shift)
    total = 0
    for part in parts:
        total = total + part.sums * torch.exp(part.shift - shift)
    return total


def divide(sums: Tensor) -> Tensor:
    """(..., dv + 1) numerator | denominator -> (..., dv); 0 where nothing was visible, with zero gradients there (a
    clamped denominator would send them the gradient times ``1 / tiny``: NaN through the far field's features).

    The denominator's gradient is ``-(grad . out) / denominator``, formed without squaring it: a float32 denominator
    below about 1e-19 squares to 0, and a query whose output the loss ignores (a pad: gradient 0) then sent
    ``0 / 0`` = NaN to every key."""
    numerator, denominator = sums[..., :-1], sums[..., -1:]
    denominator = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    fixed = denominator.detach()
    out = numerator / fixed
    return out - out.detach() * ((denominator - fixed) / fixed)  # the second term: 0, with the gradient above


def global_rows(x: Tensor, keys: Keys, out: Tensor, num_global_tokens: int) -> Tensor:
    """Bidirectional global tokens: the first ``num_global_tokens`` queries of x (B, H, L, d) attend exactly to
    every real key; out (B, H, L, dv) keeps the other rows."""
    g = min(num_global_tokens, x.shape[2])
    logits = (x[:, :, :g] @ keys.y.transpose(-2, -1)).masked_fill(~keys.mask[:, None, None, :], NEG_INF)
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # (B, H, g, L)
    return torch.cat([weights @ keys.values1[..., :-1], out[:, :, g:]], dim=2)
