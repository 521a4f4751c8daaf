"""The attention methods of the Performer family: one function each, one signature, one registry.

Each method is a function in the style of the attention functions of transformers'
``AttentionInterface``: it receives the calling attention module and reads what it needs from it
(the random projection, the centres, the method's settings)::

    attend(module, q, k, v, key_mask, causal, layer_cache=None, output_attentions=False) -> (context, weights)

- ``q``, ``k``, ``v``: (B, H, L, D), the L new tokens;
- ``key_mask``: (B, P + L) bool, True for real tokens, covering the P cached tokens too; or None;
- ``causal``: mask future keys;
- ``layer_cache``: the module's layer of a transformers ``Cache``, read and updated in place (causal
  decoding), or None;
- returns the context (B, H, L, D) and the attention weights (B, H, L, P + L), or None where the
  method never forms them.

:data:`ATTENTION_METHODS` maps each method's name (``PerformerConfig.attention_method``) to an
:class:`AttentionMethod`: the function and the facts other code needs about it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cache_performer import FavorCacheLayer, HybridCacheLayer
from .favor_attention import favor_attention
from .favor_hybrid import hybrid_attention

Tensor = torch.Tensor


def exact_attention(module: nn.Module, q, k, v, key_mask, causal, layer_cache=None, output_attentions=False):
    """Softmax attention with SDPA (its fused causal path when nothing is masked); with ``layer_cache``, a
    key/value cache layer: k, v become (B, H, P + L, D), the P cached keys first."""
    if layer_cache is not None:
        k, v = layer_cache.update(k, v)  # (B, H, P + L, D)
    dropout = module.dropout_prob if module.training else 0.0
    return softmax_attention(q, k, v, key_mask, causal, dropout, output_attentions)


def softmax_attention(q, k, v, key_mask, causal, dropout=0.0, output_attentions=False):
    """Softmax attention of q (B, H, Lq, D) over k, v (B, H, Lk, D), the last Lq keys being the queries'
    own: SDPA's fused kernels, its causal path when nothing is masked. -> (context, weights or None)."""
    q_len, k_len = q.shape[2], k.shape[2]
    if causal and key_mask is None and q_len == k_len and not output_attentions:
        # SDPA's fused causal path: no (L, L) mask in memory
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True), None
    visible = None
    if key_mask is not None:
        visible = key_mask[:, None, None, :]  # (B, 1, 1, Lk)
    if causal:
        past = k_len - q_len  # query i sits at position past + i and sees keys j <= past + i
        tril = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(diagonal=past)  # (Lq, Lk)
        visible = tril if visible is None else visible & tril
        own = torch.arange(k_len, device=q.device) == torch.arange(past, k_len, device=q.device)[:, None]
        visible = visible | own  # a query always sees itself: no empty rows (left padding)
    if not output_attentions:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout), None
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, Lq, Lk)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    weights = scores.float().softmax(dim=-1).to(q.dtype)
    return F.dropout(weights, p=dropout, training=dropout > 0) @ v, weights


def _exact_is_enough(module: nn.Module, length: int, causal: bool, layer_cache) -> bool:
    """Whether a FAVOR+ or hybrid call computes exact softmax attention instead (SDPA, no attention dropout,
    as for the approximations): bidirectional inputs of at most ``module.exact_max_length`` tokens (below
    the crossover, where exact attention is also the faster), or inputs the hybrid's exact support covers
    entirely (its output is then exact attention). Cached decoding keeps the method's own state."""
    if layer_cache is not None:
        return False
    if not causal and length <= module.exact_max_length:
        return True
    spec = getattr(module, "hybrid_spec", None)
    return spec is not None and spec.covers(length, causal)


def favor_method(module: nn.Module, q, k, v, key_mask, causal, layer_cache=None, output_attentions=False):
    """FAVOR+ (:func:`.favor_attention`) with ``module.projection``; with ``layer_cache``, its
    constant-size :class:`FavorCacheLayer` state holds every earlier token."""
    length = q.shape[2]
    if _exact_is_enough(module, length, causal, layer_cache):
        return softmax_attention(q, k, v, key_mask, causal)
    new_key_mask = None if key_mask is None else key_mask[:, -length:]  # (B, L): past keys live in the state
    kwargs = {"causal": causal, "kernel": module.kernel, "key_padding_mask": new_key_mask,
              "chunk_size": module.chunk_size}  # fmt: skip
    # The kernel computes in float32 whatever the input dtype; autocast must not lower its
    # exponentials and prefix sums to bf16/fp16.
    with torch.autocast(q.device.type, enabled=False):
        if layer_cache is None:
            return favor_attention(q, k, v, module.projection, **kwargs), None
        context, state = favor_attention(
            q, k, v, module.projection, initial_state=layer_cache.get_state(), return_state=True, **kwargs
        )
    layer_cache.update_state(state, num_new_tokens=length)
    return context, None


def hybrid_method(module: nn.Module, q, k, v, key_mask, causal, layer_cache=None, output_attentions=False):
    """Hybrid attention (:func:`.hybrid_attention`): exact on the module's sparse support, a linear far
    field elsewhere; with ``layer_cache``, its constant-size :class:`HybridCacheLayer` state. Causal models with
    ``module.exact_max_length`` attend exactly at their first positions (:func:`_causal_exact_prefix`)."""
    spec = module.hybrid_spec
    if causal and spec.routed_blocks:
        raise ValueError(
            f"routed_blocks={spec.routed_blocks} cannot be used in causal attention (routing reads future "
            "tokens): set routed_blocks=0 in the config (e.g. convert with --routed-blocks 0)."
        )
    if causal and module.exact_max_length:
        return _causal_exact_prefix(module, q, k, v, key_mask, layer_cache)
    if _exact_is_enough(module, q.shape[2], causal, layer_cache):
        return softmax_attention(q, k, v, key_mask, causal)
    return _hybrid(module, q, k, v, key_mask, causal, layer_cache), None


def _hybrid(module: nn.Module, q, k, v, key_mask, causal, layer_cache=None) -> Tensor:
    """:func:`.hybrid_attention` with the module's settings, continuing from (and updating) ``layer_cache``'s state."""
    spec = module.hybrid_spec
    new_key_mask = None if key_mask is None else key_mask[:, -q.shape[2] :]  # (B, L): the past is in the state
    kwargs = {"causal": causal, "key_padding_mask": new_key_mask}
    if causal and spec.center:  # fixed centres: causal outputs must not depend on later tokens
        kwargs.update(query_center=module.query_center, key_center=module.key_center)
    if module.far_field_parameter is not None:
        kwargs["far_field_parameter"] = module.far_field_parameter
    if module.far_field_gain is not None:
        kwargs["far_field_gain"] = module.far_field_gain
    projection = module.projection if module.uses_projection else None
    with torch.autocast(q.device.type, enabled=False):  # float32 inside, as for FAVOR+
        if layer_cache is None:
            return hybrid_attention(q, k, v, projection, spec, **kwargs)
        context, state = hybrid_attention(
            q, k, v, projection, spec, initial_state=layer_cache.get_state(), return_state=True, **kwargs
        )
    layer_cache.update_state(state)
    return context


def _causal_exact_prefix(module: nn.Module, q, k, v, key_mask, layer_cache) -> tuple[Tensor, None]:
    """Causal hybrid attention whose first ``T = module.exact_max_length`` positions attend exactly (SDPA).

    The rule is by position, so that cached decoding equals a full forward: queries at positions below T see
    every earlier key exactly (the cache layer keeps their keys and values until then); from position T on,
    the hybrid itself (the cache layer switches to its constant-size state when the sequence passes T)."""
    T = module.exact_max_length
    past = 0 if layer_cache is None else layer_cache.get_seq_length()
    prefix = None if layer_cache is None else layer_cache.get_exact_prefix()  # (B, H, P, D) keys, values
    if past and prefix is None:  # decoding past the prefix: the hybrid's state
        return _hybrid(module, q, k, v, key_mask, True, layer_cache), None
    if past:
        k, v = torch.cat([prefix[0], k], dim=2), torch.cat([prefix[1], v], dim=2)  # (B, H, P + L, D)
    total = k.shape[2]
    exact_end = max(past, min(T, total))  # queries before it attend exactly
    visible = None if key_mask is None else key_mask[:, :exact_end]
    context, _ = softmax_attention(q[:, :, : exact_end - past], k[:, :, :exact_end], v[:, :, :exact_end], visible, True)
    if exact_end == total:
        if layer_cache is not None:
            layer_cache.update_exact_prefix(k, v)
        return context, None
    # The rest: the hybrid over every key so far, as from the first token (the past queries are placeholders,
    # their outputs unused); with a cache, its state after them takes over.
    if past:
        q = torch.cat([q.new_zeros(*q.shape[:2], past, q.shape[-1]), q], dim=2)
    if layer_cache is not None:
        layer_cache.reset()
    hybrid = _hybrid(module, q, k, v, key_mask, True, layer_cache)  # (B, H, P + L, D)
    return torch.cat([context, hybrid[:, :, exact_end:]], dim=2), None


@dataclass(frozen=True)
class AttentionMethod:
    """One attention method: its function and what other code needs to know about it.

    Attributes:
        attend: the function (see the module docstring for its signature).
        cache_layer: the transformers cache-layer class of its decoding state; None for a key/value cache.
        has_attention_weights: whether ``attend`` can return the attention weights.
        description: what replaces softmax attention, as model cards say it.
        presets: the ``PerformerConfig`` fields a conversion sets for this method, for ``"bidirectional"``
            and ``"causal"`` sources (explicit options override them); None where the converter does not
            offer the method (exact attention is asked for with ``attention_kernel="exact"``).
    """

    attend: Callable[..., tuple[Tensor, Tensor | None]]
    cache_layer: type | None
    has_attention_weights: bool
    description: str
    presets: dict[str, dict[str, Any]] | None = None

    @property
    def cache_layer_type(self) -> str:
        """The cache layer type that ``PerformerConfig.layer_types`` names for ``DynamicCache(config=...)``."""
        return "full_attention" if self.cache_layer is None else self.cache_layer._layer_type


# The converter's presets. "hybrid", its default: exact softmax on a local window, the first token and
# (bidirectionally) 24 routed key blocks of 8, with a centred second-order polynomial far field (`poly2`) for
# every other key; on the real all-MiniLM-L6-v2 it keeps 2,048-token document embeddings at cosine ~0.99 to
# the source. Causal models cannot route (it would read future tokens): they get a wider window, and FAVOR++
# random features (m = 256) around fixed centres, with A per head, both calibrated on sample text at
# conversion (leak-free). The causal polynomial far field approximates better but is several times slower
# at head_dim 64 (its features are 1 + d + d(d+1)/2 wide). Bidirectional inputs of at most 2,048 tokens keep
# exact attention (exact_max_length): measured on the MiniLM-shaped encoder (2 CPU threads, fp32, the hybrid
# with its compiled backward; benchmarks/results/model_speed_crossover.md), exact attention trains 1.14x
# faster than the hybrid at 2K tokens and infers 1.08x faster, while at 4K the hybrid is the faster (1.17x
# training, 1.25x inference; 1.28x training at 8K). Causal models attend exactly at their first 4,096
# positions (the rule is by position, so that cached decoding equals a full forward; the cache holds those
# keys until the sequence passes them): on the GPT-2-shaped decoder with the fused causal scan, exact
# attention trains 1.14x / 1.11x faster than the hybrid at 2K / 4K and infers 1.32x / 1.14x faster; at 8K
# training is even (1.01x) and the hybrid infers 1.13x faster.
# "favor": plain FAVOR+ (the paper's positive orthogonal random features), the PerformerConfig defaults;
# no exact dispatch, so that FAVOR+ is what is measured (its own crossover there is about 1-2K tokens).
ATTENTION_METHODS: dict[str, AttentionMethod] = {
    "exact": AttentionMethod(
        exact_attention,
        cache_layer=None,
        has_attention_weights=True,
        description="exact softmax attention (the same weights, no approximation)",
    ),
    "favor": AttentionMethod(
        favor_method,
        cache_layer=FavorCacheLayer,
        has_attention_weights=False,
        description="FAVOR+ linear attention (Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021)",
        presets={"bidirectional": {}, "causal": {}},
    ),
    "hybrid": AttentionMethod(
        hybrid_method,
        cache_layer=HybridCacheLayer,
        has_attention_weights=False,
        description=(
            "hybrid attention: exact softmax on a sparse support per query (local window, global tokens, routed "
            "key blocks) and a linear-time far-field kernel for every other key, sharing one normaliser"
        ),
        presets={
            "bidirectional": {
                "attention_kernel": "poly2",
                "center_features": True,
                "local_window": 17,
                "num_global_tokens": 1,
                "routed_blocks": 24,
                "route_block_size": 8,
                "route_group_size": 16,
                "query_block_size": 16,
                "exact_max_length": 2048,
            },
            "causal": {
                "attention_kernel": "softmax_opt",
                "center_features": True,
                "local_window": 64,
                "num_global_tokens": 1,
                "exact_max_length": 4096,
            },
        },
    ),
}
