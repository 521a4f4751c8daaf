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
from .attention_settings import IMPLEMENTATIONS, METHOD_STATE_ATTRIBUTE, head_shape, keeps_own_attention, method_config

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
_CACHE_HOOK = "_performer_cache_hook"


def watch_caches(module: nn.Module) -> None:
    """From its next call on, prepare the caller's cache layer before Performer attention ``module`` runs
    (:func:`_prepare_cache_layer`): a forward pre-hook (the running call has passed its hooks already)."""
    if _CACHE_HOOK not in module.__dict__:
        _register_cache_hook(module)


@torch.compiler.disable  # once per module: not traced
def _register_cache_hook(module: nn.Module) -> None:
    module.register_forward_pre_hook(_prepare_cache_layer, with_kwargs=True)
    module.__dict__[_CACHE_HOOK] = True  # a plain flag, which tracing reads without a graph break (a handle breaks)


class _PendingLayers(dict):
    """{id(keys): (weakref(keys), the method's layer, the keys' padding mask)} of an attention module: the states
    kept for caches that live elsewhere, which a copy or a pickle of the model does not carry."""

    def __reduce__(self):
        return (_PendingLayers, ())


@torch.compiler.disable  # its entries change at every call: traced, each call's guards would compile anew
def adopt_on_next_call(module: nn.Module, layer: CacheLayerMixin, keys: Tensor, mask: Tensor | None) -> None:
    """Hand ``layer`` (the method's own cache layer, holding the state of the keys this call of attention ``module``
    read) to the caller's cache: when a later call of the module gets a cache whose layer for it is the plain (or
    sliding-window) key/value layer that returned ``keys`` (B, H, L, D) to this call (what ``generate()`` builds by
    default), ``layer`` takes its place before the call runs, so that decoding reads the method's state. Each
    sequence's cache gets its own state (a second prompt prefilled before the first is continued, a batch scored
    in between), and a copy of a key/value cache holding the same keys a copy of it (``copy.deepcopy`` of a
    prompt's cache); other caches (a ``PerformerCache``, a static cache) are left as they are. A layer is dropped
    with the keys it stands for (the caller's cache)."""
    pending = module.__dict__.setdefault(_PENDING_LAYERS, _PendingLayers())
    key_id = id(keys)

    def forget(_, pending=pending, key_id=key_id) -> None:
        pending.pop(key_id, None)

    pending[key_id] = (weakref.ref(keys, forget), layer, mask)
    watch_caches(module)


def _prepare_cache_layer(module: nn.Module, args, kwargs) -> None:
    """Before a call of Performer attention ``module`` with a cache: the method's state in the place of the key/value
    layer it stands for (:func:`adopt_on_next_call`), and a sliding-window key/value layer made one that keeps
    every key (:func:`_keep_every_key`)."""
    cache = kwargs.get(CACHE_KEYWORD)
    if not isinstance(cache, Cache) or module.layer_idx >= len(cache.layers):
        return
    _adopt_pending_layer(module, cache, kwargs.get("attention_mask"))
    _keep_every_key(module, cache)


def _adopt_pending_layer(module: nn.Module, cache: Cache, mask: Tensor | None) -> None:
    pending = module.__dict__.get(_PENDING_LAYERS)
    current = cache.layers[module.layer_idx]
    # a sliding-window layer too (Mistral's config may name a window): the method, not the window, decides what the
    # layer reads
    plain = type(current) in (DynamicLayer, DynamicSlidingWindowLayer)
    if not pending or not plain or getattr(current, "keys", None) is None:
        return
    held = current.keys  # the keys a plain layer returned; a sliding-window layer's, a view of their end
    entries = [(key_id, reference(), layer, kept) for key_id, (reference, layer, kept) in list(pending.items())]
    entries = [
        entry for entry in entries if entry[1] is not None and entry[2].get_seq_length() == current.get_seq_length()
    ]
    for key_id, keys, layer, _ in entries:
        if keys is held or keys is held._base:  # the cache that call filled
            del pending[key_id]
            cache.layers[module.layer_idx] = layer
            return
    for _, keys, layer, kept in entries:
        same_keys = held.shape[:-2] == keys.shape[:-2] and torch.equal(
            held, keys[..., keys.shape[-2] - held.shape[-2] :, :]
        )
        if same_keys and _same_padding(kept, mask, keys.shape[-2]):
            # a copy of that cache (transformers' prefix-cache recipe: copy.deepcopy of a prompt's cache per
            # question), holding the same keys (a sliding-window layer: the same last keys, of a sequence of the
            # same length) of tokens padded alike: a copy of the state, the state kept for the next copy
            cache.layers[module.layer_idx] = copy.deepcopy(layer)
            return


def _same_padding(kept: Tensor | None, mask: Tensor | None, past: int) -> bool:
    """Whether the padding mask ``kept`` (B, past) of a cached prompt (None: no padding) is that of the first
    ``past`` keys of ``mask`` (B, past + new) of the call that continues it."""
    if mask is None or mask.dim() != 2:
        return kept is None or bool(kept.all())
    earlier = mask[:, :past].bool()
    return bool(earlier.all()) if kept is None else earlier.shape == kept.shape and torch.equal(earlier, kept.bool())


def dropped_keys_refusal(layer_idx: int, kept: int, total: int, window: int) -> str:
    """The refusal of a sliding-window cache layer that dropped keys Performer attention reads."""
    return (
        f"this cache's layer {layer_idx} is a sliding-window layer that kept only the last {kept} of {total} keys "
        f"(the config names sliding_window={window}), but Performer attention reads every earlier key: let the "
        "model or generate() build the cache (Performer attention makes its layers keep every key), or pass "
        f"{CACHE_KEYWORD}=PerformerCache(model.config) (performer_hf)."
    )


def _keep_every_key(module: nn.Module, cache: Cache) -> None:
    """Replace a sliding-window key/value layer (a Mistral config's ``sliding_window`` has ``DynamicCache`` build
    them) by a plain one holding the same keys, so that it keeps every key: Performer attention reads the whole
    context, where the window's layer drops all but its last ``sliding_window - 1`` keys (exact attention, which
    honours the window, keeps it). After a first call, the keys it dropped are still the tensors its window is a
    view of; a layer that dropped keys for good (filled by the source model, or a copy) is refused."""
    current = cache.layers[module.layer_idx]
    state = module.__dict__.get(METHOD_STATE_ATTRIBUTE)
    if type(current) is not DynamicSlidingWindowLayer or state is None or state.attention_method == "exact":
        return
    every = DynamicLayer()
    if current.is_initialized:
        keys, values = current.keys, current.values  # (B, H, n, D)
        if keys.shape[-2] < current.cumulative_length:  # the window's view of a first call's keys, or lost keys
            keys, values = keys._base, values._base
            if keys is None or values is None or keys.shape[-2] != current.cumulative_length:
                kept, total = current.keys.shape[-2], current.cumulative_length
                raise ValueError(dropped_keys_refusal(module.layer_idx, kept, total, current.sliding_window))
        every.lazy_initialization(keys, values)
        every.keys, every.values = keys, values
    cache.layers[module.layer_idx] = every


__all__ = ["CACHE_KEYWORD", "PerformerCache"]
