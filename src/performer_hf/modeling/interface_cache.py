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
import functools
import weakref
from typing import NamedTuple

import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from .attention_methods import ATTENTION_METHODS
from .attention_settings import IMPLEMENTATIONS, METHOD_STATE_ATTRIBUTE, head_shape, keeps_own_attention, method_config
from .configuration_performer import PerformerConfig

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
        if text_config.model_type == PerformerConfig.model_type:
            raise ValueError(
                "PerformerCache is for transformers models loaded with attn_implementation in "
                f"{sorted(IMPLEMENTATIONS)}; a Performer-family model (model_type {PerformerConfig.model_type!r}) "
                "builds its method's cache itself: call its generate() without a cache, or pass "
                "DynamicCache(config=model.config)."
            )
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


class _Pending(NamedTuple):
    """A state kept for a cache that lives elsewhere: the method's layer, the padding mask (B, L) of the keys it read
    (None: no padding), and their digests by tail length (:func:`_key_digests`)."""

    layer: CacheLayerMixin
    mask: Tensor | None
    digests: dict[int, Tensor]


class _CopiedWithKeys:
    """A kept state, carried by the keys it stands for (an attribute of the tensor): a deep copy of the keys (what
    ``copy.deepcopy`` of a prompt's cache makes of them) carries a deep copy of the state as it is then, the copy's
    own, which its cache takes at its next call (:func:`_adopt_pending_layer`) whether or not the original cache was
    continued first (which takes, and advances, the state itself). A pickle carries an empty set, which
    ``torch.load(weights_only=True)`` reads (and a machine without performer-hf)."""

    def __init__(self, kept: _Pending):
        self.kept = kept

    def __deepcopy__(self, memo) -> _CopiedWithKeys:
        return _CopiedWithKeys(self.kept._replace(layer=copy.deepcopy(self.kept.layer, memo)))

    def __reduce__(self):
        return (set, ())


_COPIED_WITH_KEYS = "_performer_state_for_copies"  # the attribute of the keys tensor


class _PendingLayers(dict):
    """{id(keys): (weakref(keys), :class:`_Pending`)} of an attention module: the states kept for caches that live
    elsewhere, which a copy or a pickle of the model does not carry; and ``orphan``, the last one whose keys were
    freed, until the module's next call (beam search's ``reorder_cache`` replaces a cache's keys by a reordered copy
    before the first decoding step)."""

    orphan: _Pending | None = None

    def __reduce__(self):
        return (_PendingLayers, ())


@torch.compiler.disable  # its entries change at every call: traced, each call's guards would compile anew
def adopt_on_next_call(module: nn.Module, layer: CacheLayerMixin, keys: Tensor, mask: Tensor | None) -> None:
    """Hand ``layer`` (the method's own cache layer, holding the state of the keys this call of attention ``module``
    read) to the caller's cache: when a later call of the module gets a cache whose layer for it is the plain (or
    sliding-window) key/value layer that returned ``keys`` (B, H, L, D) to this call (what ``generate()`` builds by
    default), ``layer`` takes its place before the call runs, so that decoding reads the method's state. Each
    sequence's cache gets its own state (a second prompt prefilled before the first is continued, a batch scored
    in between), and a deep copy of the key/value cache a copy of it (``copy.deepcopy`` of a prompt's cache: the
    state as it was when the copy was made, whether the copy or the original continues first; a copy made otherwise,
    holding the same keys, a copy of the state while the original has not continued); other caches (a
    ``PerformerCache``, a static cache) are left as they are. A layer is dropped with the keys it stands for (the
    caller's cache), or, when the cache lives on with other keys, goes to the module's next call, whose cache takes
    it if its keys are rows of the freed ones (beam search reorders the cache between the prompt and the first
    token; :func:`_key_digests` recognizes the rows): the state's rows follow."""
    pending = module.__dict__.setdefault(_PENDING_LAYERS, _PendingLayers())
    key_id = id(keys)

    def forget(_, pending=pending, key_id=key_id) -> None:
        entry = pending.pop(key_id, None)
        if entry is not None:
            pending.orphan = entry[1]

    tails = {keys.shape[-2]}
    window = getattr(module.config, "sliding_window", None)
    if isinstance(window, int) and 1 < window <= keys.shape[-2]:
        tails.add(window - 1)  # what a sliding-window key/value layer keeps of them
    kept = _Pending(layer, mask, _key_digests(keys, tails))
    pending[key_id] = (weakref.ref(keys, forget), kept)
    setattr(keys, _COPIED_WITH_KEYS, _CopiedWithKeys(kept))
    watch_caches(module)


def _prepare_cache_layer(module: nn.Module, args, kwargs) -> None:
    """Before a call of Performer attention ``module`` with a cache: the method's state in the place of the key/value
    layer it stands for (:func:`adopt_on_next_call`), and a sliding-window key/value layer made one that keeps
    every key (:func:`_keep_every_key`); nothing once its model has switched to another implementation (its kept
    states dropped)."""
    pending = module.__dict__.get(_PENDING_LAYERS)
    if module.config._attn_implementation not in IMPLEMENTATIONS:  # switched to another (set_attn_implementation)
        if pending is not None:  # its states stand for nothing it reads
            pending.clear()
            pending.orphan = None
        return
    cache = kwargs.get(CACHE_KEYWORD)
    if not isinstance(cache, Cache) or module.layer_idx >= len(cache.layers):
        cache = None  # no cache layer for this module
    # (traced, a guard on how many are pending and on the layer's type: a compiled decoding step that reads the state
    # it adopted has no call to run eagerly; ``len``, as torch 2.11 cannot trace the truth of a dict subclass)
    if pending is not None and (len(pending) > 0 or pending.orphan is not None or _plain(cache, module.layer_idx)):
        _adopt_pending_layer(module, pending, cache, kwargs.get("attention_mask"))
    if cache is not None:
        _keep_every_key(module, cache)


def _plain(cache: Cache | None, layer_idx: int) -> bool:
    """Whether the cache's layer ``layer_idx`` is a key/value layer holding keys, whose place a kept state may take: a
    sliding-window layer too (Mistral's config may name a window; the method, not the window, decides what the layer
    reads). None: no cache layer."""
    layer = None if cache is None else cache.layers[layer_idx]
    return type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) and getattr(layer, "keys", None) is not None


@torch.compiler.disable  # it edits the cache and the keys' attributes: a compiled model's call runs it eagerly
def _adopt_pending_layer(module: nn.Module, pending: _PendingLayers, cache: Cache | None, mask: Tensor | None) -> None:
    orphan, pending.orphan = pending.orphan, None  # the freed keys' state goes to this call at most
    if not _plain(cache, module.layer_idx):
        return
    current = cache.layers[module.layer_idx]
    held = current.keys  # the keys a plain layer returned; a sliding-window layer's, a view of their end
    length = current.get_seq_length()
    entries = [(key_id, reference(), kept) for key_id, (reference, kept) in list(pending.items())]
    entries = [entry for entry in entries if entry[1] is not None and entry[2].layer.get_seq_length() == length]
    for key_id, keys, kept in entries:
        if keys is held or keys is held._base:  # the cache that call filled
            del pending[key_id]
            delattr(keys, _COPIED_WITH_KEYS)
            cache.layers[module.layer_idx] = kept.layer
            return
    # a deep copy of that cache's keys carries its own copy of the state
    copied = getattr(getattr(held, _COPIED_WITH_KEYS, None), "kept", None)
    if copied is not None and copied.layer.get_seq_length() == length:
        if _same_padding(copied.mask, mask, length):
            delattr(held, _COPIED_WITH_KEYS)
            cache.layers[module.layer_idx] = copied.layer
            return
    for _, keys, kept in entries:
        same_keys = held.shape[:-2] == keys.shape[:-2] and torch.equal(
            held, keys[..., keys.shape[-2] - held.shape[-2] :, :]
        )
        if same_keys and _same_padding(kept.mask, mask, keys.shape[-2]):
            # a copy of that cache that did not carry the state (a sliding-window layer's copy, a view of the last
            # keys), holding the same keys (a sliding-window layer: the same last keys, of a sequence of the same
            # length) of tokens padded alike: a copy of the state, the state kept for the next copy
            cache.layers[module.layer_idx] = copy.deepcopy(kept.layer)
            return
    if orphan is not None and orphan.layer.get_seq_length() == length:
        rows = _matching_rows(held, orphan.digests)
        kept_mask = None if orphan.mask is None or rows is None else orphan.mask[rows.to(orphan.mask.device)]
        if rows is not None and _same_padding(kept_mask, mask, length):
            # the cache whose keys were freed, reordered (beam search): the state's rows as the keys' rows
            orphan.layer.batch_select_indices(rows)
            cache.layers[module.layer_idx] = orphan.layer


_MODULUS = 2_147_483_647  # a prime below 2**31: the digests' products stay below 2**62, exact in int64
_HEAD_DIM_CHUNK = 256  # the bits (< 2**31) times weights < 2**23, summed over as many dimensions: below 2**63
_POSITION_CHUNK = 2048  # positions digested at once (bounds the int64 copies of the bits)


def _key_digests(keys: Tensor, tails) -> dict[int, Tensor]:
    """Two digests of the bits of each row's last ``n`` keys of ``keys`` (B, H, L, D), for each ``n`` of
    ``tails``: {n: (B, 2) int64}. Integer arithmetic modulo a prime, so equal keys give equal digests whatever the
    batch around them or the order of the sums; other keys, the same ones with probability about 2**-62."""
    terms = _position_terms(keys)  # (B, L, 2)
    return {n: _digest(terms[:, terms.shape[1] - n :]) for n in tails}


def _matching_rows(held: Tensor, digests: dict[int, Tensor]) -> Tensor | None:
    """For each row of ``held`` (B', H, n, D), the row of the keys that ``digests`` (:func:`_key_digests`) stand for
    that holds the same keys, (B',) int64; None when some row has none. ``held`` may be the tail of those keys (a
    sliding-window layer keeps its last ones): rows alike there but not before it are refused (ValueError), as the
    state of either could be the other's."""
    n = held.shape[-2]
    if n not in digests:
        return None
    ours = _digest(_position_terms(held))
    same = (ours[:, None, :] == digests[n].to(ours.device)[None]).all(dim=-1)  # (B', B)
    if not bool(same.any(dim=1).all()):
        return None
    rows = same.to(torch.int8).argmax(dim=1)
    whole = digests[max(digests)].to(ours.device)  # (B, 2): the rows' whole keys
    if n < max(digests) and not bool(((whole[None] == whole[rows][:, None]).all(dim=-1) | ~same).all()):
        raise ValueError(
            f"the cache was reordered (beam search) after its sliding-window layers had dropped all but the last {n} "
            "keys, and some prompts of the batch share those keys but not the earlier ones, so the method's decoding "
            f"state cannot be told apart: pass {CACHE_KEYWORD}=PerformerCache(model.config) (performer_hf), whose "
            "layers hold the state from the first token."
        )
    return rows


def _position_terms(keys: Tensor) -> Tensor:
    """(B, L, 2) int64 in [0, P): two digests of each position's keys (B, H, L, D) over its heads, from their bits,
    ``_POSITION_CHUNK`` positions at a time."""
    chunks = keys.detach().split(_POSITION_CHUNK, dim=2)
    return torch.cat([_chunk_terms(chunk) for chunk in chunks], dim=1)


def _chunk_terms(keys: Tensor) -> Tensor:
    """:func:`_position_terms` of keys (B, H, L, D) at once."""
    B, H, L, D = keys.shape
    integer = {2: torch.int16, 4: torch.int32, 8: torch.int64}[keys.element_size()]
    bits = keys.view(integer).to(torch.int64)  # (B, H, L, D), |bits| < 2**31 for 2- and 4-byte keys
    if keys.element_size() == 8:
        bits = bits.remainder(_MODULUS)
    weights = _weights((2, H, 1, D + 1), keys.device)  # per head: per dimension, then the head's (the last)
    terms = []
    for per_dimension, per_head in zip(weights[..., :D], weights[..., D], strict=True):  # (H, 1, D), (H, 1)
        heads = sum(  # (B, H, L): over the dimensions, a chunk at a time
            (part * weight).sum(dim=-1).remainder(_MODULUS)
            for part, weight in zip(
                bits.split(_HEAD_DIM_CHUNK, -1), per_dimension.split(_HEAD_DIM_CHUNK, -1), strict=True
            )
        )
        mixed = (heads.remainder(_MODULUS) * per_head).remainder(_MODULUS)
        terms.append(mixed.sum(dim=1).remainder(_MODULUS))  # (B, L)
    return torch.stack(terms, dim=-1)


def _digest(terms: Tensor) -> Tensor:
    """(B, n, 2) position terms -> (B, 2): each weighted by its distance from the last position, summed mod P."""
    n = terms.shape[1]
    from_end = torch.arange(n - 1, -1, -1, device=terms.device, dtype=torch.int64)[:, None]  # (n, 1)
    position_weights = (from_end * torch.tensor([1_000_003, 998_244_353], device=terms.device) + 12_345) % _MODULUS
    return (terms * position_weights).remainder(_MODULUS).sum(dim=1).remainder(_MODULUS)


@functools.cache
def _weights(shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Fixed pseudo-random weights in [1, 2**23), the same at every call (drawn once per shape and device)."""
    generator = torch.Generator().manual_seed(20261130)
    return torch.randint(1, 2**23, shape, generator=generator, dtype=torch.int64).to(device)


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
