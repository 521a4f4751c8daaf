"""Causal block-sparse attention with query-aware block selection (``attention_method="sparse"``).

Each query computes exact softmax over its window (its own key block up to itself and ``local_window // block``
blocks before it), the first ``num_global_tokens`` keys, and the ``select_blocks`` earlier key blocks whose per-channel
key bounds promise it the largest logits (Quest's bound: ``sum_c max(q_c min_c, q_c max_c)``, summed over the query
heads that share a key/value head). Selection is per query and reads only keys before the query's window, so a
prefill followed by cached decoding computes what one full forward does, position by position.

Keys are kept per key/value head: grouped-query models are never repeated to the query heads. A call walks the
queries one key block at a time; as the window moves past a key block, the block joins the *pool* the later queries
select from (:class:`.SparseState`). With ``budget=0`` the pool keeps every block; with ``budget=n`` it keeps the
``n`` blocks that received the most attention while they were in the window, and decoding memory stops growing.
"""

from __future__ import annotations

import torch

from .sparse_spec import SparseSpec, SparseState

Tensor = torch.Tensor


class _Pool:
    """The selectable key blocks during a call: the state's pool, then the blocks that leave the window."""

    def __init__(self, state: SparseState):
        self.keys, self.values, self.mask = state.pool_keys, state.pool_values, state.pool_mask
        self.min, self.max, self.score = state.pool_min, state.pool_max, state.pool_score

    def add(self, keys: Tensor, values: Tensor, mask: Tensor, score: Tensor, budget: int) -> None:
        """Append n blocks: keys / values (B, Hkv, n, block, D), mask (B, Hkv, n, block), score (B, Hkv, n); then keep
        the ``budget`` best (0: all)."""
        low, high = _block_bounds(keys, mask)
        self.keys = torch.cat([self.keys, keys], dim=2)
        self.values = torch.cat([self.values, values], dim=2)
        self.mask = torch.cat([self.mask, mask], dim=2)
        self.min, self.max = torch.cat([self.min, low], dim=2), torch.cat([self.max, high], dim=2)
        self.score = torch.cat([self.score, score], dim=2)
        if budget and self.score.shape[2] > budget:
            keep = self.score.topk(budget, dim=-1).indices.sort(dim=-1).values  # (B, Hkv, budget), in pool order
            self.score = self.score.gather(2, keep)
            self.mask = self.mask.gather(2, keep[..., None].expand(-1, -1, -1, self.mask.shape[-1]))
            self.min, self.max = (t.gather(2, keep[..., None].expand(-1, -1, -1, t.shape[-1])) for t in (self.min, self.max))
            self.keys, self.values = (_gather_blocks(t, keep) for t in (self.keys, self.values))


def _block_bounds(keys: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel min and max (B, Hkv, n, D) of each block's real keys (blocks (B, Hkv, n, block, D), mask (.., block));
    an empty block gets (+max, -max), which no query's bound can prefer to a real one."""
    big = torch.finfo(keys.dtype).max
    hidden = ~mask[..., None]
    return keys.masked_fill(hidden, big).amin(dim=3), keys.masked_fill(hidden, -big).amax(dim=3)


def _gather_blocks(blocks: Tensor, index: Tensor) -> Tensor:
    """blocks (B, Hkv, N, block, D) at index (B, Hkv, U) -> (B, Hkv, U, block, D)."""
    return blocks.gather(2, index[..., None, None].expand(-1, -1, -1, *blocks.shape[3:]))


def _selected(pool: _Pool, queries: Tensor, spec: SparseSpec):
    """The pool blocks each query reads: queries (B, Hkv, G, nq, D) -> keys and values (B, Hkv, U * block, D) of the
    U blocks that some query selected, and the visibility mask (B, Hkv, nq, U * block); or None for an empty pool."""
    B, Hkv, G, nq, _ = queries.shape
    N = pool.score.shape[2]
    if N == 0 or spec.select_blocks == 0:
        return None
    valid = pool.mask.any(dim=-1)  # (B, Hkv, N)
    if N <= spec.select_blocks:  # every block is selected
        chosen = valid[:, :, None, :].expand(B, Hkv, nq, N)
        keys, values, key_mask = pool.keys, pool.values, pool.mask
    else:
        positive, negative = queries.clamp(min=0).sum(2), queries.clamp(max=0).sum(2)  # (B, Hkv, nq, D)
        bound = positive @ pool.max.transpose(-1, -2).to(positive.dtype) + negative @ pool.min.transpose(-1, -2).to(
            positive.dtype
        )  # (B, Hkv, nq, N)
        bound = bound.masked_fill(~valid[:, :, None, :], float("-inf"))
        top = bound.topk(spec.select_blocks, dim=-1).indices  # (B, Hkv, nq, k)
        chosen = torch.zeros_like(bound, dtype=torch.bool).scatter_(-1, top, True) & valid[:, :, None, :]
        union = chosen.any(dim=2)  # (B, Hkv, N)
        count = int(union.sum(dim=-1).max())
        index = union.to(torch.int8).topk(count, dim=-1).indices  # (B, Hkv, U): every block some query chose
        chosen = chosen.gather(3, index[:, :, None, :].expand(B, Hkv, nq, count))
        keys, values = _gather_blocks(pool.keys, index), _gather_blocks(pool.values, index)
        key_mask = pool.mask.gather(2, index[..., None].expand(-1, -1, -1, pool.mask.shape[-1]))
    block = keys.shape[3]
    visible = chosen[..., None] & key_mask[:, :, None]  # (B, Hkv, nq, U, block)
    return keys.flatten(2, 3), values.flatten(2, 3), visible.flatten(3, 4)


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: SparseSpec,
    key_padding_mask: Tensor | None = None,
    state: SparseState | None = None,
    return_state: bool = False,
):
    """Causal sparse attention of L new tokens after ``state`` (or from the start).

    Args:
        q: (B, H, L, D) queries; k, v: (B, Hkv, L, D) keys and values, ``H`` a multiple of ``Hkv`` (query head ``h``
            reads key/value head ``h // (H // Hkv)``).
        spec: the settings (:class:`.SparseSpec`).
        key_padding_mask: (B, L) bool, True for real tokens; None: all real.
        state: what the earlier tokens left (:class:`.SparseState`), or None.
        return_state: also return the state after these tokens.

    Returns:
        The context (B, H, L, Dv), and the new state when ``return_state``.
    """
    B, H, L, D = q.shape
    Hkv, block = k.shape[1], spec.block_size
    if H % Hkv:
        raise ValueError(f"{H} query heads cannot share {Hkv} key/value heads evenly.")
    G = H // Hkv
    state = SparseState.empty(k, v, block) if state is None else state
    new_mask = torch.ones(B, L, dtype=torch.bool, device=k.device) if key_padding_mask is None else key_padding_mask
    first, end, start = state.length, state.length + L, state.start
    keys = torch.cat([state.keys, k.to(state.keys.dtype)], dim=2)  # (B, Hkv, R, D): positions start ... end - 1
    values = torch.cat([state.values, v.to(state.values.dtype)], dim=2)
    key_mask = torch.cat([state.key_mask, new_mask], dim=1)  # (B, R)
    stored_blocks = -(-(end - start) // block)
    mass = torch.cat([state.mass, state.mass.new_zeros(B, Hkv, stored_blocks - state.mass.shape[2])], dim=2)
    new_globals = max(0, min(spec.num_global_tokens, end) - first)
    global_keys = torch.cat([state.global_keys, keys[:, :, first - start : first - start + new_globals]], dim=2)
    global_values = torch.cat([state.global_values, values[:, :, first - start : first - start + new_globals]], dim=2)
    global_mask = torch.cat([state.global_mask, key_mask[:, first - start : first - start + new_globals]], dim=1)

    pool, pushed = _Pool(state), start // block
    not_global = torch.arange(start, start + stored_blocks * block, device=k.device) >= spec.num_global_tokens
    contexts = []
    for c in range(first // block, (end - 1) // block + 1):  # the query blocks of this call
        window_block = max(0, c - spec.window_blocks)
        if pushed < window_block:  # blocks [pushed, window_block) leave the window
            lo, hi = (pushed * block - start), (window_block * block - start)
            mask = (key_mask[:, lo:hi] & not_global[lo:hi]).view(B, 1, -1, block).expand(B, Hkv, -1, block)
            pool.add(
                keys[:, :, lo:hi].unflatten(2, (-1, block)),
                values[:, :, lo:hi].unflatten(2, (-1, block)),
                mask,
                mass[:, :, lo // block : hi // block],
                spec.budget,
            )
            pushed = window_block
        q_lo, q_hi = max(first, c * block), min(end, (c + 1) * block)
        queries = q[:, :, q_lo - first : q_hi - first].unflatten(1, (Hkv, G))  # (B, Hkv, G, nq, D)
        context, window_probs = _attend_block(
            queries,
            (keys, values, key_mask, start),
            (global_keys, global_values, global_mask),
            pool,
            (q_lo, q_hi, window_block * block),
            spec,
        )
        contexts.append(context.flatten(1, 2))  # (B, H, nq, Dv)
        if spec.budget:  # the attention the window's keys received, for the pool's ranking
            lo = window_block * block - start
            received = window_probs.sum(dim=(2, 3))  # (B, Hkv, Kw)
            ids = torch.arange(lo, lo + received.shape[-1], device=k.device) // block
            mass.index_add_(2, ids, received.to(mass.dtype))
    context = torch.cat(contexts, dim=2)
    if not return_state:
        return context
    drop = pushed * block - start
    new_state = SparseState(
        keys[:, :, drop:],
        values[:, :, drop:],
        key_mask[:, drop:],
        mass[:, :, drop // block :],
        pool.keys,
        pool.values,
        pool.mask,
        pool.min,
        pool.max,
        pool.score,
        global_keys,
        global_values,
        global_mask,
        start=pushed * block,
        length=end,
    )
    return context, new_state


def _attend_block(queries: Tensor, stored, globals_, pool: _Pool, span, spec: SparseSpec):
    """Softmax of one block's queries (B, Hkv, G, nq, D) over the global tokens, its selected pool blocks and its
    window. ``stored``: (keys, values, mask, start) of the positions from ``start``; ``span``: (first query position,
    end, window start). Returns the context (B, Hkv, G, nq, Dv) and the detached probabilities (B, Hkv, G, nq, Kw) of
    the window's keys."""
    keys, values, key_mask, start = stored
    q_lo, q_hi, window_start = span
    B, Hkv, G, nq, D = queries.shape
    device = queries.device
    parts = []  # (keys (B, Hkv, K, D), values, visible (B, Hkv or 1, nq, K))
    global_keys, global_values, global_mask = globals_
    outside = min(global_keys.shape[2], window_start)  # global tokens in the window are read there
    if outside:
        visible = global_mask[:, None, None, :outside].expand(B, 1, nq, outside)
        parts.append((global_keys[:, :, :outside], global_values[:, :, :outside], visible))
    selected = _selected(pool, queries, spec)
    if selected is not None:
        parts.append(selected)
    lo, hi = window_start - start, q_hi - start
    key_pos = torch.arange(window_start, q_hi, device=device)
    query_pos = torch.arange(q_lo, q_hi, device=device)[:, None]
    visible = ((key_pos <= query_pos) & key_mask[:, None, lo:hi]) | (key_pos == query_pos)  # (B, nq, Kw)
    parts.append((keys[:, :, lo:hi], values[:, :, lo:hi], visible[:, None]))

    all_keys = torch.cat([p[0] for p in parts], dim=2)  # (B, Hkv, K, D)
    all_values = torch.cat([p[1] for p in parts], dim=2)
    visible = torch.cat([p[2].expand(B, Hkv, nq, -1) for p in parts], dim=3)  # (B, Hkv, nq, K)
    logits = (queries.flatten(2, 3) @ all_keys.transpose(-1, -2)) * D**-0.5  # (B, Hkv, G * nq, K)
    logits = logits.unflatten(2, (G, nq)).masked_fill(~visible[:, :, None], float("-inf"))
    probs = logits.softmax(dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # (B, Hkv, G, nq, K)
    context = probs.to(all_values.dtype).flatten(2, 3) @ all_values  # (B, Hkv, G * nq, Dv)
    return context.unflatten(2, (G, nq)), probs.detach()[..., -(hi - lo) :]
