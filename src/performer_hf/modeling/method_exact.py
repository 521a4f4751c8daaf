"""Exact softmax attention as an attention method (``attention_method="exact"``), and the exact dispatch the
approximate methods share (:func:`exact_or_approximate`): below the crossover length, and where the hybrid's support
covers every key, they compute softmax attention with SDPA instead; in a padded batch, per row, by its real length."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


def exact_attention(module: nn.Module, q, k, v, key_mask, causal, layer_cache=None, output_attentions=False):
    """Softmax attention with SDPA (its fused causal path when nothing is masked); with ``layer_cache``, a
    key/value cache layer: k, v become (B, H, P + L, D), the P cached keys first."""
    if layer_cache is not None:
        k, v = layer_cache.update(k, v)  # (B, H, P + L, D)
    dropout = module.dropout_prob if module.training else 0.0
    return softmax_attention(q, k, v, key_mask, causal, dropout, output_attentions)


def softmax_attention(q, k, v, key_mask, causal, dropout=0.0, output_attentions=False, window=None):
    """Softmax attention of q (B, H, Lq, D) over k, v (B, H, Lk, D), the last Lq keys being the queries'
    own: SDPA's fused kernels, its causal path when nothing is masked. -> (context, weights or None).
    Without ``output_attentions``, k and v may have fewer heads (grouped-query attention, read in place).
    ``window`` (causal): each query sees only the last ``window`` keys up to itself (a sliding-window model's,
    such as Mistral's ``sliding_window``); None: every earlier key."""
    q_len, k_len = q.shape[2], k.shape[2]
    grouped = q.shape[1] != k.shape[1]
    windowed = causal and window is not None and k_len > window  # some key is out of some query's window
    if causal and key_mask is None and q_len in (1, k_len) and not output_attentions and not windowed:
        # SDPA's fused causal path: no (L, L) mask in memory (one query, the last, sees every key: no mask at all;
        # a branch, not is_causal=q_len > 1, which traced with a dynamic length is no bool)
        if q_len == 1:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, enable_gqa=grouped), None
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=grouped), None
    visible = None
    if key_mask is not None:
        visible = key_mask[:, None, None, :]  # (B, 1, 1, Lk)
    if causal:
        past = k_len - q_len  # query i sits at position past + i and sees keys j <= past + i
        tril = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(diagonal=past)  # (Lq, Lk)
        if windowed:  # key j is in the window of query i (at past + i) while j > past + i - window
            tril = tril.triu(diagonal=past - window + 1)
        visible = tril if visible is None else visible & tril
        own = torch.arange(k_len, device=q.device) == torch.arange(past, k_len, device=q.device)[:, None]
        visible = visible | own  # a query always sees itself: no empty rows (left padding)
    if not output_attentions:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout, enable_gqa=grouped), None
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, Lq, Lk)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    weights = scores.float().softmax(dim=-1)
    if visible is not None:  # a query that sees no key (a row of padding only): no weights, as SDPA gives it 0
        weights = weights.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)
    weights = weights.to(q.dtype)
    return F.dropout(weights, p=dropout, training=dropout > 0) @ v, weights


def exact_max_length(module: nn.Module, device: torch.device) -> int:
    """The longest bidirectional input that keeps exact attention on ``device``: the module's
    ``accelerator_exact_max_length`` on accelerators where it has one, else its ``exact_max_length``."""
    accelerator = getattr(module, "accelerator_exact_max_length", None)
    return accelerator if device.type != "cpu" and accelerator is not None else module.exact_max_length


def exact_is_enough(module: nn.Module, q: torch.Tensor, causal: bool, layer_cache) -> bool:
    """Whether a FAVOR+ or hybrid call of queries q (B, H, L, d) computes exact softmax attention instead (SDPA, no
    attention dropout, as for the approximations): bidirectional inputs of at most :func:`exact_max_length` tokens
    on q's device (below the crossover, where exact attention is also the faster), or inputs the hybrid's exact
    support covers entirely (its output is then exact attention). Cached decoding keeps the method's own state."""
    if layer_cache is not None:
        return False
    length = q.shape[2]
    if not causal and length <= exact_max_length(module, q.device):
        return True
    spec = getattr(module, "hybrid_spec", None)
    return spec is not None and spec.covers(length, causal)


# per padding mask: its rows' real lengths and the span of their real tokens (:func:`read_per_mask`)
_ROW_SPANS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def exact_or_approximate(
    approximate: Callable[..., torch.Tensor], module: nn.Module, q, k, v, key_mask, causal, layer_cache=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output of an approximate method's call (``approximate(q, k, v, key_mask)`` -> (B, H, L, D)), or exact
    softmax attention where :func:`exact_is_enough`. In a padded bidirectional batch longer than the crossover, the
    rows whose real tokens are few enough take exact attention as they would alone, the others the method: a row's
    output does not depend on the rows it is batched with (a pipeline's or a sentence encoder's batches pad every
    row to the longest). -> (context, None)."""
    if exact_is_enough(module, q, causal, layer_cache):
        return softmax_attention(q, k, v, key_mask, causal)
    if causal or layer_cache is not None or key_mask is None or torch.compiler.is_compiling():
        return approximate(q, k, v, key_mask), None
    lengths, firsts, lasts = row_spans(key_mask)
    limit = exact_max_length(module, q.device)
    short = [row for row, length in enumerate(lengths) if length <= limit]
    if not short:
        return approximate(q, k, v, key_mask), None
    long = [row for row, length in enumerate(lengths) if length > limit]
    # the short rows' keys outside the span of their real tokens are padding: left out, as the mask would leave them
    lo, hi = min(firsts[row] for row in short), max(lasts[row] for row in short) + 1
    if lo >= hi:  # no real token in any short row: every key is padding
        lo, hi = 0, k.shape[2]
    if not long:
        return softmax_attention(q, k[:, :, lo:hi], v[:, :, lo:hi], key_mask[:, lo:hi], causal=False)
    rows = torch.tensor(short, device=q.device)
    exact, _ = softmax_attention(q[rows], k[rows, :, lo:hi], v[rows, :, lo:hi], key_mask[rows, lo:hi], causal=False)
    context = exact.new_empty(*q.shape[:3], v.shape[-1])  # (B, H, L, D)
    context[rows] = exact
    others = torch.tensor(long, device=q.device)
    context[others] = approximate(q[others], k[others], v[others], key_mask[others]).to(exact.dtype)
    return context, None


def read_per_mask(store: WeakIdKeyDictionary, key_mask: torch.Tensor, read: Callable[[torch.Tensor], Any]) -> Any:
    """``read(key_mask)``, kept in ``store`` for that mask tensor and its version (a mask edited in place is read
    again; an inference tensor, which has no version counter, each time): the model passes one mask to every layer,
    so a forward reads it once, not once per layer (on a GPU each read waits for the device)."""
    current = None if key_mask.is_inference() else key_mask._version
    version, value = store.get(key_mask, (None, None))
    if current is None or version != current:
        value = read(key_mask)
        store[key_mask] = (current, value)
    return value


def row_spans(key_mask: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """The real tokens of each row of ``key_mask`` (B, L): their count, the first's and the last's index (-1 where
    the row has none), read once per mask and version."""
    return read_per_mask(_ROW_SPANS, key_mask, _read_row_spans)


def _read_row_spans(key_mask: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    length = key_mask.shape[1]
    real = key_mask.bool()
    counts = real.sum(dim=1)  # (B,)
    firsts = torch.where(counts > 0, real.int().argmax(dim=1), length)  # (B,)
    lasts = torch.where(counts > 0, length - 1 - real.flip(1).int().argmax(dim=1), -1)  # (B,)
    return tuple(torch.stack([counts, firsts, lasts]).tolist())
