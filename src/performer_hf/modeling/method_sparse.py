"""Sparse attention as an attention method (``attention_method="sparse"``, causal only): exact softmax over each
query's window, the global tokens and the key blocks it selects (:func:`.sparse_attention`), its decoding state in a
:class:`.SparseCacheLayer` (per key/value head; bounded with ``select_budget``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .sparse_attention import sparse_attention
from .sparse_spec import SparseSpec


def sparse_layer_settings(config, layer_idx: int) -> dict[str, Any]:
    """What a layer's method state holds for sparse attention: the :class:`.SparseSpec` derived from the config."""
    return {"sparse_spec": SparseSpec.from_config(config)}


def sparse_method(module: nn.Module, q, k, v, key_mask, causal, layer_cache=None, output_attentions=False):
    """Sparse attention with the module's :class:`.SparseSpec`. q is (B, H, L, D); k and v (B, Hkv, L, D) hold the new
    tokens, or (B, Hkv, P + L, D) when a plain key/value cache passed every key so far. With ``layer_cache`` (a
    :class:`.SparseCacheLayer`), its state is read and updated."""
    spec = module.sparse_spec
    if not causal:
        raise ValueError(
            "attention_method='sparse' is causal only (its selection reads the past); encoders take "
            "attention_method='hybrid', whose routed blocks select by content in both directions."
        )
    length, total = q.shape[2], k.shape[2]
    if layer_cache is not None:
        new_mask = None if key_mask is None else key_mask[:, -length:]
        context, state = sparse_attention(q, k, v, spec, new_mask, layer_cache.get_state(), return_state=True)
        layer_cache.update_state(state)
        return context, None
    if spec.covers(total):  # every query reads every earlier key: SDPA's exact causal attention
        return _exact(q, k, v, key_mask), None
    if total > length:  # a plain key/value cache: its keys read in place
        return _over_cached_keys(spec, q, k, v, key_mask), None
    return sparse_attention(q, k, v, spec, key_mask), None


def _exact(q, k, v, key_mask):
    """Causal softmax attention of q (B, H, L, D) over the last keys k, v (B, Hkv, P + L, D), grouped-query keys
    read in place (SDPA's ``enable_gqa``)."""
    length, total = q.shape[2], k.shape[2]
    if key_mask is None and length == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    visible = torch.ones(length, total, dtype=torch.bool, device=q.device).tril(diagonal=total - length)
    if key_mask is not None:  # a query always sees itself: no empty rows (left padding)
        own = torch.arange(total, device=q.device) == torch.arange(total - length, total, device=q.device)[:, None]
        visible = (visible & key_mask[:, None, None, :]) | own
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)


def _over_cached_keys(spec: SparseSpec, q, k, v, key_mask):
    """The new queries over a key/value cache's keys (B, Hkv, P + L, D), read in place (every block kept). A bounded
    pool ranks blocks by the attention the past queries gave them, which a key/value cache has lost: refused, with
    the fix."""
    if spec.bounded:
        raise ValueError(
            f"select_budget={spec.budget}, select_blocks={spec.select_blocks} (bounded decoding) needs the sparse "
            "method's own cache; this call got a plain key/value cache. Pass cache=PerformerCache(model.config) to "
            "generate (performer_hf.integrations), or set select_budget=0 and select_blocks > 0."
        )
    return sparse_attention(q, k, v, spec, key_mask)


def sparse_card_lines(config) -> list[str]:
    """The sparse-attention settings as card bullet points."""
    kept = (
        f"the {config.select_budget} blocks that received the most attention in the window (bounded decoding memory)"
        if config.select_budget
        else "every block (decoding memory grows with the context; reads do not)"
    )
    return [
        f"- exact local window: the query's block and {config.local_window} tokens before it",
        f"- global tokens (exact for every query): {config.num_global_tokens}",
        f"- selected exact key blocks: {config.select_blocks} of {config.select_block_size} keys per query, by an "
        "upper bound of its logits (per-channel key minimum and maximum)",
        f"- key blocks kept once they leave the window: {kept}",
    ]
