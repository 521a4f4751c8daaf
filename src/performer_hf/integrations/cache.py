"""The methods' own decoding state for transformers models that run Performer attention.

``generate()`` builds a key/value ``DynamicCache`` by default. The sparse method (every block kept) reads it in
place; the hybrid and FAVOR+ read it correctly but recompute their state over every key at each step, and a bounded
sparse state refuses it. Pass a :class:`PerformerCache` instead, and each Performer layer keeps its method's state
(``modeling/cache_performer.py``): constant-size for the hybrid and FAVOR+, bounded by ``select_budget`` for the
sparse method::

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="performer_hybrid")
    model.generate(**inputs, **{CACHE_KEYWORD: PerformerCache(model.config)})

:data:`CACHE_KEYWORD` is the keyword that passes a cache to ``generate`` and to the model's forward in the
installed transformers: ``cache`` since 5.24 (where ``past_key_values`` is deprecated), ``past_key_values``
before.
"""

from __future__ import annotations

import transformers
from packaging.version import Version
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..modeling.attention_methods import ATTENTION_METHODS
from .attention_interface import keeps_own_attention
from .attention_settings import IMPLEMENTATIONS, head_shape, method_config

CACHE_KEYWORD = "cache" if Version(transformers.__version__) >= Version("5.24.0") else "past_key_values"


class PerformerCache(Cache):
    """One cache layer per decoder layer of a model loaded with ``attn_implementation="performer"``,
    ``"performer_hybrid"`` or ``"performer_sparse"``: the method's state for Performer layers, a sliding-window
    key/value layer for the sliding layers that keep their own attention (Gemma3), a key/value layer for exact mode.

    Args:
        config: the model's config (its text config is used).
    """

    def __init__(self, config):
        text_config = config.get_text_config(decoder=True)
        implementation = text_config._attn_implementation
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"PerformerCache is for models loaded with attn_implementation in {sorted(IMPLEMENTATIONS)}; this "
                f"one uses {implementation!r}. Load it with attn_implementation='performer_hybrid' (or 'performer')."
            )
        method = method_config(text_config, implementation, True, *head_shape(text_config)).attention_method
        layers = []
        for layer_idx in range(text_config.num_hidden_layers):
            if keeps_own_attention(text_config, layer_idx):
                layers.append(DynamicSlidingWindowLayer(sliding_window=text_config.sliding_window))
            else:
                layers.append((ATTENTION_METHODS[method].cache_layer or DynamicLayer)())
        super().__init__(layers=layers)


__all__ = ["CACHE_KEYWORD", "PerformerCache"]
