"""The gradient of sparse attention over the queries a call walks from its first token (a training step's): every
walked query's softmax over its support (its global tokens, its window and the candidate blocks it chose), the
selection held fixed (it is piecewise constant), recomputed from each query's log-sum-exp as FlashAttention's
backward does: with ``P = exp(logits - lse)`` and ``delta = rowsum(dO * O)``, ``dV = P^T dO``, ``dS = P * (dO V^T -
delta)``, ``dQ = dS K``, ``dK = dS^T Q`` (times the logits' scale).

The work is laid out for matrix products of useful size: the windows and global tokens a chunk of query blocks at a
time (each block's queries against its own window), and each candidate key block once, with every query that chose
it (at 8K tokens about a thousand rows per block, where one block of queries chose each block a few times).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .sparse_spec import SparseSpec

Tensor = torch.Tensor

BAND_CHUNK = 8  # query blocks whose windows one set of products reads (each (G * block) x (globals + window))
PAIRS_AT_ONCE = 4096  # (query, chosen block) pairs whose rows are gathered at once (at least one block's)


def walk_gradients(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    key_mask: Tensor,
    selectable: Tensor,
    context: Tensor,
    lse: Tensor,
    chosen: Tensor,
    grad: Tensor,
    spec: SparseSpec,
    first: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the walked queries' contexts with respect to the queries, keys and values.

    Args:
        q: (B, H, Lw, D) the walked queries, at positions ``first ... first + Lw - 1``; ``first`` is a block
            boundary past the first window (the queries before it read every earlier key, apart).
        keys, values: (B, Hkv, R, D) every stored key and value from position 0 (``R >= first + Lw``).
        key_mask: (B, R) bool, True for real tokens; selectable: (B, R) bool, the keys a candidate block offers
            (real keys that are not global tokens).
        context: (B, H, Lw, Dv) the walked queries' contexts; lse: (B, Hkv, G, Lw) each row's log-sum-exp over its
            support; chosen: (B, Hkv, Lw, N) bool, the candidate blocks (key blocks 0 ... N - 1) each query read.
        grad: (B, H, Lw, Dv) the gradient of the contexts.

    Returns:
        The gradients of q, keys and values, in their dtypes.
    """
    B, H, Lw, D = q.shape
    Hkv, R = keys.shape[1], keys.shape[2]
    G, block = H // Hkv, spec.block_size
    n_blocks = -(-Lw // block)  # walked query blocks, the last padded
    rows = n_blocks * block
    stored = max(R, first + rows)  # key rows, padded to whole blocks
    dtype = torch.promote_types(q.dtype, torch.float32)

    def query_rows(t: Tensor, fill: float = 0.0) -> Tensor:  # (B, H, Lw, ...) -> (B, Hkv, G, rows, ...)
        t = t.to(dtype).unflatten(1, (Hkv, G))
        return t if rows == Lw else F.pad(t, (0, 0) * (t.dim() - 4) + (0, rows - Lw), value=fill)

    def key_rows(t: Tensor, fill=0) -> Tensor:  # (B, Hkv, R, D) -> (B, Hkv, stored, D); (B, R) -> (B, stored)
        if t.dim() == 4:
            t = t.to(dtype)
            return t if stored == R else F.pad(t, (0, 0, 0, stored - R))
        return t if stored == R else F.pad(t, (0, stored - R), value=fill)

    walk = _Rows(
        q=query_rows(q),
        grad=query_rows(grad),
        lse=query_rows(lse.flatten(1, 2), fill=float("inf")),  # padded rows: no probability
        delta=query_rows((grad.to(dtype) * context.to(dtype)).sum(-1)),  # rowsum(dO * O)
        keys=key_rows(keys),
        values=key_rows(values),
        scale=D**-0.5,
    )
    dq = torch.zeros_like(walk.q)  # (B, Hkv, G, rows, D)
    dk, dv = torch.zeros_like(walk.keys), torch.zeros_like(walk.values)  # (B, Hkv, stored, D)
    _band(walk, key_rows(key_mask, False), first, spec, dq, dk, dv)
    if chosen.shape[-1]:
        _chosen_blocks(walk, key_rows(selectable, False), chosen, spec, dq, dk, dv)
    dq = dq[:, :, :, :Lw].flatten(1, 2).to(q.dtype)
    return dq, dk[:, :, :R].to(keys.dtype), dv[:, :, :R].to(values.dtype)


class _Rows(NamedTuple):
    """The walked rows in the backward's dtype: queries, gradients (B, Hkv, G, rows, D), log-sum-exps and deltas
    (B, Hkv, G, rows), keys and values (B, Hkv, stored, D), and the logits' scale."""

    q: Tensor
    grad: Tensor
    lse: Tensor
    delta: Tensor
    keys: Tensor
    values: Tensor
    scale: float


def _band(walk: _Rows, key_mask: Tensor, first: int, spec: SparseSpec, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """The gradients through each query's global tokens and window (blocks ``c - W ... c`` for query block ``c``),
    ``BAND_CHUNK`` query blocks at a time: dq written, dk and dv added to."""
    B, Hkv, G, rows, D = walk.q.shape
    block, W = spec.block_size, spec.window_blocks
    n_blocks, c0, device = rows // block, first // block, walk.q.device
    n_global = min(spec.num_global_tokens, first + rows)  # global tokens: keys 0 ... n_global - 1
    span = (W + 1) * block  # a window's keys
    windows = [t.unflatten(2, (-1, block)).unfold(2, W + 1, 1) for t in (walk.keys, walk.values)]
    dk_blocks, dv_blocks = dk.unflatten(2, (-1, block)), dv.unflatten(2, (-1, block))  # (B, Hkv, nk, block, D)
    for s in range(0, n_blocks, BAND_CHUNK):
        n = min(BAND_CHUNK, n_blocks - s)
        lo, hi, c = s * block, (s + n) * block, c0 + s  # the chunk's rows, its first query block

        # (B, Hkv, G, rows, ...) -> (B, Hkv, n, G * block, ...): each query block's rows, by head
        queries, grads, lse, delta = (
            t[:, :, :, lo:hi].unflatten(3, (n, block)).transpose(2, 3).flatten(3, 4)
            for t in (walk.q, walk.grad, walk.lse, walk.delta)
        )
        keys, values = (
            torch.cat(
                [
                    t[:, :, None, :n_global].expand(B, Hkv, n, n_global, t.shape[-1]),
                    w[:, :, c - W : c - W + n].permute(0, 1, 2, 5, 3, 4).flatten(3, 4),  # (B, Hkv, n, span, D)
                ],
                dim=3,
            )
            for t, w in zip((walk.keys, walk.values), windows, strict=True)
        )  # (B, Hkv, n, n_global + span, D)
        window_lo = (c + torch.arange(n, device=device) - W) * block  # (n,)
        query_pos = c * block + torch.arange(n * block, device=device).view(n, block)  # (n, block)
        key_pos = window_lo[:, None] + torch.arange(span, device=device)  # (n, span)
        in_window = (key_pos[:, None] <= query_pos[:, :, None]) & key_mask[:, key_pos][:, :, None]
        in_window |= key_pos[:, None] == query_pos[:, :, None]  # (B, n, block, span): every query sees itself
        globals_ = (torch.arange(n_global, device=device) < window_lo[:, None]) & key_mask[:, None, :n_global]
        visible = torch.cat([globals_[:, :, None].expand(-1, -1, block, -1), in_window], dim=-1)
        probs = (queries @ keys.transpose(-1, -2)).mul_(walk.scale).sub_(lse[..., None]).exp_()
        probs = probs.unflatten(3, (G, block)).masked_fill_(~visible[:, None, :, None], 0).flatten(3, 4)
        dv_chunk = probs.transpose(-1, -2) @ grads  # (B, Hkv, n, n_global + span, Dv)
        scores = (grads @ values.transpose(-1, -2)).sub_(delta[..., None]).mul_(probs)  # dS
        dq[:, :, :, lo:hi] = (scores @ keys).mul_(walk.scale).unflatten(3, (G, block)).transpose(2, 3).flatten(3, 4)
        dk_chunk = (scores.transpose(-1, -2) @ queries).mul_(walk.scale)  # (B, Hkv, n, n_global + span, D)
        for grad_chunk, grad_blocks, grad_all in ((dk_chunk, dk_blocks, dk), (dv_chunk, dv_blocks, dv)):
            grad_all[:, :, :n_global] += grad_chunk[:, :, :, :n_global].sum(dim=2)
            window = grad_chunk[:, :, :, n_global:].unflatten(3, (W + 1, block))  # (B, Hkv, n, W + 1, block, D)
            for o in range(W + 1):  # window block o of query block c + i is key block c + i - W + o
                grad_blocks[:, :, c - W + o : c - W + o + n] += window[:, :, :, o]


def _chosen_blocks(walk: _Rows, selectable: Tensor, chosen: Tensor, spec: SparseSpec, dq, dk, dv) -> None:
    """The gradients through the candidate blocks each query chose: per key/value head, each chosen block once with
    every query that chose it (their rows gathered a run of blocks at a time); dq, dk and dv added to."""
    B, Hkv, G, rows, D = walk.q.shape
    block, N = spec.block_size, chosen.shape[-1]
    key_blocks = [t.unflatten(2, (-1, block)) for t in (walk.keys, walk.values, dk, dv)]  # (B, Hkv, nk, block, D)
    keys, values, dk_blocks, dv_blocks = key_blocks
    offered = selectable[:, : N * block].view(B, N, block)
    partial = (~offered).any(dim=-1).tolist()  # the blocks with a key no candidate offers (global tokens, padding)
    for b in range(B):
        for h in range(Hkv):
            pairs = chosen[b, h].transpose(0, 1).nonzero()  # (P, 2): (block, query), by block
            counts = chosen[b, h].sum(dim=0).tolist()  # queries per block
            by_query = [t[b, h].transpose(0, 1).contiguous() for t in (walk.q, walk.grad, walk.lse, walk.delta)]
            dq_by_query = torch.zeros_like(by_query[0])  # (rows, G, D)
            for blocks, lo, hi in _pair_groups(counts):
                query = pairs[lo:hi, 1]
                # each pair's rows, by pair then head: (P * G, D), (P * G, Dv), (P * G, 1) twice
                q_rows, grad_rows, lse, delta = (t.index_select(0, query).flatten(0, 1) for t in by_query)
                lse, delta = lse[:, None], delta[:, None]
                dq_rows = torch.empty_like(q_rows)
                start = 0
                for j in blocks:  # the module's formulas, as in _band, with the products accumulated in place
                    r = slice(start * G, (start + counts[j]) * G)
                    start += counts[j]
                    key, value = keys[b, h, j], values[b, h, j]  # (block, D)
                    probs = (q_rows[r] @ key.T).mul_(walk.scale).sub_(lse[r]).exp_()  # (count * G, block)
                    if partial[b][j]:
                        probs.masked_fill_(~offered[b, j], 0)
                    dv_blocks[b, h, j].addmm_(probs.T, grad_rows[r])
                    scores = (grad_rows[r] @ value.T).sub_(delta[r]).mul_(probs)  # dS
                    torch.mm(scores, key, out=dq_rows[r])
                    dk_blocks[b, h, j].addmm_(scores.T, q_rows[r], alpha=walk.scale)
                dq_by_query.index_add_(0, query, dq_rows.view(-1, G, D), alpha=walk.scale)
            dq[b, h] += dq_by_query.transpose(0, 1)


def _pair_groups(counts: list[int]):
    """The chosen blocks (``counts``: the queries that chose each) in runs of about ``PAIRS_AT_ONCE`` pairs: (the
    run's blocks, its first pair, its end), pairs ordered by block."""
    blocks, lo, filled = [], 0, 0
    for j, count in enumerate(counts):
        if count:
            blocks.append(j)
            filled += count
        if blocks and (filled >= PAIRS_AT_ONCE or j == len(counts) - 1):
            yield blocks, lo, lo + filled
            blocks, lo, filled = [], lo + filled, 0
