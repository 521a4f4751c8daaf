"""Causal block-sparse attention with query-aware block selection (``attention_method="sparse"``).

Each query computes exact softmax over its window (its own key block up to itself and ``local_window // block``
blocks before it), the first ``num_global_tokens`` keys, and the ``select_blocks`` earlier key blocks that hold the
most of its attention: each block is ranked by the log-sum-exp of the query's logits over its keys (and over the
query heads that share a key/value head), so a block is chosen when softmax over all keys would give it weight.
Selection is per query and reads only keys before the query's window, so a prefill followed by cached decoding
computes what one full forward does, position by position. (Cheaper block summaries lose the needle: per-channel
key bounds as in Quest and mean keys as in MoBA found no pass key in a 4K-token prompt of SmolLM2-135M where the
log-sum-exp finds it; ``benchmarks/long_context_retrieval.py``.)

Keys are kept per key/value head: grouped-query models are never repeated to the query heads. A call walks the
queries one key block at a time; the key blocks before a query's window are its *pool*. With ``budget=0`` the pool
is every earlier block (the keys are kept, reads stay sparse); with ``budget=n`` it is ``n`` blocks, and memory
stops growing: the ones that received the most attention while they were in the window (``ranking="window"``), or
the ones the last queries of each call attend to most (``ranking="latest"``, pruned at the end of the call; see
:class:`.SparseSpec`).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from .compiled_lengths import exported
from .cpu_kernels import hybrid_kernels
from .method_exact import softmax_attention
from .sparse_backward import walk_gradients
from .sparse_flex import flex_prefill, flex_prefill_serves
from .sparse_spec import SparseSpec, SparseState

Tensor = torch.Tensor

NEG_INF = float("-inf")
GATHERED_SHARE = 0.5  # the largest share of candidate blocks a block of queries reads gathered (_union)


class _Pool:
    """The blocks kept once they left the window (``budget > 0``) during a call: the state's, then the ones that
    leave the window, the ``budget`` best by their score (with ``select_blocks=0``, empty)."""

    def __init__(self, state: SparseState):
        self.keys, self.values = state.pool_keys, state.pool_values  # (B, Hkv, N, block, D)
        self.mask, self.score = state.pool_mask, state.pool_score  # (B, Hkv, N, block), (B, Hkv, N)

    def add(self, keys: Tensor, values: Tensor, selectable: Tensor, lo: int, hi: int, score: Tensor) -> None:
        """Append the stored rows lo ... hi - 1 (whole blocks) of keys / values (B, Hkv, R, D) and selectable (B, R)
        (:func:`_selectable`), with score (B, Hkv, (hi - lo) // block)."""
        B, Hkv, _, block = self.mask.shape
        self.keys = torch.cat([self.keys, keys[:, :, lo:hi].unflatten(2, (-1, block))], dim=2)
        self.values = torch.cat([self.values, values[:, :, lo:hi].unflatten(2, (-1, block))], dim=2)
        mask = selectable[:, None, lo:hi].expand(B, Hkv, -1).unflatten(2, (-1, block))
        self.mask = torch.cat([self.mask, mask], dim=2)
        self.score = torch.cat([self.score, score], dim=2)

    def prune(self, budget: int) -> None:
        """Keep the ``budget`` blocks of highest score, in pool order."""
        if self.score.shape[2] > budget:
            keep = self.score.topk(budget, dim=-1).indices.sort(dim=-1).values  # (B, Hkv, budget), in pool order
            self.score = self.score.gather(2, keep)
            self.mask = _gather_blocks(self.mask[..., None], keep)[..., 0]
            self.keys, self.values = _gather_blocks(self.keys, keep), _gather_blocks(self.values, keep)

    def observe(self, queries: Tensor) -> None:
        """Add to each block's score the attention it receives from queries (B, H, n, D): softmax over the pool's
        keys per query and head, summed over the queries and the heads that share a key/value head."""
        B, Hkv, N, block, D = self.keys.shape
        if not N:
            return
        grouped = queries.unflatten(1, (Hkv, -1)).flatten(2, 3) * D**-0.5  # (B, Hkv, G * n, D)
        logits = (grouped @ self.keys.flatten(2, 3).transpose(-1, -2)).float()  # (B, Hkv, G * n, N * block)
        logits = _hide(logits, self.mask.flatten(2, 3)[:, :, None])  # in place, as below: one buffer throughout
        peak = logits.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)  # no key: no weight
        weights = logits.sub_(peak).exp_()
        inverse = weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny).reciprocal_()
        received = inverse.transpose(-1, -2) @ weights  # (B, Hkv, 1, N * block): each key's probability, summed
        self.score = self.score + received.view(B, Hkv, N, block).sum(dim=-1).detach()  # (B, Hkv, N)

    def flat(self) -> tuple[Tensor, Tensor, Tensor]:
        """Keys, values (B, Hkv, N * block, D) and mask (B, Hkv, N * block)."""
        return self.keys.flatten(2, 3), self.values.flatten(2, 3), self.mask.flatten(2, 3)


def _selectable(key_mask: Tensor, start: int, spec: SparseSpec) -> Tensor:
    """Which stored keys (key_mask (B, R), positions start ... start + R - 1) a pool may select: real keys that are
    not global tokens."""
    positions = torch.arange(start, start + key_mask.shape[1], device=key_mask.device)
    return key_mask & (positions >= spec.num_global_tokens)


def _gather_blocks(blocks: Tensor, index: Tensor) -> Tensor:
    """blocks (B, Hkv, N, block, D) at index (B, Hkv, U) -> (B, Hkv, U, block, D)."""
    return blocks.gather(2, index[..., None, None].expand(-1, -1, -1, *blocks.shape[3:]))


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: SparseSpec,
    key_padding_mask: Tensor | None = None,
    state: SparseState | None = None,
    return_state: bool = False,
    grow_in_place: bool = False,
):
    """Causal sparse attention of L new tokens after ``state`` (or from the start).

    Args:
        q: (B, H, L, D) queries; k, v: (B, Hkv, L, D) keys and values, ``H`` a multiple of ``Hkv`` (query head ``h``
            reads key/value head ``h // (H // Hkv)``). Without ``state`` and ``budget``, k and v may also hold P
            earlier tokens first, (B, Hkv, P + L, D): a key/value cache, read in place.
        spec: the settings (:class:`.SparseSpec`).
        key_padding_mask: (B, Lk) bool over the keys given, True for real tokens; None: all real.
        state: what the earlier tokens left (:class:`.SparseState`), or None.
        return_state: also return the state after these tokens.
        grow_in_place: the new tokens' keys and values may be written into spare rows of the storage of ``state``'s
            (which then must not be used again: a cache layer, which keeps only the returned state), so that a
            decoding step does not copy the stored keys. Without gradients only.

    Returns:
        The context (B, H, L, Dv), and the new state when ``return_state``.
    """
    B, H, L, D = q.shape
    Hkv, block = k.shape[1], spec.block_size
    if H % Hkv:
        raise ValueError(f"{H} query heads cannot share {Hkv} key/value heads evenly.")
    past = k.shape[2] - L  # keys of earlier tokens given with the new ones (a key/value cache)
    if past and (state is not None or spec.bounded):
        raise ValueError("earlier keys are given either as a state or, without a budget, before the new keys.")
    if L == 1 and state is None and not spec.bounded and not return_state:  # a decoding step on a key/value cache
        return _decode_step(q, k, v, key_padding_mask, spec)
    new_mask = key_padding_mask
    if new_mask is None:
        new_mask = torch.ones(B, k.shape[2], dtype=torch.bool, device=k.device)
    # the state's buffers grow in place: not with tensors autograd tracks, nor while traced (no storages there)
    tracked = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
    in_place = grow_in_place and not tracked and not torch.compiler.is_compiling()
    given = state is None
    if given:  # the keys are stored as given: positions 0 ... P + L - 1
        state = SparseState.empty(k, v, block)
        keys, values, key_mask = k, v, new_mask
    else:
        state = _in_dtypes(state, k.dtype, v.dtype)
        keys = _append_rows(state.keys, k, in_place)  # (B, Hkv, R, D): positions start ... end - 1
        values = _append_rows(state.values, v, in_place)
        key_mask = _append_rows(state.key_mask, new_mask, in_place)  # (B, R)
    first, start = state.length + past, state.start
    end = first + L
    known, last = state.global_keys.shape[2], min(spec.num_global_tokens, end)  # global tokens: [0, last)
    global_keys, global_values, global_mask = state.global_keys, state.global_values, state.global_mask
    if last > known:
        fresh = slice(known - start, last - start)
        global_keys = torch.cat([global_keys, keys[:, :, fresh]], dim=2)  # (B, Hkv, S, D)
        global_values = torch.cat([global_values, values[:, :, fresh]], dim=2)
        global_mask = torch.cat([global_mask, key_mask[:, fresh]], dim=1)
    pooled_step = L == 1 and spec.bounded and not (spec.budget and spec.ranking == "window")
    kernels = _cpu_kernels(q, keys, values) if pooled_step else None
    if L == 1 and not spec.bounded:  # a decoding step with every key kept (start is 0): one pass over them
        # (traced, the mask as it is: the host read of whether it hides a key would break the graph)
        every_key = not torch.compiler.is_compiling() and bool(key_mask.all())
        context = _decode_step(q, keys, values, None if every_key else key_mask, spec)
        pool, pushed, mass = _Pool(state), start // block, state.mass
    elif kernels is not None:  # a bounded decoding step, compiled (without the "window" ranking)
        globals_ = (global_keys, global_values, global_mask)
        context, pool, pushed = _pooled_decode_step(q, keys, values, key_mask, globals_, state, spec, kernels)
        mass = state.mass
    else:
        walk = _BlockWalk(keys, values, key_mask, (global_keys, global_values, global_mask), state, spec)
        fused = given and not past and L > 1 and flex_prefill_serves(q, spec)  # from the first token, on CUDA
        exact = None
        if given and not past and not fused and not walk.by_window:  # from the first token: its leading queries
            # read every earlier key (no selection yet), exact attention in one call (SDPA's fused kernel)
            n = min(end, spec.covered_length)
            mask = None if key_padding_mask is None else key_mask[:, :n]
            exact = softmax_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], mask, True)[0]  # (B, H, n, Dv)
        context = walk.run(q, first, end, fused, exact, keep_state=return_state)
        pool, pushed, mass = walk.pool, walk.pushed, walk.mass
    if not return_state:
        return context
    drop = pushed * block - start
    if drop or given:  # views of the caller's keys or of more rows than kept: the state takes its own
        keys, values = _kept(keys[:, :, drop:], in_place), _kept(values[:, :, drop:], in_place)
        key_mask, mass = _kept(key_mask[:, drop:], in_place), _kept(mass[:, :, drop // block :], False)
    new_state = SparseState(
        keys,
        values,
        key_mask,
        mass,
        pool.keys,
        pool.values,
        pool.mask,
        pool.score,
        global_keys,
        global_values,
        global_mask,
        start=pushed * block,
        length=end,
    )
    return context, new_state


def _in_dtypes(state: SparseState, key_dtype: torch.dtype, value_dtype: torch.dtype) -> SparseState:
    """The state with its keys in ``key_dtype`` and its values in ``value_dtype``, those of the new tokens': a model
    cast between calls (``model.to(torch.bfloat16)``) continues its sequence in its new dtype. The masks, and the
    float32 masses and scores, stay as they are."""
    if (state.keys.dtype, state.values.dtype) == (key_dtype, value_dtype):
        return state
    return state._replace(
        keys=state.keys.to(key_dtype),
        values=state.values.to(value_dtype),
        pool_keys=state.pool_keys.to(key_dtype),
        pool_values=state.pool_values.to(value_dtype),
        global_keys=state.global_keys.to(key_dtype),
        global_values=state.global_values.to(value_dtype),
    )


SPARE_ROWS = 64  # rows a buffer of stored keys leaves free after them (grow_in_place)


def _append_rows(stored: Tensor, new: Tensor, in_place: bool) -> Tensor:
    """stored rows followed by new ones: keys or values (B, Hkv, R, D) and (B, Hkv, n, D) along dim 2, masks (B, R)
    and (B, n) along dim 1. With ``in_place``, written into the spare rows of the buffer stored is a view of, when it
    is one of :func:`_rows_buffer`'s and they suffice; else copied into a new one. Without: concatenated."""
    dim = 2 if stored.dim() == 4 else 1
    rows, n = stored.shape[dim], new.shape[dim]
    if not in_place:
        return torch.cat([stored, new], dim=dim)
    buffer = stored._base  # a buffer of ours when stored is its rows first ... first + rows - 1
    if getattr(buffer, "_sparse_rows_buffer", False) and stored.stride() == buffer.stride():
        first = (stored.data_ptr() - buffer.data_ptr()) // (stored.element_size() * stored.stride(dim))
        if first + rows + n <= buffer.shape[dim] and stored.shape[:dim] == buffer.shape[:dim]:
            grown = buffer.narrow(dim, first, rows + n)
            grown.narrow(dim, rows, n).copy_(new)
            return grown
    return _rows_buffer(stored, new)


def _rows_buffer(*parts: Tensor) -> Tensor:
    """The rows of parts one after another (as in :func:`_append_rows`) in a buffer of their own, with
    ``SPARE_ROWS`` free rows after them."""
    dim = 2 if parts[0].dim() == 4 else 1
    rows = sum(part.shape[dim] for part in parts)
    shape = list(parts[0].shape)
    shape[dim] = rows + SPARE_ROWS
    buffer = parts[0].new_empty(shape)
    buffer._sparse_rows_buffer = True
    torch.cat(parts, dim=dim, out=buffer.narrow(dim, 0, rows))
    return buffer.narrow(dim, 0, rows)


def _kept(rows: Tensor, spare: bool) -> Tensor:
    """A tensor as a state keeps it: as it is when it is a view of a buffer of ours or holds its storage alone;
    else copied (into a buffer with spare rows when ``spare``), so that the state does not keep alive more than it
    reads (the caller's keys, rows dropped from the front)."""
    if torch.compiler.is_compiling():  # traced: no storages to compare
        return rows.clone(memory_format=torch.contiguous_format)
    if getattr(rows._base, "_sparse_rows_buffer", False):
        return rows
    if rows.untyped_storage().nbytes() == rows.nbytes:
        # its storage, not the tensor it is a view of: a state kept for the caller's cache is dropped with the
        # caller's keys (:func:`.adopt_on_next_call`), which a view's ``_base`` would keep alive (a leak per call)
        return rows if rows.requires_grad else rows.detach()
    return _rows_buffer(rows) if spare else rows.clone(memory_format=torch.contiguous_format)


class _BlockWalk:
    """The queries of a call one key block at a time: each block's window, global tokens and selected pool blocks
    (with ``budget=0``, or ranking ``"latest"`` within the call, the stored blocks before the window, read in
    place); with ranking ``"window"`` the pool takes the blocks that leave the window, ranked by the attention they
    received there."""

    def __init__(self, keys: Tensor, values: Tensor, key_mask: Tensor, globals_, state: SparseState, spec: SparseSpec):
        self.keys, self.values, self.key_mask = keys, values, key_mask  # (B, Hkv, R, D), (B, R): positions start...
        self.global_keys, self.global_values, self.global_mask = globals_
        self.spec, self.start = spec, state.start
        self.pool, self.pushed = _Pool(state), state.start // spec.block_size
        self.first_block = self.pushed  # the block of the first stored key
        B, Hkv, R, _ = keys.shape
        self.mass = state.mass
        self.by_window = spec.budget > 0 and spec.ranking == "window"
        if self.by_window:  # the attention each stored block receives, for the pool's ranking
            stored_blocks = -(-R // spec.block_size)
            self.mass = torch.cat([self.mass, self.mass.new_zeros(B, Hkv, stored_blocks - self.mass.shape[2])], dim=2)
        self.selectable = _selectable(key_mask, self.start, spec)  # (B, R)
        # each block's candidates: the pool alone (empty without selection), or the stored keys before its window
        # (every key, or ranking "latest": this call's) after the pool's
        self.pool_alone = self.by_window or (spec.bounded and not spec.budget)

    def run(
        self, q: Tensor, first: int, end: int, fused: bool = False, exact: Tensor | None = None, keep_state: bool = True
    ) -> Tensor:
        """The context (B, H, L, Dv) of the queries q (B, H, L, D) at positions first ... end - 1: block by block, or
        ``fused`` (a call from the first token: :func:`.flex_prefill`), after ``exact``, the context of the leading
        queries (whole blocks, or all) where it is given. With ``ranking="latest"`` and ``keep_state``, the blocks that
        left the window join the pool at the end, ranked by the attention of the call's last block of queries, and the
        pool is pruned to the budget (without a gradient: a state is not differentiated; without ``keep_state``, as in
        training, no pool is built)."""
        block = self.spec.block_size
        if fused:
            contexts, done = [flex_prefill(q, self.keys, self.values, self.key_mask, self.spec)], end
        else:  # done: the first position left to walk
            contexts, done = ([], first) if exact is None else ([exact], first + exact.shape[2])
        if done > first:  # what the block walk leaves
            self._leave_window(done - 1)
        if done < end and exact is not None and _records_gradient(q, self.keys, self.values):
            # exact is given for a call from the first token whose pool is not ranked by the window: every stored key
            # is a candidate, so one gradient serves every walked query at once
            contexts.append(_WalkAttention.apply(self, done, q[:, :, done - first :], self.keys, self.values))
        elif done < end:  # the queries left, one key block's at a time (split: one gradient for them all)
            contexts.append(self.walk(q[:, :, done - first :], done)[0])
        if keep_state and self.spec.budget and not self.by_window:
            with torch.no_grad():
                left = self.pushed - self.first_block
                if left:
                    self._to_pool(0, left, q.new_zeros(*self.keys.shape[:2], left, dtype=torch.float32))
                self.pool.observe(q[:, :, -min(q.shape[2], block) :])
                self.pool.prune(self.spec.budget)
        return contexts[0] if len(contexts) == 1 else torch.cat(contexts, dim=2)

    def _leave_window(self, position: int) -> None:
        """With a bounded pool, the stored key blocks before the window of the query at ``position`` are no longer
        kept (the pool holds what it selected of them)."""
        if self.spec.bounded:
            self.pushed = max(self.pushed, position // self.spec.block_size - self.spec.window_blocks)

    def _to_pool(self, lo: int, hi: int, score: Tensor) -> None:
        """Add the stored key blocks lo ... hi - 1 (counted from the first stored one) to the pool, with ``score``
        (B, Hkv, hi - lo)."""
        block = self.spec.block_size
        self.pool.add(self.keys, self.values, self.selectable, lo * block, hi * block, score)

    def walk(self, q: Tensor, first: int) -> tuple[Tensor, Tensor, Tensor]:
        """The queries q (B, H, L, D) at positions first ... first + L - 1, one key block's at a time: their context
        (B, H, L, Dv), the candidate blocks each read (B, Hkv, L, N) (N: the last block's candidates; empty: none
        read) and each row's log-sum-exp (B, Hkv, G, L) (:meth:`_query_block`). Where every block's candidates are
        the stored keys before its window (a call from the first token, ranking ``"latest"`` or no budget), float32
        on the CPU, in the compiled loop (``csrc/sparse_walk.cpp``)."""
        spec, block, end = self.spec, self.spec.block_size, first + q.shape[2]
        prefix = not self.pool_alone and not self.pool.score.shape[2] and self.start == 0
        kernels = _cpu_kernels(q, self.keys, self.values) if prefix else None
        if kernels is not None:
            globals_ = [self.global_keys, self.global_values, self.global_mask]
            geometry = [block, spec.select_blocks, spec.window_blocks, first]
            context, chosen, lse = kernels.sparse_walk_attend(
                q, self.keys, self.values, self.key_mask, self.selectable, globals_, geometry
            )
            self._leave_window(end - 1)  # what _query_block leaves
            return context, chosen, lse
        return self._walk_blocks(q, first)

    def _walk_blocks(self, q: Tensor, first: int) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`walk` in Python, one :meth:`_query_block` call per block of queries."""
        block, end = self.spec.block_size, first + q.shape[2]
        cuts = [first, *range((first // block + 1) * block, end, block), end]
        chunks = q.split([hi - lo for lo, hi in itertools.pairwise(cuts)], dim=2)
        contexts, chosen, lse = zip(*map(self._query_block, chunks, cuts[:-1]), strict=True)
        return torch.cat(contexts, dim=2), _selection(chosen, lse), torch.cat(lse, dim=3)

    def _query_block(self, q: Tensor, q_lo: int) -> tuple[Tensor, Tensor, Tensor]:
        """The context (B, H, nq, Dv) of the call's queries q (B, H, nq, D) at positions q_lo ... q_lo + nq - 1, in
        one key block, with their selection and log-sum-exp (:func:`_attend`)."""
        spec, start, block = self.spec, self.start, self.spec.block_size
        keys, values, key_mask, selectable = self.keys, self.values, self.key_mask, self.selectable
        B, Hkv = keys.shape[:2]
        c = q_lo // block
        window_block = max(0, c - spec.window_blocks)
        if self.by_window and self.pushed < window_block:  # blocks [pushed, window_block) leave the window
            lo, hi = self.pushed - self.first_block, window_block - self.first_block
            self._to_pool(lo, hi, self.mass[:, :, lo:hi])
            self.pool.prune(spec.budget)
        self._leave_window(q_lo)
        if self.pool_alone:
            candidates = self.pool.flat()
        else:
            hi = window_block * block - start
            candidates = (keys[:, :, :hi], values[:, :, :hi], selectable[:, None, :hi].expand(B, Hkv, hi))
            if self.pool.score.shape[2]:
                candidates = tuple(torch.cat(parts, dim=2) for parts in zip(self.pool.flat(), candidates, strict=True))
        q_hi = q_lo + q.shape[2]
        queries = q.unflatten(1, (Hkv, -1))  # (B, Hkv, G, nq, D)
        window_lo, window_hi = window_block * block - start, q_hi - start
        key_pos = torch.arange(window_block * block, q_hi, device=keys.device)
        query_pos = torch.arange(q_lo, q_hi, device=keys.device)[:, None]
        window_visible = ((key_pos <= query_pos) & key_mask[:, None, window_lo:window_hi]) | (key_pos == query_pos)
        outside = min(self.global_keys.shape[2], window_block * block)  # global tokens in the window are read there
        parts = [
            (
                self.global_keys[:, :, :outside],
                self.global_values[:, :, :outside],
                self.global_mask[:, None, None, :outside],
            ),
            (keys[:, :, window_lo:window_hi], values[:, :, window_lo:window_hi], window_visible[:, None]),
        ]
        context, window_probs, chosen, lse = _attend(queries, parts, candidates, spec)
        if self.by_window:  # the attention the window's keys received from real queries, for the pool's ranking
            real = key_mask[:, q_lo - start : q_hi - start, None].to(window_probs.dtype)  # (B, nq, 1): a pad's own
            received = (window_probs * real[:, None, None]).sum(dim=(2, 3))  # (B, Hkv, Kw)
            # over selectable keys only: a global token's attention is not its block's (a left-padded row's global
            # tokens move in front of its pads, out of the block they share when the row is alone)
            received = received * selectable[:, None, window_lo:window_hi]
            ids = torch.arange(window_lo, window_hi, device=keys.device) // block
            self.mass.index_add_(2, ids, received.to(self.mass.dtype))
        return context.flatten(1, 2), chosen, lse  # (B, H, nq, Dv), (B, Hkv, nq, N), (B, Hkv, G, nq)


def _decode_step(q: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None, spec: SparseSpec) -> Tensor:
    """One query (B, H, 1, D) at position T - 1 over every key and value (B, Hkv, T, D) before it, ``key_mask``
    (B, T) or None: the logits are formed once, the blocks before the window ranked from them, and the values read
    only where the query attends (what :class:`_BlockWalk` computes for it, with fewer passes). In float32 on the
    CPU without gradients, the compiled kernel does it (``csrc/sparse_decode.cpp``)."""
    B, H, _, D = q.shape
    Hkv, T, Dv = keys.shape[1], keys.shape[2], values.shape[-1]
    G, block = H // Hkv, spec.block_size
    window_lo = max(0, (T - 1) // block - spec.window_blocks) * block  # the window: keys window_lo ... T - 1
    outside = min(spec.num_global_tokens, window_lo)  # global tokens read apart from the window
    n_blocks = window_lo // block  # the blocks before the window
    if n_blocks <= spec.select_blocks:  # every earlier key is read: exact attention, SDPA's fused kernel
        return softmax_attention(q, keys, values, key_mask, True)[0]
    kernels = _cpu_kernels(q, keys, values)
    if kernels is not None:
        keys, values = keys.contiguous(), values.contiguous()
        runs = [_run(keys, values, key_mask, lo, hi) for lo, hi in ((0, outside), (0, window_lo), (window_lo, T))]
        geometry = [block, spec.select_blocks, spec.num_global_tokens]  # global tokens are not selectable
        runs = [t for run in runs for t in run]
        queries = q.reshape(B, Hkv, G, D).contiguous()  # a view of a fused projection's (GPT-2's) may be strided
        context = kernels.sparse_decode_step(queries, runs, geometry, torch.empty(0))  # no scores
        return context.view(B, H, 1, Dv)
    logits = q.view(B, Hkv, G, D) @ keys.transpose(-1, -2) * D**-0.5  # (B, Hkv, G, T)
    if key_mask is not None:
        hidden = ~key_mask
        hidden[:, -1] = False  # every query sees itself
        logits = logits.masked_fill(hidden[:, None, None], NEG_INF)
    global_logits = logits[..., :outside].clone()
    logits[..., :outside] = NEG_INF  # global tokens are not selectable
    blocks = logits[..., :window_lo].unflatten(-1, (n_blocks, block))  # (B, Hkv, G, N, block)
    block_values = values[:, :, :window_lo].unflatten(2, (n_blocks, block))  # (B, Hkv, N, block, Dv)
    # the select_blocks of most attention: the log-sum-exp over each block's keys and the group's heads
    top = blocks.logsumexp(dim=(2, 4)).topk(spec.select_blocks, dim=-1).indices  # (B, Hkv, S)
    blocks = blocks.gather(3, top[:, :, None, :, None].expand(B, Hkv, G, -1, block))  # (B, Hkv, G, S, block)
    block_values = block_values.gather(2, top[..., None, None].expand(-1, -1, -1, block, Dv))
    support = torch.cat([global_logits, blocks.flatten(-2), logits[..., window_lo:]], dim=-1)  # (B, Hkv, G, K)
    probs = support.softmax(dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    support_values = torch.cat([values[:, :, :outside], block_values.flatten(2, 3), values[:, :, window_lo:]], dim=2)
    context = probs.to(values.dtype) @ support_values  # (B, Hkv, G, Dv)
    return context.view(B, H, 1, Dv)


def _run(keys: Tensor, values: Tensor, key_mask: Tensor | None, lo: int, hi: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows lo ... hi - 1 of keys and values (B, Hkv, T, D) and of key_mask (B, T) or None, as the compiled step
    takes a run of keys: views, and the mask's or an empty one (every key visible)."""
    mask = torch.empty(0, dtype=torch.bool) if key_mask is None else key_mask
    if (lo, hi) == (0, keys.shape[2]):
        return keys, values, mask
    return keys[:, :, lo:hi], values[:, :, lo:hi], mask[:, lo:hi] if mask.numel() else mask


def _pooled_decode_step(q, keys, values, key_mask, globals_, state: SparseState, spec: SparseSpec, kernels):
    """One query (B, H, 1, D) after a bounded state (without the ``"window"`` ranking), in the compiled kernel: what
    :class:`_BlockWalk` computes for it. keys, values (B, Hkv, R, D) and key_mask (B, R) are the stored tokens and
    the new one; globals_ the global tokens' keys, values and mask. A key block that leaves the window joins the
    pool; with a budget, each pool block's score gains the attention the query gives it (softmax over the pool) and
    the pool is pruned. Returns the context (B, H, 1, Dv), the pool and the first block still stored."""
    B, H, _, D = q.shape
    Hkv, block, start = keys.shape[1], spec.block_size, state.start
    keys, values = _packed_rows(keys), _packed_rows(values)  # a sequence's first token: the caller's view
    window_block = max(0, (start + keys.shape[2] - 1) // block - spec.window_blocks)
    left = window_block * block - start  # stored rows that leave the window at this step (whole blocks)
    pool = _Pool(state)
    if spec.budget and left:
        selectable = _selectable(key_mask[:, :left], start, spec)
        pool.add(keys, values, selectable, 0, left, q.new_zeros(B, Hkv, left // block))
    global_keys, global_values, global_mask = globals_
    outside = min(global_keys.shape[2], window_block * block)  # global tokens in the window are read there
    pool_keys, pool_values, pool_mask = pool.flat()
    runs = [
        *_run(global_keys, global_values, global_mask, 0, outside),
        pool_keys,
        pool_values,
        pool_mask,
        *_run(keys, values, key_mask, left, keys.shape[2]),
    ]
    scores = pool.score.clone() if spec.budget else torch.empty(0)  # + each pool block's attention from the query
    geometry = [block, spec.select_blocks, 0]
    context = kernels.sparse_decode_step(q.reshape(B, Hkv, -1, D).contiguous(), runs, geometry, scores)
    if spec.budget:
        pool.score = scores
        pool.prune(spec.budget)
    return context.view(B, H, 1, -1), pool, window_block


def _packed_rows(rows: Tensor) -> Tensor:
    """Keys or values (B, Hkv, R, D) with the rows the compiled kernels read: each row's entries, and a head's rows,
    one after another. A caller's single token (R = 1) from a (B, 1, Hkv, D) projection, transposed, has neither,
    though PyTorch counts it contiguous (its strides along a dimension of size 1 do not count): copied then."""
    if rows.stride(3) == 1 and rows.stride(2) == rows.shape[3]:
        return rows
    return rows.clone(memory_format=torch.contiguous_format)


def _cpu_kernels(*tensors: Tensor):
    """The compiled kernels when they serve these tensors: float32 on the CPU, no gradient to record (a decoding step;
    a block of queries, whose forward runs without one), not traced (torch.compile fuses the PyTorch form into its
    graph, where a call of the kernels would break it)."""
    if torch.compiler.is_compiling() or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    return None if _records_gradient(*tensors) else hybrid_kernels()


def _attend(queries: Tensor, parts, candidates, spec: SparseSpec) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Softmax of one block's queries (B, Hkv, G, nq, D) over the ``parts`` it reads whole (global tokens, then its
    window: (keys (B, Hkv, K, D), values, visible broadcastable to (B, Hkv, nq, K))) and the ``select_blocks`` blocks
    of ``candidates`` (keys, values (B, Hkv, N * block, D), mask (B, Hkv, N * block)) that hold the most of its
    attention. Returns the context (B, Hkv, G, nq, Dv), and without gradient the probabilities (B, Hkv, G, nq, Kw) of
    the window (the last part), the candidate blocks each query read (B, Hkv, nq, N) (empty: none read) and each
    row's log-sum-exp over what it read (B, Hkv, G, nq), float32 or wider. Where a gradient is wanted,
    :class:`_SupportAttention` keeps the selection alone for backward, not the logits."""
    tensors = [queries, *(t for part in parts for t in part), *candidates]
    if _records_gradient(*tensors):
        return _SupportAttention.apply(spec, len(parts), *tensors)
    return _attend_forward(queries, parts, candidates, spec)


def _attend_forward(queries: Tensor, parts, candidates, spec: SparseSpec):
    """:func:`_attend` without gradient. In float32 on the CPU, in the compiled kernel (:func:`_attend_compiled`)."""
    B, Hkv, G, nq, D = queries.shape
    flat = queries.flatten(2, 3) * D**-0.5  # (B, Hkv, G * nq, D), scaled once for every logit
    kernels = _cpu_kernels(queries, *(t for part in parts for t in part[:2]), *candidates[:2])
    if kernels is not None:
        return _attend_compiled(kernels, flat, parts, candidates, spec, nq)
    logits, values = [], []  # the parts read whole, then the pool's
    for keys, part_values, visible in parts:
        if keys.shape[2]:
            part = (flat @ keys.transpose(-1, -2)).unflatten(2, (G, nq))  # (B, Hkv, G, nq, K)
            logits.append(part.masked_fill_(~visible[:, :, None], NEG_INF))
            values.append(part_values)
    window = len(logits) - 1  # the window, never empty (every query sees itself), is the last part read whole
    # one softmax over what each query reads: a shared shift per query and head, the largest of its logits there (not
    # over every candidate: a head whose largest logit lies in a block its group did not choose would see every
    # exponential of its support vanish, 0 / 0), each part's exponentials and values
    peak = logits[0].amax(dim=-1, keepdim=True)
    for part in logits[1:]:
        peak = torch.maximum(peak, part.amax(dim=-1, keepdim=True))  # (B, Hkv, G, nq, 1)
    dtype = torch.promote_types(peak.dtype, torch.float32)
    peak = peak.to(dtype)
    pool_keys, pool_values, pool_mask = candidates
    chosen = queries.new_empty(0, dtype=torch.bool)
    selecting = pool_keys.shape[2] and spec.select_blocks
    if selecting:
        pool_logits = (flat @ pool_keys.transpose(-1, -2)).unflatten(2, (G, nq))  # (B, Hkv, G, nq, N * block)
        pool_logits = _hide(pool_logits, pool_mask[:, :, None, None]).to(dtype)
        pool_weights, block_peak, pool_values, chosen = _selected(pool_logits, pool_values, spec)
        peak = torch.maximum(peak, block_peak.amax(dim=-1, keepdim=True))
        shift = block_peak.sub_(peak).exp_()  # (B, Hkv, G, nq, U): each block's exponentials under the query's shift
        pool_weights = pool_weights.unflatten(-1, (-1, spec.block_size)).mul_(shift[..., None]).flatten(-2)
    weights = [part.to(dtype).sub_(peak).exp_() for part in logits]  # in place where part is in dtype already
    if selecting:
        weights.append(pool_weights)
        values.append(pool_values)
    total = sum(weight.sum(dim=-1, keepdim=True) for weight in weights)  # >= 1: every query sees itself
    pairs = zip(weights, values, strict=True)
    context = sum(weight.to(part.dtype).flatten(2, 3) @ part for weight, part in pairs)  # (B, Hkv, G * nq, Dv)
    context = (context.unflatten(2, (G, nq)) / total.to(context.dtype)).to(queries.dtype)
    lse = (peak + total.log()).squeeze(-1)  # (B, Hkv, G, nq)
    return context, weights[window].div_(total), chosen, lse


def _attend_compiled(kernels, flat: Tensor, parts, candidates, spec: SparseSpec, nq: int):
    """:func:`_attend_forward` in the compiled kernel (``csrc/sparse_block.cpp``): the logits of the parts read whole
    from matrix products here (flat: the scaled queries (B, Hkv, G * nq, D)); the candidates' a tile at a time, the
    softmax, the selection and only the chosen blocks' values there."""
    flat = flat.contiguous()  # scaled from a view of the model's queries, it may keep their head-major strides
    B, Hkv, GQ, _ = flat.shape
    G = GQ // nq
    runs = [part for part in parts if part[0].shape[2]]  # the window, never empty, is the last
    logits = [flat @ keys.transpose(-1, -2) for keys, _, _ in runs]  # (B, Hkv, G * nq, K) each
    masks = [visible.expand(B, Hkv, nq, keys.shape[2]) for keys, _, visible in runs]
    pool_keys, pool_values, pool_mask = candidates
    selecting = pool_keys.shape[2] and spec.select_blocks
    pool = [flat, pool_keys, pool_values, pool_mask[:, :, None].expand(B, Hkv, nq, -1)] if selecting else []
    geometry = [G, spec.block_size, spec.select_blocks]
    values = [run[1] for run in runs]
    context, window_probs, chosen, lse = kernels.sparse_block_attend(logits, values, masks, pool, geometry)
    return context.unflatten(2, (G, nq)), window_probs.unflatten(2, (G, nq)), chosen, lse.unflatten(2, (G, nq))


def _reads_on_host(tensor: Tensor) -> bool:
    """Whether a value of ``tensor`` read on the host may steer the work: on a CPU, where nothing waits for a device,
    and not traced (a read breaks the graph)."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def _hide(logits: Tensor, visible: Tensor) -> Tensor:
    """logits (..., K), -inf written in place where visible (broadcastable to them) is False. On a CPU only over the
    span of columns that hide some key (a pool's hidden keys are the global tokens and padding: mostly a prefix),
    which the host reads; elsewhere (and traced) over every column, without waiting for the device."""
    if not _reads_on_host(logits):
        return logits.masked_fill_(~visible, NEG_INF)
    hidden = (~visible).flatten(0, -2).any(dim=0).nonzero()  # (n, 1): the columns that hide a key
    if hidden.numel():
        lo, hi = int(hidden[0]), int(hidden[-1]) + 1
        logits[..., lo:hi].masked_fill_(~visible[..., lo:hi], NEG_INF)
    return logits


def _selected(logits: Tensor, values: Tensor, spec: SparseSpec):
    """The pool's logits (B, Hkv, G, nq, N * block) -> each query's ``select_blocks`` blocks of most attention (the
    log-sum-exp of a block's logits over its keys and the query heads of the group). Returns the exponentials of the
    blocks read, each under its own largest logit (in place of the logits), (B, Hkv, G, nq, U * block); those largest
    logits (B, Hkv, G, nq, U), -inf where the query did not choose the block (or it hides every key); their values
    (B, Hkv, U * block, Dv); and the choice (B, Hkv, nq, N) (every block, when there are no more than
    ``select_blocks``). U: the blocks some query chose (:func:`_union`), or all N."""
    blocks = logits.unflatten(-1, (-1, spec.block_size))  # (B, Hkv, G, nq, N, block)
    B, Hkv, G, nq, N, block = blocks.shape
    block_peak = blocks.amax(dim=-1)  # (B, Hkv, G, nq, N), -inf where every key is hidden
    finite = torch.finfo(blocks.dtype).min  # a block of hidden keys: exp(-inf - min) = 0, not exp(-inf + inf)
    weights = blocks.sub_(block_peak.clamp_min(finite)[..., None]).exp_()  # (B, Hkv, G, nq, N, block)
    if N <= spec.select_blocks:
        every = torch.ones(B, Hkv, nq, N, dtype=torch.bool, device=blocks.device)
        return weights.flatten(-2), block_peak, values, every
    # in log space: under one shift, the blocks of a head whose logits lie far below another head's would all be 0
    score = (block_peak + weights.sum(dim=-1).log()).logsumexp(dim=2)  # (B, Hkv, nq, N)
    top = score.topk(spec.select_blocks, dim=-1).indices
    chosen = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True)  # (B, Hkv, nq, N)
    union = _union(chosen)
    if union is not None:  # (B, Hkv, U)
        weights = weights.gather(4, union[:, :, None, None, :, None].expand(B, Hkv, G, nq, -1, block))
        block_peak = block_peak.gather(4, union[:, :, None, None, :].expand(B, Hkv, G, nq, -1))
        values = _gather_blocks(values.unflatten(2, (-1, block)), union).flatten(2, 3)
    chosen_there = chosen if union is None else _chosen_at(chosen, union)  # (B, Hkv, nq, U)
    return weights.flatten(-2), block_peak.masked_fill_(~chosen_there[:, :, None], NEG_INF), values, chosen


def _union(chosen: Tensor) -> Tensor | None:
    """The U blocks some query chose (chosen (B, Hkv, nq, N)), (B, Hkv, U) in block order, where they are at most
    :data:`GATHERED_SHARE` of them; None for all of them. Gathering most blocks copies more than reading them all
    costs (the whole 6-layer Llama of ``benchmarks/model_speed.py`` at 8K tokens, whose unions hold 88-100% of the
    blocks, infers 1.11x faster reading them all). On a CPU only: U is read on the host, which on a GPU would wait for
    the device at every call (once per layer and token while decoding); there (and traced, where the read would break
    the graph) every block stays, its weights zero where no query chose it."""
    if not _reads_on_host(chosen):
        return None
    union = chosen.any(dim=2)  # (B, Hkv, N)
    count = int(union.sum(dim=-1).max())
    if count > GATHERED_SHARE * chosen.shape[-1]:
        return None
    return union.to(torch.int8).topk(count, dim=-1, sorted=False).indices.sort(dim=-1).values


def _chosen_at(chosen: Tensor, union: Tensor) -> Tensor:
    """The choice (B, Hkv, nq, N) at the blocks of its union (B, Hkv, U) -> (B, Hkv, nq, U)."""
    return chosen.gather(3, union[:, :, None, :].expand(-1, -1, chosen.shape[2], -1))


def _records_gradient(*tensors: Tensor) -> bool:
    """Whether autograd records a graph through any of these tensors, outside an exported program (an inference
    graph, whose strict export traced the custom backward with dynamo, which refuses its host reads): there the
    plain operators, differentiable as they are."""
    return torch.is_grad_enabled() and not exported() and any(t.requires_grad for t in tensors)


class _WalkAttention(torch.autograd.Function):
    """The walked queries of a call from the first token (every stored key a candidate) with a gradient: the forward
    walks them without one (:meth:`_BlockWalk.walk`) and keeps each query's selection and log-sum-exp, not the logits;
    the backward recomputes the probabilities over each query's support for every walked query at once
    (:func:`.sparse_backward.walk_gradients`), with matrix products of useful size where one block's backward would
    read each chosen block for a few of its queries."""

    @staticmethod
    def forward(ctx, walk: _BlockWalk, first: int, queries: Tensor, keys: Tensor, values: Tensor):
        context, chosen, lse = walk.walk(queries, first)
        ctx.spec, ctx.first = walk.spec, first
        ctx.save_for_backward(queries, keys, values, walk.key_mask, walk.selectable, context, lse, chosen)
        return context

    @staticmethod
    def backward(ctx, grad: Tensor):
        queries, keys, values, key_mask, selectable, context, lse, chosen = ctx.saved_tensors
        gradients = walk_gradients(
            queries, keys, values, key_mask, selectable, context, lse, chosen, grad, ctx.spec, ctx.first
        )
        return None, None, *gradients


def _selection(chosen, lse) -> Tensor:
    """The candidate blocks each walked query read, (B, Hkv, L, N) bool (N: the last block's candidates; empty: none
    read), from each block's (B, Hkv, nq, N_i) (or empty: none read) and log-sum-exps (B, Hkv, G, nq)."""
    n = max(c.shape[-1] if c.numel() else 0 for c in chosen)
    if not n:
        return chosen[0].new_zeros(0)
    B, Hkv = lse[0].shape[:2]
    padded = [
        F.pad(c, (0, n - c.shape[-1])) if c.numel() else c.new_zeros(B, Hkv, rows.shape[-1], n)
        for c, rows in zip(chosen, lse, strict=True)
    ]
    return torch.cat(padded, dim=2)


class _SupportAttention(torch.autograd.Function):
    """:func:`_attend` with a gradient, in the memory of its inputs: the forward keeps the queries' selection alone
    (no logits: they are (queries x candidates), the whole call's O(L^2)), and the backward is exact attention's over
    each query's support (its global tokens, window and selected blocks, as a mask), recomputed: the selection is
    piecewise constant, so its gradient is that of softmax over the support, which SDPA's fused backward gives.
    Tensors: the queries, each part's keys, values and visible mask, then the candidates'."""

    @staticmethod
    def forward(ctx, spec: SparseSpec, n_parts: int, queries: Tensor, *tensors: Tensor):
        parts = [tensors[3 * i : 3 * i + 3] for i in range(n_parts)]
        context, window_probs, chosen, lse = _attend_forward(queries, parts, tensors[3 * n_parts :], spec)
        ctx.spec, ctx.n_parts = spec, n_parts
        ctx.save_for_backward(queries, *tensors, chosen)
        ctx.mark_non_differentiable(window_probs, chosen, lse)
        return context, window_probs, chosen, lse

    @staticmethod
    def backward(ctx, grad_context: Tensor, *_not_differentiable: Tensor):
        *saved, chosen = ctx.saved_tensors  # the queries, the tensors, the selection
        leaves = [t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad[2:], strict=True)]
        with torch.enable_grad():
            keys, values, visible = _support(leaves[0], leaves[1:], ctx.n_parts, chosen, ctx.spec)
            B, Hkv, G, nq, _ = leaves[0].shape
            mask = visible[:, :, None].expand(B, Hkv, G, nq, -1).flatten(2, 3)  # (B, Hkv, G * nq, K)
            context = torch.nn.functional.scaled_dot_product_attention(leaves[0].flatten(2, 3), keys, values, mask)
            needed = [leaf for leaf in leaves if leaf.requires_grad]
            grads = iter(torch.autograd.grad(context, needed, grad_context.flatten(2, 3), allow_unused=True))
        return None, None, *(next(grads) if leaf.requires_grad else None for leaf in leaves)


def _support(queries: Tensor, tensors, n_parts: int, chosen: Tensor, spec: SparseSpec):
    """Keys, values (B, Hkv, K, D) and visibility (B, Hkv, nq, K) of what one block's queries (B, Hkv, G, nq, D)
    read (:func:`_attend`'s parts and candidates, ``tensors``): the parts, then the candidate blocks some query chose
    (none when ``chosen`` is empty), each visible to the queries that chose it."""
    B, Hkv, _, nq, _ = queries.shape
    keys, values, visible = [], [], []
    for i in range(n_parts):
        part_keys, part_values, part_visible = tensors[3 * i : 3 * i + 3]
        if part_keys.shape[2]:
            keys.append(part_keys), values.append(part_values)
            visible.append(part_visible.expand(B, Hkv, nq, part_keys.shape[2]))
    pool_keys, pool_values, pool_mask = tensors[3 * n_parts :]
    if chosen.numel():  # the candidates were read: (B, Hkv, nq, N) chosen blocks
        block, union = spec.block_size, _union(chosen)
        pool_visible = pool_mask[:, :, None]  # (B, Hkv, 1, N * block)
        if union is not None:  # the blocks some query chose, (B, Hkv, U)
            pool_keys = _gather_blocks(pool_keys.unflatten(2, (-1, block)), union).flatten(2, 3)
            pool_values = _gather_blocks(pool_values.unflatten(2, (-1, block)), union).flatten(2, 3)
            pool_visible = _gather_blocks(pool_mask.unflatten(2, (-1, block))[..., None], union).flatten(2, 4)[
                :, :, None
            ]
            chosen = _chosen_at(chosen, union)  # (B, Hkv, nq, U)
        pool_visible = pool_visible & chosen.repeat_interleave(block, dim=-1)  # (B, Hkv, nq, U * block)
        keys.append(pool_keys), values.append(pool_values), visible.append(pool_visible)
    return torch.cat(keys, dim=2), torch.cat(values, dim=2), torch.cat(visible, dim=-1)
