"""Causal sparse attention's prefill through FlexAttention: the backend for CUDA devices.

The PyTorch path walks the queries one key block at a time (:class:`.sparse_attention._BlockWalk`): a round of
small kernels per block of 64 queries. Here a call from the first token is two steps:

- the selection: each query's ``select_blocks`` key blocks before its window with the largest log-sum-exp of its
  logits over the block's selectable keys and the query heads that share its key/value head (the walk's ranking),
  computed slab by slab of queries as dense matrix products; kept as bits, 32 blocks to a word, per query;
- one FlexAttention call over a ``BlockMask``: a query's window (its own block up to itself and ``window_blocks``
  blocks before), the global tokens before the window and its selected blocks, grouped-query heads read in place.

It gives the walk's context; the state after the call comes from the walk's own bookkeeping
(:meth:`.sparse_attention._BlockWalk.run`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .hybrid_flex import TILE, block_bits, flex_attend, flex_available, flex_enabled, has_bit, in_memory, tile_mask
from .slabs import slabs
from .sparse_spec import SparseSpec

Tensor = torch.Tensor


def flex_prefill_serves(q: Tensor, spec: SparseSpec) -> bool:
    """Whether a call from the first token runs through FlexAttention: on CUDA (``PERFORMER_HF_FLEX`` not ``0``,
    torch >= 2.9 with Triton), model dtypes of 16 or 32 bits, key blocks that divide the tile, and a pool that does
    not rank blocks by the attention they receive in the window (``ranking="window"`` needs the walk)."""
    return (
        q.device.type == "cuda"
        and flex_enabled()
        and flex_available()
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and TILE % spec.block_size == 0
        and not (spec.budget and spec.ranking == "window")
    )


def flex_prefill(q: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor, spec: SparseSpec) -> Tensor:
    """The context (B, H, L, Dv) of causal sparse attention from the first token: q (B, H, L, D), keys and values
    (B, Hkv, L, D) of the same positions, key_mask (B, L) bool."""
    B, H, L, D = q.shape
    Hkv, block = keys.shape[1], spec.block_size
    group = H // Hkv
    position = torch.arange(L, device=q.device)
    window_start = (position // block - spec.window_blocks).clamp_min(0) * block  # (L,): the first key of the window
    selectable = key_mask & (position >= spec.num_global_tokens)  # (B, L): real keys that are not global tokens
    scaled = q * D**-0.5
    padded = -(-L // TILE) * TILE
    tiles = padded // TILE
    words, selected_tiles = _selection(scaled, keys, selectable, window_start, spec, padded)
    key_mask_p = in_memory(F.pad(key_mask, (0, padded - L), value=False))  # (B, padded): what mask_mod reads
    selectable_p = in_memory(F.pad(selectable, (0, padded - L), value=False))
    window_start_p = in_memory(F.pad(window_start, (0, padded - L)))
    nb_global = spec.num_global_tokens

    def mask_mod(b, h, q_idx, kv_idx):
        start = window_start_p[q_idx]
        window = (kv_idx >= start) & (kv_idx <= q_idx) & (key_mask_p[b, kv_idx] | (kv_idx == q_idx))
        before = kv_idx < start
        is_global = before & (kv_idx < nb_global) & key_mask_p[b, kv_idx]
        chosen = before & selectable_p[b, kv_idx] & has_bit(words, (b, h // group, q_idx), kv_idx // block)
        return window | is_global | chosen

    start = torch.arange(tiles, device=q.device) * TILE  # (tiles,)
    first_key = window_start_p[start]  # (query tiles,): the first window key of each query tile's first query
    touched = (start[None, :] + TILE - 1 >= first_key[:, None]) & (start[None, :] <= start[:, None])  # the window
    touched = (touched | (start[None, :] < nb_global)) | selected_tiles  # (B, Hkv, query tiles, key tiles)
    has_keys = key_mask_p.view(B, 1, 1, tiles, TILE).any(-1)
    touched = touched & has_keys | torch.eye(tiles, dtype=torch.bool, device=q.device)  # a query always sees itself
    mask = tile_mask(touched.repeat_interleave(group, dim=1), mask_mod, (L, L))  # tiles per query head
    context, _ = flex_attend(scaled, keys.to(q.dtype), values.to(q.dtype), mask)
    return context


def _selection(scaled: Tensor, keys: Tensor, selectable: Tensor, window_start: Tensor, spec: SparseSpec, padded: int):
    """Each query's selected key blocks as bits (B, Hkv, padded, words of 32 blocks), int32, and the tiles they reach
    (B, Hkv, query tiles, key tiles). A query with no more candidate blocks than ``select_blocks`` takes them all."""
    B, H, L, D = scaled.shape
    Hkv, block = keys.shape[1], spec.block_size
    group, nb_blocks, tiles = H // Hkv, -(-padded // block), padded // TILE
    words = torch.zeros(B, Hkv, padded, -(-nb_blocks // 32), dtype=torch.int32, device=scaled.device)
    reached = torch.zeros(B, Hkv, tiles * tiles + 1, dtype=torch.bool, device=scaled.device)
    if not spec.select_blocks:
        return words, reached[..., :-1].view(B, Hkv, tiles, tiles)
    grouped = scaled.unflatten(1, (Hkv, group))  # (B, Hkv, G, L, D)
    for rows in slabs(L, B * H * L, "blocks", scaled.device):
        lo, hi = rows.start, rows.stop
        end = max(0, (hi - 1) // block - spec.window_blocks) * block  # keys before the slab's last window
        blocks = end // block
        if blocks:
            logits = (grouped[:, :, :, lo:hi] @ keys[:, :, None, :end].transpose(-1, -2)).float()  # (B, Hkv, G, n, K)
            candidate = selectable[:, None, None, None, :end] & (
                torch.arange(end, device=scaled.device) < window_start[lo:hi, None]
            )  # (B, 1, 1, n, K)
            logits = logits.masked_fill(~candidate, float("-inf")).unflatten(-1, (blocks, block))
            score = torch.logsumexp(logits, dim=(2, 5))  # (B, Hkv, n, blocks): over the group's heads and the keys
            top = score.topk(min(spec.select_blocks, blocks), dim=-1)
            real = torch.isfinite(top.values)  # (B, Hkv, n, t): a block with a selectable key before the window
            chosen = top.indices
            words[:, :, lo:hi] = block_bits(chosen, real, nb_blocks)
            query_tile = (torch.arange(lo, hi, device=scaled.device) // TILE)[:, None]  # (n, 1)
            flat = torch.where(real, query_tile * tiles + chosen * block // TILE, tiles * tiles)  # spare: not real
            reached.scatter_(-1, flat.flatten(2), True)
    return words, reached[..., :-1].view(B, Hkv, tiles, tiles)
