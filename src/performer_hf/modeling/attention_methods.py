"""The attention methods of the Performer family: one registry, one signature, one module each.

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
:class:`AttentionMethod`: the function and the facts other code needs about it (its config fields, the
kernels it takes, its cache layer, its card text, the converter's presets). The functions live in
``method_exact.py``, ``method_favor.py`` and ``method_hybrid.py``; adding a method is its module, one entry here
and its tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .cache_performer import FavorCacheLayer, HybridCacheLayer, SparseCacheLayer
from .far_fields import FAR_FIELDS
from .favor_features import FEATURE_MAPS
from .hybrid_spec import HybridSpec
from .method_exact import exact_attention
from .method_favor import favor_method
from .method_hybrid import hybrid_card_lines, hybrid_layer_settings, hybrid_method
from .method_sparse import sparse_card_lines, sparse_layer_settings, sparse_method
from .sparse_spec import SparseSpec

Tensor = torch.Tensor


@dataclass(frozen=True)
class AttentionMethod:
    """One attention method: its function and what other code needs to know about it.

    Attributes:
        attend: the function (see the module docstring for its signature).
        cache_layer: the transformers cache-layer class of its decoding state; None for a key/value cache.
        has_attention_weights: whether ``attend`` can return the attention weights.
        description: what replaces softmax attention, as model cards say it.
        fields: the ``PerformerConfig`` fields it reads besides the architecture's; a config of another method
            must leave them at their defaults.
        kernels: the registry of the ``attention_kernel`` values it takes (read at each check, so a kernel
            registered later counts), or None for any (unused).
        layer_settings: ``(config, layer_idx) -> {name: value}``: what a layer's method state holds besides
            the projection and centres; None for nothing.
        card_lines: ``config -> [markdown bullet]``: its settings as model cards list them; None for none.
        presets: the ``PerformerConfig`` fields a conversion sets for this method, for ``"bidirectional"``
            and ``"causal"`` sources (explicit options override them; a direction left out is one the method
            cannot run); None where the converter does not offer the method (exact attention is asked for with
            ``attention_kernel="exact"``).
        grouped_kv: whether ``attend`` takes grouped-query keys and values as they are, (B, Hkv, L, D) with the
            query heads a multiple of ``Hkv``; otherwise the integrations repeat them to the query heads.
    """

    attend: Callable[..., tuple[Tensor, Tensor | None]]
    cache_layer: type | None
    has_attention_weights: bool
    description: str
    fields: tuple[str, ...]
    kernels: Mapping[str, Any] | None
    layer_settings: Callable[[Any, int], dict[str, Any]] | None = None
    card_lines: Callable[[Any], list[str]] | None = None
    presets: dict[str, dict[str, Any]] | None = None
    grouped_kv: bool = False

    @property
    def cache_layer_type(self) -> str:
        """The cache layer type that ``PerformerConfig.layer_types`` names for ``DynamicCache(config=...)``."""
        return "full_attention" if self.cache_layer is None else self.cache_layer._layer_type


FAVOR_FIELDS = (
    "attention_kernel",
    "nb_features",
    "feature_coupling",
    "feature_row_norms",
    "projection_seed",
    "feature_redraw_interval",
    "causal_chunk_size",
    "exact_max_length",
    "accelerator_exact_max_length",
)
# FAVOR+'s fields (a random-feature far field reads them all), the HybridSpec's, the per-layer tensors' settings
HYBRID_FIELDS = (
    *FAVOR_FIELDS,
    *(name for name in HybridSpec.config_fields().values() if name not in FAVOR_FIELDS),
    "far_field_parameter",
    "far_field_gain",
)
SPARSE_FIELDS = tuple(SparseSpec.config_fields().values())

# The converter's presets. "hybrid", its default for encoders and GPT-2 conversions (decoders converted in place
# take "sparse", below): exact softmax on a local window, the first token and
# (bidirectionally) 24 routed key blocks of 8, with a centred second-order polynomial far field (`poly2`) for
# every other key; on the real all-MiniLM-L6-v2 it keeps 2,048-token document embeddings at cosine ~0.99 to
# the source. Causal models cannot route (it would read future tokens): they get a wider window, and FAVOR++
# random features (m = 256) around fixed centres, with A per head, both calibrated on sample text at
# conversion (leak-free). The causal polynomial far field approximates better but is several times slower
# at head_dim 64 (its features are 1 + d + d(d+1)/2 wide). Bidirectional inputs of at most 2,048 tokens keep
# exact attention (exact_max_length): measured on the MiniLM-shaped encoder (2 CPU threads, fp32, the hybrid
# with its compiled backward; benchmarks/results/model_speed_crossover.md), exact attention trains 1.14x
# faster than the hybrid at 2K tokens and infers 1.08x faster, while at 4K the hybrid is the faster (1.17x
# training, 1.25x inference; 1.28x training at 8K). On GPUs flash attention stays ahead longer: on an H200 (bf16,
# whole model, 16K tokens per batch; benchmarks/results/flex_h200) it trained the encoder faster than every
# approximation at 8K (1.21x plain FAVOR+, 8.8x the hybrid then), so bidirectional inputs of at most 8,192 tokens keep
# exact attention there (accelerator_exact_max_length). Causal models attend exactly at their first 4,096
# positions (the rule is by position, so that cached decoding equals a full forward; the cache holds those
# keys until the sequence passes them): on the GPT-2-shaped decoder with the fused causal scan, exact
# attention trains 1.14x / 1.11x faster than the hybrid at 2K / 4K and infers 1.32x / 1.14x faster; at 8K
# training is even (1.01x) and the hybrid infers 1.13x faster.
# "favor": plain FAVOR+ (the paper's positive orthogonal random features), the PerformerConfig defaults;
# no exact dispatch, so that FAVOR+ is what is measured (its own crossover there is about 1-2K tokens).
# "sparse", for decoders: exact softmax on a window of 512 keys (plus the query's own block), the first 4 tokens and
# the 8 blocks of 64 earlier keys each query scores highest. Decoding keeps 16 blocks beyond the window, the ones the
# prompt's last queries attend to most (select_ranking="latest", as SnapKV): on SmolLM2-135M it finds the pass keys
# the source finds at 4K / 8K tokens with 20% of the source's cache at 8K and decodes faster than the source, where
# keeping every block (select_budget=0) holds 100% and ranking blocks causally ("window") loses the keys
# (benchmarks/results/long_context_retrieval.md).
SPARSE_CAUSAL_PRESET = {
    "local_window": 512,
    "num_global_tokens": 4,
    "select_blocks": 8,
    "select_block_size": 64,
    "select_budget": 16,
    "select_ranking": "latest",
}


def preset_under(preset: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """A method's ``preset`` under the fields ``given`` explicitly (a conversion's overrides, a model's saved
    settings): an ``exact_max_length`` given without an ``accelerator_exact_max_length`` holds on accelerators too
    (``0``: never exact, anywhere), so the preset's own accelerator crossover is left out; settings saved before that
    field existed keep their behaviour."""
    if "exact_max_length" in given and "accelerator_exact_max_length" not in given:
        return {name: value for name, value in preset.items() if name != "accelerator_exact_max_length"}
    return preset


ATTENTION_METHODS: dict[str, AttentionMethod] = {
    "exact": AttentionMethod(
        exact_attention,
        cache_layer=None,
        has_attention_weights=True,
        description="exact softmax attention (the same weights, no approximation)",
        fields=(),
        kernels=None,
    ),
    "favor": AttentionMethod(
        favor_method,
        cache_layer=FavorCacheLayer,
        has_attention_weights=False,
        description="FAVOR+ linear attention (Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021)",
        fields=FAVOR_FIELDS,
        kernels=FEATURE_MAPS,
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
        fields=HYBRID_FIELDS,
        kernels=FAR_FIELDS,
        layer_settings=hybrid_layer_settings,
        card_lines=hybrid_card_lines,
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
                "accelerator_exact_max_length": 8192,
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
    "sparse": AttentionMethod(
        sparse_method,
        cache_layer=SparseCacheLayer,
        has_attention_weights=False,
        description=(
            "sparse attention: exact softmax over each query's local window, the first tokens and the earlier key "
            "blocks that hold the most of its attention (causal)"
        ),
        fields=SPARSE_FIELDS,
        kernels=None,
        layer_settings=sparse_layer_settings,
        card_lines=sparse_card_lines,
        presets={"causal": SPARSE_CAUSAL_PRESET},
        grouped_kv=True,
    ),
}

# Every field an attention method reads, with the method itself first: what transformers models that are not ours
# keep in config.performer_attention (performer_hf.integrations), and what the converter's options set.
ATTENTION_FIELDS = (
    "attention_method",
    *dict.fromkeys(f for method in ATTENTION_METHODS.values() for f in method.fields),
)


def infer_method(settings: Mapping[str, Any]) -> str:
    """The method of attention settings that do not name one (configs saved before ``attention_method`` existed,
    settings given without it), as those fields always selected it: ``attention_kernel="exact"`` is exact
    attention; a kernel that is only a far field, or any hybrid setting away from its default, the hybrid;
    otherwise FAVOR+."""
    kernel = settings.get("attention_kernel", "softmax")
    if kernel == "exact":
        return "exact"
    support = any(settings.get(name) for name in ("local_window", "num_global_tokens", "routed_blocks"))
    far_field = settings.get("center_features") or any(
        settings.get(name) is not None for name in ("far_field_parameter", "far_field_gain")
    )
    return "hybrid" if kernel not in FEATURE_MAPS or support or far_field else "favor"
