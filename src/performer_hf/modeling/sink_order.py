"""Global tokens of left-padded rows: the first real keys, not the first positions.

The hybrid and sparse methods read their first ``num_global_tokens`` keys exactly for every query (attention
sinks) and choose them by position. A left-padded row (what batched ``generate()`` builds) starts with pads, so it
lost its sinks: SmolLM2 with the in-place hybrid (window 64, one global token), a 150-token row after 150 pads,
scored its tokens at loss 4.691 where the row alone scores 4.110 (logits 29.3 apart). Causal attention depends on
the order of the keys only through what comes before each query, so a row's first real keys can move in front of
its pads: :func:`sinks_first` calls a method with each row's keys in that order, which gives the method the row's
own global tokens, and its queries' outputs in their places. The rest keeps its positions (window and blocks go
by position, as they do on each row alone, a whole number of pads apart). Bidirectional calls move every real key
in front of the pads, and their queries with them (the hybrid's global tokens are its global queries too): the row is
laid out as alone, so its window, routed blocks and routing groups are its own whatever the padding.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .compiled_lengths import traced
from .method_exact import read_per_mask, row_spans

Tensor = torch.Tensor

logger = logging.getLogger(__name__)

# a ``count`` that moves every real key of a left-padded row in front of its pads: a bidirectional call's row is then
# laid out as alone (right-padded), whole blocks and routing groups included
EVERY_REAL_KEY = 2**62

# per padding mask: {count: the order or None} (:func:`.read_per_mask`: one host read per forward, not per layer)
_ORDERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def sinks_first(attend: Callable, count: int, key_mask: Tensor | None, query_length: int, key_length: int) -> Callable:
    """``attend(q, k, v, key_mask, *args)`` (-> (context, ...)) over keys whose left-padded rows have their first
    ``count`` real keys moved in front of the pads, where the ``key_length`` keys given are those the ``key_mask``
    (B, Lk) covers, from the first, and the moved keys lie before the call's ``query_length`` queries (a decoding
    step moves its row's cached real keys, fewer than ``count``, and keeps its own last), or the queries move with
    them (they are the keys' own tokens); ``attend`` itself otherwise. Traced (``torch.compile``), every call takes
    the order whatever the padding (the identity for a row that starts with a real token: no host read). A call of
    several queries after cached keys is refused where some of a padded row's first ``count`` real keys come in it
    (its global tokens, cached before, were pads): :func:`check_sinks_in_place`."""
    if not count or key_mask is None:
        return attend
    length = key_mask.shape[1]
    whole = query_length == length  # the queries are the keys' tokens: they move alike
    if not whole:
        check_sinks_in_place(key_mask, count, length - query_length)
    # the call's own keys stay in place after cached ones (a decoding step's query sees itself last); after the
    # check, a call of several queries has each padded row's first real keys cached
    order = sink_order(key_mask, count, in_place=0 if whole else query_length) if key_length == length else None
    if order is None:
        return attend

    def attend_in_order(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *args, **kwargs):
        k, v, mask = in_sink_order(order, k, v, mask)
        if whole:
            (q,) = in_sink_order(order, q)
        context, *rest = attend(q, k, v, mask, *args, **kwargs)
        if whole:  # each query's output back in its place
            back = order.argsort(dim=1)[:, None, :, None]
            context = context.gather(2, back.expand_as(context))
        return (context, *rest)

    return attend_in_order


def sink_order(key_mask: Tensor | None, count: int, in_place: int = 0) -> Tensor | None:
    """(B, Lk) int64: the order of the keys that ``key_mask`` (B, Lk) covers, from the first, which puts each
    left-padded row's first ``count`` real keys in front of its pads, leaving the last ``in_place`` keys where they
    are; None where no row starts with a pad (or none is needed). Traced, the order whatever the padding (no host
    read)."""
    if not count or key_mask is None:
        return None
    if torch.compiler.is_compiling():
        return _order_of(key_mask.bool(), count, in_place)
    return _order(key_mask, count, in_place)


def in_sink_order(order: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Each tensor, (B, H, Lk, D) or a mask (B, Lk), with its keys in ``order`` (B, Lk) (:func:`sink_order`)."""
    return tuple(
        t.gather(1, order) if t.dim() == 2 else t.gather(2, order[:, None, :, None].expand_as(t)) for t in tensors
    )


def check_sinks_in_place(key_mask: Tensor, count: int, fixed: int) -> None:
    """Refuse a call of several queries whose global tokens were fixed by the first ``fixed`` keys (those cached
    before it, or a causal hybrid's exact prefix), where a row of ``key_mask`` (B, Lk: the fixed keys and the call's)
    that starts with padding has some of its first ``count`` real keys after them: its global tokens would be pads,
    and the cache cannot take them back. Traced (``torch.compile``), the refusal is an assertion in the graph
    (``torch._assert_async``: no host read, no graph break), raised with the same advice on a CPU; on CUDA a device
    assertion (inductor keeps them by default, on NVIDIA GPUs; untested here: no GPU), which ends the
    process's CUDA context.

    A call of one query is a decoding step (a row shorter than its global tokens reads its later ones in the window),
    and passes unread (no host read per step), but for the one after a state built by one key: a prefill in one-token
    chunks (``prefill_chunk_size=1``), whose rows that start with a pad fixed it as their global token, whatever real
    tokens come later (the mask of a chunk covers no later ones)."""
    if key_mask.shape[1] - fixed < 2:
        if fixed == 1:
            _check_first_key_real(key_mask, count)
        return
    if torch.compiler.is_compiling():
        # (the message names no length: formatting a dynamic one would pin the graph to it)
        message = _refusal("A row", "padding tokens", "positions", count)
        torch._assert_async(~_loses_sinks(key_mask, count, fixed).any(), message)
        return
    counts, firsts, _ = row_spans(key_mask)
    for row, (real, first) in enumerate(zip(counts, firsts, strict=True)):
        if real and 0 < first and first + min(count, real) > fixed:
            raise ValueError(_refusal(f"Row {row}", f"{first} padding tokens", f"{fixed} positions", count))


def _check_first_key_real(key_mask: Tensor, count: int) -> None:
    """Refuse the second call of a sequence (one query after one cached key) where a row of ``key_mask`` (B, 2)
    starts with a pad: the state built by the first call fixed that pad as the row's global token (as an assertion
    in the graph where traced: :func:`check_sinks_in_place`)."""
    if torch.compiler.is_compiling():
        torch._assert_async(key_mask[:, 0].bool().all(), _refusal("A row", "a padding token", "position", count))
        return
    _, firsts, _ = row_spans(key_mask)  # (2 for a row of pads only)
    padded = [row for row, first in enumerate(firsts) if first > 0]
    if padded:
        raise ValueError(_refusal(f"Row {padded[0]}", "a padding token", "position", count))


def warn_of_short_padded_rows(key_mask: Tensor | None, count: int, method: str) -> None:
    """Warn (once per method and count) where a decoding state is built from a call whose ``key_mask`` (B, L) has a
    padded row of fewer than ``count`` real tokens. Alone, such a row's next tokens become its global tokens; the
    state's global tokens are fixed after the call (by position), so once those tokens leave the window the row
    decodes otherwise than alone and than a full forward over it (the key/value path, with gradients, moves them:
    :func:`sinks_first`). Not while traced (no host read), nor for a call of one token: its padded rows are refused
    at the next call (a prefill in one-token chunks: :func:`check_sinks_in_place`), not short prompts."""
    if not count or key_mask is None or key_mask.shape[1] < 2 or traced():
        return
    counts, _, _ = row_spans(key_mask)
    if any(real < count and real < key_mask.shape[1] for real in counts):
        _warn_short_rows(method, count)


@functools.cache
def _warn_short_rows(method: str, count: int) -> None:
    logger.warning(
        "A padded row of this batch has fewer real tokens than the %s method's num_global_tokens=%d: alone, its next "
        "tokens would become its global tokens (read exactly by every later token), but the decoding state fixes them "
        "after the prompt, so its generation differs from the prompt's alone once they leave the window. Batch such "
        "short prompts apart, or give them at least %d tokens.",
        method,
        count,
        count,
    )


def _loses_sinks(key_mask: Tensor, count: int, fixed: int) -> Tensor:
    """(B,) bool: the rows of ``key_mask`` (B, Lk) that start with padding and have some of their first ``count`` real
    keys after the first ``fixed`` (:func:`check_sinks_in_place`'s rule, on the device)."""
    real = key_mask.bool()
    counts = real.sum(dim=1)  # (B,)
    firsts = real.int().argmax(dim=1)  # (B,): 0 for a row of pads only, which has no global tokens to lose
    return (firsts > 0) & (firsts + counts.clamp(max=count) > fixed)


def _refusal(row: str, padding: str, fixed: str, count: int) -> str:
    return (
        f"{row} of the batch starts with {padding}, and its global tokens (the attention sinks of the hybrid and "
        f"sparse methods, read exactly for every query) were fixed by its first {fixed} (cached before this "
        f"call, or a causal hybrid's exact prefix): some of its first {count} real tokens come after them, so its "
        "global tokens would be padding. A left-padded batch prefilled in chunks does this (generate() with "
        "prefill_chunk_size): prefill it in one call (prefill_chunk_size=None), or in chunks longer than the longest "
        f"padding plus {count}."
    )


def _order(key_mask: Tensor, count: int, in_place: int) -> Tensor | None:
    """:func:`_order_of` the mask, None when no row starts with a pad; read once per mask, version, count and
    ``in_place``."""
    orders = read_per_mask(_ORDERS, key_mask, lambda mask: {})  # (count, in_place) -> order, for this mask version
    if (count, in_place) not in orders:
        real = key_mask.bool()
        orders[count, in_place] = None if bool(real[:, 0].all()) else _order_of(real, count, in_place)
    return orders[count, in_place]


def _order_of(real: Tensor, count: int, in_place: int = 0) -> Tensor:
    """(B, Lk) int64: each row of ``real`` (B, Lk) bool in the order that puts its first ``count`` real keys (or
    fewer: those before its last ``in_place`` keys) in front, then its pads and the rest."""
    length = real.shape[1]
    ordered = real[:, : length - in_place]  # (B, Lk - in_place): the keys that may move
    pads = ordered.int().argmax(dim=1)[:, None]  # (B, 1): the first real key's position (0 for none)
    moved = ordered.sum(dim=1, keepdim=True).clamp(max=count)  # (B, 1)
    i = torch.arange(length, device=real.device)[None]  # (1, Lk)
    return torch.where(i < moved, pads + i, torch.where(i < pads + moved, i - moved, i))
