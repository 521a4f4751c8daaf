"""Sparse attention as an attention method (``attention_method="sparse"``, causal only): exact softmax over each
query's window, the global tokens and the key blocks it selects (:func:`.sparse_attention`), its decoding state in a
:class:`.SparseCacheLayer` (per key/value head; bounded with ``select_budget``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .method_exact import softmax_attention
from .sink_order import warn_of_short_padded_rows
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
        state = layer_cache.get_state()  # the cache layer keeps only the next state: it may grow in place
        if state is None:  # a state from this call's tokens alone: its global tokens are fixed after them
            warn_of_short_padded_rows(new_mask, spec.num_global_tokens, "sparse")
        context, state = sparse_attention(q, k, v, spec, new_mask, state, return_state=True, grow_in_place=True)
        layer_cache.update_state(state)
        return context, None
    if spec.covers(total):  # every query reads every earlier key: SDPA's exact causal attention
        return softmax_attention(q, k, v, key_mask, True)
    if total > length and spec.bounded:  # a plain key/value cache: it has lost what a bounded pool ranks by
        raise ValueError(
            f"select_budget={spec.budget}, select_blocks={spec.select_blocks} (bounded decoding) needs the sparse "
            "method's own cache; this call got a plain key/value cache that already holds the earlier keys: one "
            "filled with gradients enabled or by another model, a quantized cache, or assisted / prompt-lookup "
            "decoding's (which keeps keys to roll back draft tokens; the method's state cannot give tokens back). "
            "Fill the cache under torch.no_grad() and continue with the one that call returned (plain generate() "
            "does), pass cache=PerformerCache(model.config) (performer_hf), or set select_budget=0 and "
            "select_blocks > 0."
        )
    return sparse_attention(q, k, v, spec, key_mask), None  # a key/value cache's keys are read in place


def sparse_card_lines(config) -> list[str]:
    """The sparse-attention settings as card bullet points."""
    rankings = {
        "window": "that received the most attention in the window",
        "latest": "that the last queries of each call (the end of the prompt) attend to most",
    }
    if not config.select_blocks:
        kept = "none (no selection: the window and the global tokens only)"
    elif config.select_budget:
        kept = f"the {config.select_budget} blocks {rankings[config.select_ranking]} (bounded decoding memory)"
    else:
        kept = "every block (decoding memory grows with the context; reads do not)"
    return [
        f"- exact local window: the query's block and {config.local_window} tokens before it",
        f"- global tokens (exact for every query): {config.num_global_tokens}",
        f"- selected exact key blocks: {config.select_blocks} of {config.select_block_size} keys per query, the ones "
        "that hold the most of its attention (the log-sum-exp of its logits over each block's keys)",
        f"- key blocks kept once they leave the window: {kept}",
    ]
