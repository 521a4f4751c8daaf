"""Public kernel API: pure tensor functions, no configuration objects. FAVOR+ (``favor_attention``),
the converter's default hybrid attention (``hybrid_attention`` and its far fields, FAVOR++ among them),
and dense references.

>>> from performer_hf.favor import draw_projection, favor_attention
>>> W = draw_projection(256, 64)                      # (nb_features, head_dim)
>>> out = favor_attention(q, k, v, W, causal=True)    # q, k, v: (batch, heads, seq, head_dim)
"""

from .favor_reference import exact_attention, explicit_feature_attention
from .modeling.far_fields import FAR_FIELDS, FarField, get_far_field
from .modeling.favor_attention import DEFAULT_CHUNK_SIZE, FavorState, favor_attention
from .modeling.favor_features import FEATURE_MAPS, FeatureMap, feature_map, get_feature_map
from .modeling.favor_hybrid import hybrid_attention
from .modeling.favor_projection import draw_projection
from .modeling.hybrid_spec import HybridSpec, HybridState

KERNELS = tuple(FEATURE_MAPS)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FAR_FIELDS",
    "FEATURE_MAPS",
    "KERNELS",
    "FarField",
    "FavorState",
    "FeatureMap",
    "HybridSpec",
    "HybridState",
    "draw_projection",
    "exact_attention",
    "explicit_feature_attention",
    "favor_attention",
    "feature_map",
    "get_far_field",
    "get_feature_map",
    "hybrid_attention",
]
