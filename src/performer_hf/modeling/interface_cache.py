"""The methods' own decoding state for transformers models that run Performer attention.

``generate()`` builds a key/value ``DynamicCache`` by default. The sparse method with every block kept reads it in
place. For the methods whose decoding keeps a state of its own (FAVOR+ and the hybrid: constant-size; the sparse
method with ``select_budget``: bounded), the first call of a sequence without gradients (unless the model was told
``use_cache=False``, where its layers pass that on to attention: Llama, Mistral, Qwen) also builds that state in the
method's cache layer (``modeling/cache_performer.py``), and :func:`adopt_on_next_call` puts the layer in the
key/value cache's place at the next call, so that plain ``generate()`` decodes from the state. A
:class:`PerformerCache` holds those layers from the start::

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="performer_hybrid")
    model.generate(**inputs)  # the same tokens as:
    model.generate(**inputs, **{CACHE_KEYWORD: PerformerCache(model.config)})

:data:`CACHE_KEYWORD` is the keyword that passes a cache to ``generate`` and to the model's forward in the
installed transformers: ``cache`` since 5.24 (where ``past_key_values`` is deprecated), ``past_key_values``
before.
"""

from __future__ import annotations

import copy
import weakref

import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from .attention_methods import ATTENTION_METHODS
from .attention_settings import IMPLEMENTATIONS, head_shape, keeps_own_attention, method_config

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


_PENDING_LAYERS = "_performer_pending_cache_layers"  # module attributes: the layers handed over, the hook
_ADOPTION_HOOK = "_performer_adoption_hook"


def adopt_on_next_call(module: nn.Module, layer: CacheLayerMixin, keys: Tensor) -> None:
    """Hand ``layer`` (the method's own cache layer, holding the state of the keys this call of attention ``module``
    read) to the caller's cache: when a later call of the module gets a cache whose layer for it is the plain (or
    sliding-window) key/value layer that returned ``keys`` (B, H, L, D) to this call (what ``generate()`` builds by
    default), ``layer`` takes its place before the call runs, so that decoding reads the method's state. Each
    sequence's cache gets its own state (a second prompt prefilled before the first is continued, a batch scored
    in between), and a copy of a plain cache holding the same keys a copy of it (``copy.deepcopy`` of a prompt's
    cache); other caches (a ``PerformerCache``, a static cache) are left as they are. A layer is dropped with the
    keys it stands for (the caller's cache)."""
    pending = module.__dict__.setdefault(_PENDING_LAYERS, {})  # {id(keys): (weakref(keys), layer)}
    key_id = id(keys)

    def forget(_, pending=pending, key_id=key_id) -> None:
        pending.pop(key_id, None)

    pending[key_id] = (weakref.ref(keys, forget), layer)
    if _ADOPTION_HOOK not in module.__dict__:  # a pre-hook: the running call has passed its hooks already
        module.__dict__[_ADOPTION_HOOK] = module.register_forward_pre_hook(_adopt_pending_layer, with_kwargs=True)


def _adopt_pending_layer(module: nn.Module, args, kwargs) -> None:
    pending = module.__dict__.get(_PENDING_LAYERS)
    cache = kwargs.get(CACHE_KEYWORD)
    if not pending or not isinstance(cache, Cache) or module.layer_idx >= len(cache.layers):
        return
    current = cache.layers[module.layer_idx]
    # a sliding-window layer too (Mistral's config may name a window): the method, not the window, decides what the
    # layer reads
    if type(current) not in (DynamicLayer, DynamicSlidingWindowLayer) or getattr(current, "keys", None) is None:
        return
    held = current.keys  # the keys a plain layer returned; a sliding-window layer's, a view of their end
    for key_id, (reference, layer) in list(pending.items()):
        keys = reference()
        if keys is None or layer.get_seq_length() != current.get_seq_length():
            continue
        if keys is held or keys is held._base:  # the cache that call filled
            del pending[key_id]
            cache.layers[module.layer_idx] = layer
            return
        if type(current) is DynamicLayer and held.shape == keys.shape and torch.equal(held, keys):
            # a copy of that cache (transformers' prefix-cache recipe: copy.deepcopy of a prompt's cache per
            # question): a copy of the state, the state kept for the next copy
            cache.layers[module.layer_idx] = copy.deepcopy(layer)
            return


__all__ = ["CACHE_KEYWORD", "PerformerCache"]
