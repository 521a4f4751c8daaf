"""Hybrid attention through PyTorch's FlexAttention: the backend for CUDA devices.

The PyTorch backend gathers each query block's candidate keys and merges the parts slab by slab: thousands of small
kernel launches per call on a GPU. Here the exact part is one fused, block-sparse attention call:

- the support (window, global keys, routed key blocks, real keys only) becomes a ``BlockMask``: the
  ``TILE`` x ``TILE`` tiles that hold any of it (``BlockMask.from_kv_blocks``), and inside them a ``mask_mod``
  that keeps exactly the support (the routed blocks as a bitmap of 32-bit words per query block);
- :func:`flex_attend` returns softmax's output over the support and its log-sum-exp, in the model's dtype
  (bfloat16 models: bfloat16, as flash attention);
- bidirectionally, the polynomial far field over all keys is the PyTorch backend's (dense matrix products, one key
  shift per batch and head); its share on the support, which must be left out, is a second call over the same mask
  with the kernel as the score (``score_mod`` = ``log(1 + t + c2 t^2)`` of the centred logit ``t``) and the far
  field's weighted values ``exp(klog - shift) [v, 1]``: that call's output times ``exp(lse)`` is exactly the
  kernel's sums on the support;
- causally, the far field is the lagged scan of :mod:`.hybrid_causal`, which holds no key of the support: nothing is
  left out, and the exact part is a sliding window plus the global keys; a call after a state (its first token not
  the sequence's: a prefill in chunks, the queries after an exact prefix) reads the state's global keys and window
  buffer in front of its own keys (:func:`flex_keys`);
- both parts merge under one shift, as the other backends do (:func:`.merge`).

Gradients flow through both calls' outputs and log-sum-exps (FlexAttention's backward runs on CUDA; on a CPU it
computes forward only, which is how the tests check it against the PyTorch backend, and its backward is checked
through the same contract in plain PyTorch, ``tests/flex_reference.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .device_compile import compile_settings
from .far_field_polynomial import POLYNOMIAL
from .far_field_triton import padded_width
from .hybrid_exact import PartialSums, merge
from .hybrid_far_field import FarQueries, outside_support
from .hybrid_keys import Keys, cat_keys, pad_keys, slice_keys
from .hybrid_selection import Selection

Tensor = torch.Tensor
logger = logging.getLogger(__name__)

TILE = 128  # FlexAttention's sparse block: queries and keys per tile of the block mask
MIN_HEAD_DIM = 16  # the narrowest queries and keys FlexAttention's CUDA kernels take
_TINY = 1e-30  # the log kernel's floor: poly2's kernel (1 + t / 2)^2 reaches 0


def flex_enabled() -> bool:
    """Whether the FlexAttention backend may be used (``PERFORMER_HF_FLEX`` is not ``0``)."""
    return os.environ.get("PERFORMER_HF_FLEX", "1") != "0"


@torch.compiler.assume_constant_result  # a constant where traced (dynamo would trace a cache's wrapped function)
def flex_available() -> bool:
    """Whether this torch has FlexAttention with its log-sum-exp (``AuxRequest``, torch >= 2.9) and Triton to
    compile it for CUDA."""
    try:
        import triton  # noqa: F401
        from torch.nn.attention.flex_attention import AuxRequest  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # compiled once for a shape, then (on a second shape) for dynamic ones: no recompile per length and batch
    return torch.compile(flex_attention)


# tiles for the calls whose default ones need more shared memory than the GPU has; the kinds of call that did,
# remembered: a compilation that fails is not cached, so each such call would otherwise compile and fail again
_SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2}
_NEEDS_SMALL_TILES: set[tuple] = set()


def _at_least_min_head_dim(t: Tensor) -> Tensor:
    """``t`` (.., width) with zero columns up to ``MIN_HEAD_DIM``: they leave every score (scale 1) and every output
    column as they are."""
    return t if t.shape[-1] >= MIN_HEAD_DIM else F.pad(t, (0, MIN_HEAD_DIM - t.shape[-1]))


def flex_attend(q: Tensor, k: Tensor, v: Tensor, block_mask, score_mod=None) -> tuple[Tensor, Tensor]:
    """FlexAttention with scale 1: ``softmax(score_mod(q . k))`` over ``block_mask``'s support applied to v.
    q (B, H, L, d), k (B, Hkv, L, d), v (B, Hkv, L, dv), the query heads a multiple of ``Hkv`` (grouped-query heads
    read in place) -> output (B, H, L, dv) and log-sum-exp (B, H, L), float32. Compiled on CUDA; eager (forward
    only, unfused) elsewhere."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    dv = v.shape[-1]
    q, k, v = (_at_least_min_head_dim(t) for t in (q, k, v))

    def attend(function, kernel_options=None):
        out, aux = function(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=1.0,
            enable_gqa=q.shape[1] != k.shape[1],
            return_aux=AuxRequest(lse=True),
            kernel_options=kernel_options,
        )
        return out[..., :dv], aux.lse

    if q.device.type != "cuda" or torch.compiler.is_compiling():  # eager, or traced in the caller's compiled model
        return attend(flex_attention)
    kind = (q.dtype, q.shape[-1], v.shape[-1], q.shape[1] // k.shape[1], score_mod is None, torch.is_grad_enabled())
    with torch._dynamo.config.patch(compile_settings()):  # the limits exist in every torch with AuxRequest (2.9)
        return compiled_call(kind, attend)


def compiled_call(kind: tuple, attend: Callable):
    """``attend(compiled flex_attention, kernel_options)`` with the default tiles, or with small ones for a ``kind``
    of call whose default tiles needed more shared memory than the GPU has (then remembered)."""
    if kind in _NEEDS_SMALL_TILES:
        return attend(_compiled_flex(), _SMALL_TILES)
    try:
        return attend(_compiled_flex())
    except Exception as error:  # Triton's "out of resource" (shared memory) comes as inductor's own error types
        if "out of resource" not in str(error):
            raise
        _NEEDS_SMALL_TILES.add(kind)
        logger.warning("FlexAttention's default tiles need more shared memory than this GPU has: %s", _SMALL_TILES)
        return attend(_compiled_flex(), _SMALL_TILES)


def flex_keys(selection: Selection) -> tuple[Keys, int]:
    """The keys FlexAttention reads for a call's queries, and the index of the key at its first query's position
    (``shift``). From the first token: the call's own keys, ``shift`` 0. After a state (a causal call that continues):
    the global keys, empty keys, the window buffer (padded in front to the ``left`` keys a window holds) and the call's
    keys, with ``shift`` the tiles before the call's keys, so that every query's window keeps its tile layout."""
    if not selection.continues:
        return selection.keys, 0
    prefix, globals_ = selection.extra
    before = slice_keys(selection.keys, 0, 0) if prefix is None else prefix
    window = pad_keys(before, selection.left - before.y.shape[2], 0)  # (.., left, .)
    front = slice_keys(selection.keys, 0, 0) if globals_ is None else globals_
    shift = -(-(selection.nb_global + selection.left) // TILE) * TILE
    front = pad_keys(front, 0, shift - selection.nb_global - selection.left)
    return cat_keys(cat_keys(front, window), selection.keys), shift


def support_mask(selection: Selection, key_padding: bool = True, layout: tuple[Keys, int] | None = None):
    """The exact support of every query of a call as a ``BlockMask`` over the keys of :func:`flex_keys` (``layout``,
    when already built): the tiles that hold any of it, and a ``mask_mod`` that keeps exactly the support (a query's
    window, the global keys (causally, those up to the query) and its routed key blocks; real keys only: without
    ``key_padding`` every key is, and the mask_mod looks none up)."""
    x, spec = selection.x, selection.spec
    B, H, L = x.shape[:3]
    device = x.device
    left, right, nb_global, causal = selection.left, selection.right, selection.nb_global, selection.causal
    all_keys, shift = layout or flex_keys(selection)
    offset = selection.offset
    block_q, block_k = spec.query_block_size, spec.route_block_size
    padded = -(-L // TILE) * TILE  # TILE is a multiple of block_q and block_k (see choose_backend)
    tiles, key_tiles = padded // TILE, (shift + padded) // TILE
    key_padding = key_padding or selection.continues  # the buffer's and the front's empty keys
    key_mask = F.pad(all_keys.mask, (0, shift + padded - all_keys.mask.shape[1]), value=False)
    key_mask = in_memory(key_mask)  # (B, key tiles * TILE)
    routed_words, routed_tiles, full_routed = _routed(selection, B, H, padded, tiles)

    def mask_mod(b, h, q_idx, kv_idx):
        query = q_idx + shift  # the index of the query's own key
        near = (query - kv_idx <= left) & (kv_idx - query <= right)
        if shift:  # the global keys apart, at their positions: those in the query's window are read there
            gap = q_idx + offset - kv_idx
            is_global = (kv_idx < nb_global) & (gap >= 0) & ((gap > left) | (gap < -right))
        else:
            is_global = (kv_idx < nb_global) & (kv_idx <= q_idx) if causal else kv_idx < nb_global
        supported = near | is_global
        if routed_words is not None:
            block = kv_idx // block_k
            supported = supported | has_bit(routed_words, (b, h, q_idx // block_q), block)
        return supported & key_mask[b, kv_idx] if key_padding else supported  # (FlexAttention bounds kv_idx by L)

    start = torch.arange(tiles, device=device)[:, None] * TILE + shift  # (tiles, 1): each query tile's first key
    k_first = torch.arange(key_tiles, device=device)[None, :] * TILE  # (1, key tiles)
    q_last, k_last = start + TILE - 1, k_first + TILE - 1
    touched = k_first < nb_global  # (query tiles, key tiles)
    # tiles of keys global to every query (after a state the global keys stand apart, each read where outside the
    # query's window: such a tile holds empty keys too)
    full = (k_last < nb_global) & (k_last <= start if causal else True) & (shift == 0)
    if right >= 0:  # the window's band, and the tiles it covers whole
        touched = touched | (k_last >= start - left) & (k_first <= q_last + right)
        full = full | (q_last - k_first <= left) & (k_last - start <= right)
    if routed_tiles is not None:
        touched = touched | routed_tiles  # (B, H, query tiles, key tiles)
        full = full | full_routed
    real_keys = key_mask.view(B, 1, 1, key_tiles, TILE)
    touched = touched & real_keys.any(-1)  # tiles without a real key hold nothing
    full = full & real_keys.all(-1)  # mask_mod runs only on the other tiles: the per-score lookups cost most
    shape = (B, H, tiles, key_tiles)
    return tile_mask(touched.expand(shape), mask_mod, (L, shift + L), full.expand(shape))


# wider than the reductions inductor unrolls into pointwise code (its config's unroll_reductions_threshold, 8)
_REDUCED_WIDTH = 16


def in_memory(tensor: Tensor) -> Tensor:
    """``tensor`` (.., S) unchanged, as a reduction's output, which inductor writes to memory where it computes it: for
    the tensors a ``mask_mod`` reads. FlexAttention's Triton lowering builds the ``mask_mod`` over its captured tensors
    before it writes them out (torch 2.11 to 2.13; kept for 2.14, not yet run on a GPU): a tensor that a concatenation
    or a padding computes in the same graph is inlined with its masked loads, which the template cannot render
    (``'function' object has no attribute 'graph'``: on an H200, a decoder's hybrid after an exact prefix, whose keys
    follow the state's)."""
    return tensor[..., None].expand(*tensor.shape, _REDUCED_WIDTH).amax(-1)  # (.., S)


def tile_mask(touched: Tensor, mask_mod, lengths: tuple[int, int], full: Tensor | None = None):
    """The ``BlockMask`` that reads, for each batch, head and query tile, the key tiles ``touched`` marks ((B, H,
    query tiles, key tiles) bool), over ``lengths`` (queries, keys): with ``mask_mod`` inside them, except in the tiles
    ``full`` marks (same shape; a subset of ``touched``), where ``mask_mod`` would keep every pair: read whole."""
    from torch.nn.attention.flex_attention import BlockMask

    def blocks(marked: Tensor) -> tuple[Tensor, Tensor]:
        counts = marked.sum(-1, dtype=torch.int32)  # (B, H, query tiles)
        order = torch.argsort(marked.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts, order

    partial, whole = (touched, ()) if full is None else (touched & ~full, blocks(full))
    return BlockMask.from_kv_blocks(*blocks(partial), *whole, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=lengths)


def _routed(selection: Selection, B: int, H: int, padded: int, tiles: int) -> tuple[Tensor | None, ...]:
    """The routed key blocks of every query block as bits (B, H, query blocks, words of 32 key blocks), int32, the
    tiles they touch and the tiles they fill (every query of the tile routed to every key block of it), each (B, H,
    query tiles, key tiles) bool; (None, None, None) without routing."""
    spec = selection.spec
    if not spec.routed_blocks:
        return None, None, None
    block_q, block_k = spec.query_block_size, spec.route_block_size
    chosen, real = selection.routes  # (B, H, N, t): N query blocks (the selection's, padded to its period)
    chosen = F.pad(chosen, (0, 0, 0, padded // block_q - chosen.shape[2]))
    real = F.pad(real, (0, 0, 0, padded // block_q - real.shape[2]), value=False)
    words = block_bits(chosen, real, -(-padded // block_k))
    per_tile = torch.zeros(B, H, chosen.shape[2], tiles + 1, dtype=torch.int32, device=chosen.device)
    key_tile = torch.where(real, chosen * block_k // TILE, tiles)  # a choice that is not real: the spare column
    per_tile = per_tile.scatter_add_(-1, key_tile, torch.ones_like(key_tile, dtype=torch.int32))[..., :tiles]
    per_tile = per_tile.view(B, H, tiles, TILE // block_q, tiles)  # blocks routed per (query block, key tile)
    # the chosen blocks of a query block are distinct: TILE // block_k of them in one key tile fill it
    return words, (per_tile > 0).any(3), (per_tile == TILE // block_k).all(3)


def block_bits(chosen: Tensor, real: Tensor, nb_blocks: int) -> Tensor:
    """Chosen blocks (..., t) of ``nb_blocks``, where ``real``, as bits: (..., words of 32 blocks) int32 (the last bit
    of a word is its sign bit). The chosen blocks of a row are distinct, so the sum of their bits is their union."""
    words = chosen.new_zeros(*chosen.shape[:-1], -(-nb_blocks // 32))
    bits = torch.where(real, torch.ones_like(chosen) << (chosen % 32), 0)
    return words.scatter_add_(-1, chosen // 32, bits).to(torch.int32)  # int64 sums; bit 31 wraps to the sign bit


def has_bit(words: Tensor, rows: tuple, block):
    """Whether ``block``'s bit is set in the row ``rows`` (indices of every dimension but the last) of
    :func:`block_bits`' words: one indexing, as a ``mask_mod`` reads it."""
    return ((words[(*rows, block // 32)] >> (block % 32)) & 1) == 1


def _padded_values(values: Tensor) -> Tensor:
    """Values (B, H, L, X) padded with zero columns to a width the CUDA kernels take: a power of two, at least 16."""
    if values.device.type != "cuda":
        return values
    return F.pad(values, (0, padded_width(values.shape[-1]) - values.shape[-1]))


class FlexBackend:
    """Hybrid attention's support sums in FlexAttention: the exact part and (bidirectionally, with a polynomial far
    field) the far field's share on the support, in calls over one block mask (see the module docstring).

    Args:
        centres: the call's query and key centres ``(a, c)``, each (.., 1, d).
        dtype: the dtype the attention calls run in (the model's: the rest computes in float32).
        attend: the attention call: :func:`flex_attend`, or in tests its contract in plain PyTorch.
        key_padding: whether the call has a key padding mask (without one, the block mask looks no key up).
    """

    polynomial = POLYNOMIAL  # the far field over all keys: dense matrix products

    def __init__(
        self,
        centres: tuple[Tensor, Tensor],
        dtype: torch.dtype,
        attend: Callable = flex_attend,
        key_padding: bool = True,
    ):
        self.centres, self.dtype, self.attend, self.key_padding = centres, dtype, attend, key_padding

    def support_sums(self, selection: Selection, far: FarQueries, quadratic: float | None) -> Tensor:
        """Numerator|denominator (B, H, L, dv + 1) of hybrid attention, relative to a per-query shift."""
        dtype, layout = self.dtype, flex_keys(selection)
        mask = support_mask(selection, self.key_padding, layout)
        keys = layout[0]
        dv = keys.values1.shape[-1] - 1
        exact, lse = self.attend(
            selection.x.to(dtype), keys.y.to(dtype), _padded_values(keys.values1[..., :dv].to(dtype)), mask
        )
        exact = PartialSums(_ones_column(exact[..., :dv], lse), lse.detach()[..., None])
        if far.excludes_support:
            return merge(exact, far.complement([], [], quadratic))
        return merge(exact, self._complement(selection, far, quadratic, mask))

    def _complement(self, selection: Selection, far: FarQueries, quadratic: float, mask) -> PartialSums:
        """The polynomial far field over the keys outside each query's support: its sums over all keys minus a
        FlexAttention call with the kernel as the score over the support."""
        keys, dtype = selection.keys, self.dtype
        dv = keys.values1.shape[-1] - 1
        a, c = self.centres
        shift = far.key_shift[:, :, :1, :]  # (B, H, 1, 1): the far field's one key shift
        weighted = keys.values1 * torch.exp(keys.klog - shift)  # (B, H, L, dv + 1); padded keys -> 0

        # a captured tensor, not a float: torch 2.15 traces a float as a symbol, which FlexAttention refuses
        c2 = torch.tensor(quadratic, dtype=torch.float32, device=keys.y.device)

        def log_kernel(score, b, h, q_idx, kv_idx):
            return torch.log(torch.clamp(1 + score + c2 * score * score, min=_TINY))

        on_support, support_lse = self.attend(
            (selection.x - a).to(dtype), (keys.y - c).to(dtype), _padded_values(weighted.to(dtype)), mask, log_kernel
        )
        on_support = on_support[..., : dv + 1].float() * torch.exp(support_lse)[..., None]
        on_support = on_support.nan_to_num(0.0)  # a query without support: nothing to leave out
        return outside_support(far.far_sum, on_support, far.rounding, far.scale + far.key_shift)


def _ones_column(out: Tensor, lse: Tensor) -> Tensor:
    """Softmax's output over the support (B, H, L, dv) and its log-sum-exp (B, H, L) -> its sums [out, 1]
    relative to exp(lse) (gradients flow through lse), float32; zero for a query without support."""
    out = out.float().nan_to_num(0.0)
    scale = torch.exp(lse - lse.detach()).nan_to_num(0.0)[..., None]  # 1, differentiable in lse
    return torch.cat([out, torch.ones_like(out[..., :1])], dim=-1) * scale
