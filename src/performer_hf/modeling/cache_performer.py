"""Constant-size decoding cache for causal FAVOR+ attention, built on transformers' cache classes.

A causal FAVOR+ layer summarises every token it has seen in a :class:`FavorState`: the running
``(B, H, m, d + 1)`` matrix ``sum_j phi(k_j) [v_j, 1]^T`` and its ``(B, H)`` log-shift. Its size does
not depend on the context length, so each generated token costs the same at context 256 and at 16K.

:class:`FavorCacheLayer` stores that state as the two recurrent states of a transformers
``LinearAttentionLayer`` and also counts the tokens it has absorbed (so ``Cache.get_seq_length``,
which ``generate`` and the position ids rely on, keeps working). It registers itself as the cache
layer type ``"favor_attention"``: ``PerformerConfig.layer_types`` names it, so
``DynamicCache(config=model.config)`` (what ``generate`` builds) holds one per layer.

Hybrid attention (exact window and global tokens plus a linear far field) keeps a
:class:`HybridState` instead: the far-field state plus the last ``local_window - 1`` keys and values
and the first ``num_global_tokens`` ones, still constant in the context length.
:class:`HybridCacheLayer` holds it under the cache layer type ``"hybrid_attention"``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, CacheLayerMixin, LinearAttentionLayer, StaticLayer

from .favor_attention import FavorState
from .hybrid_spec import HybridState
from .sparse_spec import SparseState

# What the layer types below were registered as before this module defined them (see the end of the module).
_REGISTERED_BEFORE = {
    name: DYNAMIC_LAYER_TYPE_MAPPING.get(name) for name in ("favor_attention", "hybrid_attention", "sparse_attention")
}


def static_cache_refusal(what: str, fix: str) -> str:
    """The refusal of a static (fixed-size) cache, ``what`` naming it, ``fix`` what to pass instead."""
    return (
        f"Performer attention cannot decode from a static (fixed-size) cache ({what}): its methods keep a state of "
        "their own, and exact attention a key/value cache that grows, where a static one holds empty slots its "
        f"attention would read. {fix}"
    )


def check_no_static_layers(layers, fix: str) -> None:
    """Refuse a cache holding static (fixed-size) layers (:func:`static_cache_refusal`)."""
    static = sorted({type(layer).__name__ for layer in layers if isinstance(layer, StaticLayer)})
    if static:
        raise ValueError(static_cache_refusal(", ".join(static), fix))


def held_bytes(value) -> int:
    """Bytes of memory ``value`` (a cache, a cache layer, a state, or lists, tuples, dicts and attributes of them)
    keeps alive: every distinct tensor storage reachable from it, counted once and whole (a view keeps all of its
    storage)."""
    storages: dict[int, int] = {}

    def visit(item, seen: set[int]) -> None:
        if torch.is_tensor(item):
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif id(item) in seen or isinstance(item, type):
            return
        elif isinstance(item, dict):
            seen.add(id(item))
            for element in item.values():
                visit(element, seen)
        elif isinstance(item, (list, tuple)):
            seen.add(id(item))
            for element in item:
                visit(element, seen)
        elif hasattr(item, "__dict__"):
            seen.add(id(item))
            for element in vars(item).values():
                visit(element, seen)

    visit(value, set())
    return sum(storages.values())


_KV, _SHIFT = 0, 1  # recurrent-state slots of a FavorCacheLayer


def passed_through(layer, key_states: torch.Tensor, value_states: torch.Tensor):
    """What a constant-state layer's ``update`` returns to a transformers attention module: the new keys and
    values themselves (the state absorbs them when the attention runs), the keys as an alias that carries
    the layer as ``performer_cache_layer``, so the attention function that receives them finds its state."""
    keys = key_states.view_as(key_states)  # the same storage; a new tensor object to carry the layer
    keys.performer_cache_layer = layer
    return keys, value_states


class _BatchFirstState:
    """Beam search and batch selection for a cache layer whose state tensors all have the batch first:
    each applies one indexing to every tensor through the layer's ``_select(index_fn)``."""

    def _select(self, index_fn) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda state: state.index_select(0, beam_idx.to(state.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda state: state.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda state: state[indices])

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens, or with ``max_length <= 0`` drop ``-max_length`` from the end
        (transformers' ``Cache.crop(-n)``; ``crop(0)``, which assisted decoding calls when every draft token was
        accepted, drops none), as assisted decoding rolls back rejected draft tokens: refused past the tokens held,
        since the method's state sums or selects from every earlier token and cannot give one back."""
        length = self.get_seq_length()
        keep = max_length if max_length > 0 else length + max_length
        if keep >= length:
            return
        raise ValueError(
            f"the {type(self).__name__} holds a decoding state built from every earlier token, which cannot be "
            f"cropped from {length} back to {keep} tokens (assisted or prompt-lookup decoding rolls back draft "
            "tokens): generate without an assistant or prompt lookup, or with attention_kernel='exact'."
        )

    def held_batch_size(self) -> int | None:
        """How many sequences the state holds (None before the first token)."""
        state = self.get_state()
        tensors = [] if state is None else [t for t in state if torch.is_tensor(t)]
        return tensors[0].shape[0] if tensors else None


class FavorCacheLayer(_BatchFirstState, LinearAttentionLayer, CacheLayerMixin):
    """One layer's recurrent FAVOR+ state: ``kv`` (B, H, m, d + 1) and ``shift`` (B, H), kept in float32.

    It is a ``LinearAttentionLayer`` (so beam-search reordering and resets work as for other recurrent
    models) and a ``CacheLayerMixin`` that reports how many tokens it has absorbed.
    """

    _layer_type = "favor_attention"
    # The prompt's 2D padding mask must reach the model: a compileable cache would make `generate` turn
    # it into a 4D mask, which linear attention has no use for.
    is_compileable = False
    is_sliding = False

    def __init__(self, **kwargs):
        CacheLayerMixin.__init__(self)
        LinearAttentionLayer.__init__(self, number_of_states=2)
        self.cumulative_length = 0

    def get_state(self) -> FavorState | None:
        """The state after the tokens seen so far, or ``None`` before the first one."""
        if not self.has_previous_state[_KV]:
            return None
        return FavorState(kv=self.recurrent_states[_KV], shift=self.recurrent_states[_SHIFT])

    def update_state(self, state: FavorState, num_new_tokens: int) -> FavorState:
        """Store the state after ``num_new_tokens`` more tokens; returns the stored state."""
        for slot in (_KV, _SHIFT):  # buffers made under torch.inference_mode cannot be written outside it: new ones
            held = self.recurrent_states[slot] if self.is_recurrent_states_initialized[slot] else None
            if held is not None and held.is_inference() and not torch.is_inference_mode_enabled():
                self.is_recurrent_states_initialized[slot] = False
        kv = self.update_recurrent_state(state.kv.detach(), _KV)
        shift = self.update_recurrent_state(state.shift.detach(), _SHIFT)
        self.has_previous_state[_KV] = self.has_previous_state[_SHIFT] = True
        self.cumulative_length += num_new_tokens
        return FavorState(kv=kv, shift=shift)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Called by transformers attention modules before attention: nothing is stored here (the state
        absorbs the tokens in :meth:`update_state`); see :func:`passed_through`."""
        return passed_through(self, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        super().reset()
        for slot in (_KV, _SHIFT):  # the next sequences may be another batch: new buffers at their first state
            self.is_recurrent_states_initialized[slot] = False
        self.cumulative_length = 0

    def _select(self, index_fn) -> None:
        for slot in (_KV, _SHIFT):
            if self.is_recurrent_states_initialized[slot]:
                self.recurrent_states[slot] = index_fn(self.recurrent_states[slot])


class _TupleStateLayer(_BatchFirstState, CacheLayerMixin):
    """A cache layer holding its method's state as one ``NamedTuple`` whose tensors all have the batch first and whose
    ``length`` counts the tokens seen: the attention function reads it (:meth:`get_state`) and stores the next one
    (:meth:`update_state`); transformers' attention modules get their new keys passed through (:meth:`update`)."""

    is_compileable = False  # as for FavorCacheLayer: generate must pass the 2D padding mask through
    is_sliding = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate ahead: the first :meth:`update_state` stores the state."""

    def get_state(self):
        """The state after the tokens seen so far, or ``None`` before the first one."""
        return self.state

    def update_state(self, state):
        """Store the state a method returned with ``return_state=True`` (detached); returns it."""
        # tensors without gradients are kept as they are: still views of the buffers they grow in (sparse attention)
        self.state = type(state)(*(t.detach() if torch.is_tensor(t) and t.requires_grad else t for t in state))
        self.is_initialized = True
        return self.state

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """As :meth:`FavorCacheLayer.update`: the new keys and values pass through to the attention function."""
        return passed_through(self, key_states, value_states)

    def get_seq_length(self) -> int:
        return 0 if self.state is None else self.state.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        """Nothing to offload: the state stays where the model runs."""

    def prefetch(self):
        """Nothing to prefetch."""

    def reset(self) -> None:
        self.state = None
        self.is_initialized = False

    def _select(self, index_fn) -> None:
        if self.state is not None:
            self.state = type(self.state)(*(index_fn(t) if torch.is_tensor(t) else t for t in self.state))


class HybridCacheLayer(_TupleStateLayer):
    """One layer's :class:`HybridState` (far-field state, window buffer, global keys), constant in size; with
    ``exact_max_length``, the keys and values of the first positions instead, until the sequence passes it.
    """

    _layer_type = "hybrid_attention"

    def __init__(self, **kwargs):
        super().__init__()
        self.state: HybridState | None = None
        # the keys and values of the first positions, while the model attends to them exactly (exact_max_length)
        self.prefix: tuple[torch.Tensor, torch.Tensor] | None = None

    def update_state(self, state: HybridState) -> HybridState:
        """Store the state returned by ``hybrid_attention(..., return_state=True)``; returns it."""
        self.prefix = None
        return super().update_state(state)

    def get_exact_prefix(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values (B, H, P, D) of the tokens seen so far while they are attended exactly, or None."""
        return self.prefix

    def update_exact_prefix(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the keys and values (B, H, P, D) of every token so far (all of them below ``exact_max_length``)."""
        self.prefix = (keys.detach(), values.detach())
        self.is_initialized = True

    def get_seq_length(self) -> int:
        if self.prefix is not None:
            return self.prefix[0].shape[2]
        return super().get_seq_length()

    def reset(self) -> None:
        super().reset()
        self.prefix = None

    def _select(self, index_fn) -> None:
        super()._select(index_fn)
        if self.prefix is not None:
            self.prefix = tuple(index_fn(t) for t in self.prefix)


class SparseCacheLayer(_TupleStateLayer):
    """One layer's :class:`SparseState`: the keys and values of the window, the global tokens and the pool of key
    blocks the queries select from, per key/value head (grouped-query models are not repeated). Bounded in the
    context length with ``select_budget``; every block otherwise.

    It registers the cache layer type ``"sparse_attention"``: a config whose ``layer_types`` names it (the Performer
    family's) gets one per layer from ``DynamicCache(config=...)``, what ``generate`` builds with no argument.
    """

    _layer_type = "sparse_attention"

    def __init__(self, **kwargs):
        super().__init__()
        self.state: SparseState | None = None


if not __name__.startswith("performer_hf."):
    # a checkpoint's copy of this module (trust_remote_code), loaded beside performer_hf or another copy: the layers
    # registered first stay, so that caches built from a config hold the classes the package checks for
    for _name, _layer in _REGISTERED_BEFORE.items():
        if _layer is not None:
            DYNAMIC_LAYER_TYPE_MAPPING[_name] = _layer

__all__ = ["FavorCacheLayer", "HybridCacheLayer", "SparseCacheLayer", "held_bytes"]
