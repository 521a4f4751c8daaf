"""Sparse attention as an attention method (``attention_method="sparse"``, causal only): exact softmax over each
query's window, the global tokens and the key blocks it selects (:func:`.sparse_attention`), its decoding state in a
:class:`.SparseCacheLayer` (per key/value head; bounded with ``select_budget``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .method_exact import softmax_attention
from .sparse_attention import sparse_attention
from .sparse_spec import SparseSpec, SparseState


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
    if total > length:  # a plain key/value cache: the past keys as a state, then the new tokens
        return _over_cached_keys(spec, q, k, v, key_mask), None
    if spec.covers(length):  # every query reads every earlier key: SDPA's exact causal attention
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return softmax_attention(q, k, v, key_mask, True)
    return sparse_attention(q, k, v, spec, key_mask), None


def _over_cached_keys(spec: SparseSpec, q, k, v, key_mask):
    """The new queries over a key/value cache's keys (B, Hkv, P + L, D): the past keys form the state (every block
    kept). A bounded pool ranks blocks by the attention the past queries gave them, which a key/value cache has lost:
    refused, with the fix."""
    if spec.budget:
        raise ValueError(
            f"select_budget={spec.budget} (bounded decoding) needs the sparse method's own cache; this call got a "
            "plain key/value cache. Pass cache=PerformerCache(model.config) to generate "
            "(performer_hf.integrations), or set select_budget=0."
        )
    length, total = q.shape[2], k.shape[2]
    past = total - length
    past_mask = None if key_mask is None else key_mask[:, :past]
    new_mask = None if key_mask is None else key_mask[:, past:]
    state = _with_past(SparseState.empty(k, v, spec.block_size), spec, k[:, :, :past], v[:, :, :past], past_mask)
    return sparse_attention(q, k[:, :, past:], v[:, :, past:], spec, new_mask, state)


def _with_past(state: SparseState, spec: SparseSpec, k, v, key_mask) -> SparseState:
    """The keep-every-block state after ``P`` past tokens whose outputs are not needed: their keys and values stored
    as the window would hold them, the global tokens kept; the next call moves the rest to the pool."""
    B, _, P, _ = k.shape
    mask = torch.ones(B, P, dtype=torch.bool, device=k.device) if key_mask is None else key_mask
    g = min(spec.num_global_tokens, P)
    blocks = -(-P // spec.block_size)
    return state._replace(
        keys=k,
        values=v,
        key_mask=mask,
        mass=state.mass.new_zeros(B, k.shape[1], blocks),
        global_keys=k[:, :, :g],
        global_values=v[:, :, :g],
        global_mask=mask[:, :g],
        length=P,
    )


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
