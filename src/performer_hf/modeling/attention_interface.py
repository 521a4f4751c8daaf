"""FAVOR+ and hybrid attention as transformers attention implementations, for any model class.

``import performer_hf`` registers three names with transformers' ``AttentionInterface`` (the attention) and
``AttentionMaskInterface`` (the masks they take):

- ``"performer"``: plain FAVOR+ (positive orthogonal random features);
- ``"performer_hybrid"``: the hybrid method (exact window / global / routed keys, a linear far field);
- ``"performer_sparse"``: the sparse method, causal only (exact window, first tokens and selected key blocks).

so that ``AutoModelForCausalLM.from_pretrained(folder, attn_implementation="performer_hybrid")`` swaps the
attention of a Llama, Mistral, Qwen2 / Qwen3, Gemma3, GPT-2 or BERT model and keeps everything else. The
attention itself is the Performer family's (``modeling/attention_methods.py``): one implementation of each
method. The settings live in the model's config (``attention_settings.py``).

What the adapter does around those methods:

- layers that the model's ``config.layer_types`` marks ``"sliding_attention"`` (Gemma3's local layers, Qwen2's
  optional ones) keep their own attention (SDPA with the model's sliding-window mask). Models that slide on
  every layer without naming layer types (Mistral) get Performer attention everywhere, over the whole context;
- rotary positions: the model applies them to q and k before calling the function, so the feature maps see
  rotated queries and keys;
- grouped-query attention: the key/value heads are repeated to the query heads, except for methods that take
  them as they are (``AttentionMethod.grouped_kv``: the sparse method keeps its state per key/value head);
- ``scaling``: q is rescaled so that q.k times the method's ``head_dim ** -0.5`` is the model's q.k * scaling
  (Gemma3's ``query_pre_attn_scalar``, GPT-2's per-layer scaling);
- padding: the registered mask function hands the attention the 2D ``(B, P + L)`` padding mask (or None);
- decoding: with the method's own cache layer (a :class:`~performer_hf.PerformerCache`, or the
  ``DynamicCache`` that ``generate`` builds when the config's ``layer_types`` name the layer), the layer's state
  (the cache layer passes the new keys through, marked with itself). A sequence's first call without gradients
  builds that layer too, and hands it to a plain key/value cache at the next call (``interface_cache.py``), so plain
  ``generate()`` decodes from the method's state. Otherwise, with a key/value cache, the method runs over every
  cached key again, as a full forward would (the sparse method with every block kept reads the cached keys in
  place).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention_methods import ATTENTION_METHODS
from .attention_settings import IMPLEMENTATIONS, keeps_own_attention, method_state, mixes_sliding_and_full_layers
from .cache_performer import static_cache_refusal
from .implied_attention import implied_attention
from .interface_cache import CACHE_KEYWORD, adopt_on_next_call, dropped_keys_refusal, watch_caches
from .method_exact import softmax_attention
from .sink_order import sinks_first

Tensor = torch.Tensor


# Set by attention transfer (``attention_transfer.py``) while it trains the methods' parameters: called as
# ``hook(state, attend, q, k, v, key_mask, causal, window)`` on the prepared inputs (``attend(q, k, v, key_mask,
# causal)``: the method as the model runs it; ``window``: the model's sliding window, or None), it returns the
# context (B, H, L, D) the model continues with (the source's own attention, so every layer learns from the
# source's inputs).
TRANSFER_HOOK: ContextVar[Callable | None] = ContextVar("performer_transfer_hook", default=None)
# how many ``transfer_hooked`` blocks are open, in any thread: while none is, attention does not read the hook
# (torch.compile of torch 2.11 cannot trace ``ContextVar.get``: a graph break at every call; it guards on an int).
# Counted under a lock: a count lost to two threads' ``+=`` would hide an open block's hook
_open_transfer_blocks = 0
_transfer_blocks_lock = threading.Lock()


@contextmanager
def transfer_hooked(hook: Callable):
    """Performer attention calls ``hook`` in place of the method (``TRANSFER_HOOK``) within the block."""
    global _open_transfer_blocks
    token = TRANSFER_HOOK.set(hook)
    with _transfer_blocks_lock:
        _open_transfer_blocks += 1
    try:
        yield
    finally:
        with _transfer_blocks_lock:
            _open_transfer_blocks -= 1
        TRANSFER_HOOK.reset(token)


def _transfer_hook() -> Callable | None:
    return TRANSFER_HOOK.get() if _open_transfer_blocks else None


def performer_mask(*, attention_mask=None, kv_length: int, local_size: int | None = None, **kwargs):
    """The mask function of every name: the 2D ``(B, kv_length)`` bool padding mask (True: a real token) for
    Performer layers, None when nothing is padded (eager; traced, the mask as given: no host read, no graph break);
    SDPA's 4D mask for the sliding layers that keep their own attention (``local_size`` is the window the sliding
    mask builders pass)."""
    config = kwargs["config"]
    if local_size is not None and mixes_sliding_and_full_layers(config):
        return sdpa_mask(attention_mask=attention_mask, kv_length=kv_length, local_size=local_size, **kwargs)
    q_offset, q_length, kv_offset = kwargs.get("q_offset"), kwargs.get("q_length"), kwargs.get("kv_offset", 0)
    if q_offset is not None and q_length is not None and kv_offset + kv_length != int(q_offset) + q_length:
        # keys the cache does not place right after the earlier ones: a static cache's empty slots
        raise ValueError(
            static_cache_refusal(
                f"{kv_length} key slots for {int(q_offset)} earlier and {q_length} new tokens",
                "Leave cache_implementation unset (generate() builds the cache), or pass "
                f"{CACHE_KEYWORD}=PerformerCache(model.config) (performer_hf).",
            )
        )
    if attention_mask is None:
        return None
    batch_size = kwargs.get("batch_size", attention_mask.shape[0])
    # every key's: a sliding-window cache layer's sizes start at its window (kv_offset), but Performer attention
    # reads every key, and the layer keeps them all from the next call's hook on (a model's first call with a cache
    # registers it after the mask of the call that follows is built)
    kv_length = kv_length + kv_offset
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size or attention_mask.shape[1] < kv_length:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, but the inputs are {batch_size} sequence(s) of "
            f"{kv_length} tokens (earlier and new ones): Performer attention takes the tokenizer's (batch, length) "
            "padding mask covering every token."
        )
    mask = attention_mask[:, -kv_length:]  # (B, P + L)
    if torch.compiler.is_compiling():  # traced: the mask as it is (a host read of its padding would break the graph)
        return mask
    return None if bool(mask.all()) else mask


def _key_mask(attention_mask):
    """The (B, P + L) padding mask from what the mask function produced (or a user's mask)."""
    if attention_mask is None or attention_mask.dim() == 2:
        return attention_mask
    raise ValueError(
        f"Performer attention takes a 2D padding mask, got a {attention_mask.dim()}D attention mask of shape "
        f"{tuple(attention_mask.shape)}: linear attention cannot apply an arbitrary (query x key) mask. Pass the "
        "(batch, length) attention_mask of the tokenizer instead."
    )


def _performer_attention(implementation: str):
    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[Tensor, Tensor | None]:
        """q (B, H, Lq, D), k and v (B, H_kv, Lk, D) with rotary positions applied -> ((B, Lq, H, D), the attention
        weights (B, H, Lq, Lk) with ``output_attentions``, else None)."""
        _check_no_logit_terms(module, kwargs)
        if keeps_own_attention(module.config, module.layer_idx):
            return _own_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        causal = kwargs.get("is_causal", getattr(module, "is_causal", False))
        cached_keys = key  # as the caller's cache layer returned them (B, H_kv, Lk, D)
        state = method_state(module, implementation, causal, query)
        if causal:
            watch_caches(module)
        layer_cache = getattr(key, "performer_cache_layer", None)
        if layer_cache is not None:
            _check_cache_layer(layer_cache, state.attention_method, module.layer_idx, query.shape[0])
        # tokens attended before this call: held in a key/value cache (the keys passed) or in the method's state
        past = key.shape[2] - query.shape[2] + (0 if layer_cache is None else layer_cache.get_seq_length())
        head_dim = query.shape[-1]
        if scaling is not None and scaling != head_dim**-0.5:
            query = query * (scaling * head_dim**0.5)  # the methods scale q.k by head_dim ** -0.5
        groups = query.shape[1] // key.shape[1]
        transfer = _transfer_hook()
        grouped_kv = ATTENTION_METHODS[state.attention_method].grouped_kv and transfer is None
        if groups > 1 and not grouped_kv:  # grouped-query attention: each key/value head serves `groups` query heads
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # (B, H, Lk, D)
        key_mask = _key_mask(attention_mask)
        if (
            layer_cache is None
            and transfer is None
            and kwargs.get("use_cache") is not False
            and _starts_own_state(state, query, key, causal)
        ):
            # a sequence's first call, without gradients: the method's state is kept as well, and handed to the
            # caller's key/value cache at the next call (so that plain generate() decodes from the state); not where
            # the model was told use_cache=False (the architectures that pass it on to attention say so)
            layer_cache = ATTENTION_METHODS[state.attention_method].cache_layer()
            layer_cache.update(key, value)
            adopt_on_next_call(module, layer_cache, cached_keys, key_mask)
        if layer_cache is None and state.attention_method != "exact" and key.shape[2] > query.shape[2]:
            _check_no_dropped_keys(module, key, query, kwargs)
        attend = partial(state.attend, state)
        # a left-padded row's global tokens: its first real tokens, as alone
        attend = sinks_first(attend, state.sinks_moved_per_call(causal), key_mask, query.shape[2], key.shape[2])
        if transfer is not None:
            context = transfer(state, attend, query, key, value, key_mask, causal, kwargs.get("sliding_window"))
        elif state.attention_method == "exact":
            window = kwargs.get("sliding_window")  # Mistral's, where its config names one
            if key_mask is not None and key_mask.shape[1] > key.shape[2]:  # a sliding-window layer kept its window
                key_mask = key_mask[:, -key.shape[2] :]
            context, _ = softmax_attention(
                query, key, value, key_mask, causal, dropout if module.training else 0.0, window=window
            )
        elif layer_cache is not None or key.shape[2] == query.shape[2] or grouped_kv:
            context, _ = attend(query, key, value, key_mask, causal, layer_cache)  # (B, H, Lq, D)
        else:  # a key/value cache: the method over every key, the past queries as placeholders
            context = _over_cached_keys(attend, query, key, value, key_mask, causal)
        weights = None
        if kwargs.get("output_attentions"):  # the matrix the method implies (B, H, Lq, Lk): identity values
            held = past  # earlier tokens whose keys the method's state holds instead of this call's keys
            if state.attention_method == "exact":  # softmax's, within the sliding window where the model has one
                window = kwargs.get("sliding_window")
                attend, held = partial(softmax_attention, window=window), 0  # over every cached key
            weights = implied_attention(lambda values: attend(query, key, values, key_mask, causal)[0], value, held)
        return context.transpose(1, 2).contiguous(), weights

    attention.__name__ = attention.__qualname__ = f"{implementation}_attention"
    return attention


# what some architectures add to their attention logits, which neither Performer attention nor SDPA (its sliding
# layers') applies: Gemma2's soft-capping (its config's attn_logit_softcapping), gpt-oss's attention sinks
_LOGIT_TERMS = {"softcap": "soft-capping", "s_aux": "attention sinks", "sinks": "attention sinks"}


def _check_no_logit_terms(module: nn.Module, kwargs: dict) -> None:
    """Refuse a model whose attention adds terms to its logits (rather than drop them: other logits, silently)."""
    given = [name for name in _LOGIT_TERMS if kwargs.get(name) is not None]
    if given:
        terms = " and ".join(sorted({_LOGIT_TERMS[name] for name in given}))
        raise ValueError(
            f"{type(module).__name__} passes {', '.join(given)} to its attention function ({terms} of its logits), "
            "which Performer attention does not apply: load the model with another attn_implementation (a config "
            "whose attn_logit_softcapping is None passes no softcap, with other outputs)."
        )


def _own_attention(module, query, key, value, attention_mask, scaling, dropout, output_attentions=False, **kwargs):
    """The attention of a sliding layer that keeps its own: SDPA, and with ``output_attentions`` its weights (SDPA
    forms none: its output for identity values, (B, H, Lq, Lk); decoding too, as its key/value cache holds the keys)."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    context, _ = sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    weights = None
    if output_attentions:
        weights = implied_attention(
            lambda values: sdpa(module, query, key, values, attention_mask, scaling=scaling, **kwargs)[0].transpose(
                1, 2
            ),
            value,
        )
    return context, weights


def _check_cache_layer(layer_cache, method: str, layer_idx: int, batch_size: int) -> None:
    """Refuse a method cache layer that is not this method's (a ``PerformerCache`` built for another model), or
    that holds the state of another number of sequences (a cache kept from another batch)."""
    expected = ATTENTION_METHODS[method].cache_layer
    if expected is None or not isinstance(layer_cache, expected):
        raise ValueError(
            f"the cache's layer {layer_idx} is a {type(layer_cache).__name__}, but this model's attention there is the "
            f"{method!r} method: build the cache from this model's config, PerformerCache(model.config)."
        )
    held = layer_cache.held_batch_size()
    if held is not None and held != batch_size:
        raise ValueError(
            f"the cache holds the state of {held} sequence(s), but this call has {batch_size}: a cache continues the "
            "batch it was filled with; start a new PerformerCache(model.config) for another batch."
        )


def _check_no_dropped_keys(module: nn.Module, key: Tensor, query: Tensor, kwargs: dict) -> None:
    """Refuse the keys of a sliding-window key/value layer that dropped some (Mistral's ``sliding_window``): the
    new queries' positions lie past the keys it returned. Its layers keep every key from a model's first call with
    them on (:func:`.watch_caches`); this is the first call's check."""
    window, positions = kwargs.get("sliding_window"), kwargs.get("position_ids")
    if window is None or positions is None or torch.compiler.is_compiling():
        return
    total = int(positions[:, -1].max()) + 1  # left padding only lowers the positions
    if total > key.shape[2]:
        kept = key.shape[2] - query.shape[2]
        raise ValueError(dropped_keys_refusal(module.layer_idx, kept, total - query.shape[2], window))


def _starts_own_state(state, query: Tensor, key: Tensor, causal: bool) -> bool:
    """Whether a call begins a decoder's sequence (no earlier keys), without gradients, with a method whose decoding
    keeps a state of its own: FAVOR+, the hybrid and the sparse method (bounded, or every block kept: its state
    grows in place where a key/value cache copies itself at every step, and it holds every position where a
    sliding-window key/value layer would drop them)."""
    method = ATTENTION_METHODS[state.attention_method]
    return causal and method.cache_layer is not None and key.shape[2] == query.shape[2] and not torch.is_grad_enabled()


def _over_cached_keys(attend, query: Tensor, key: Tensor, value: Tensor, key_mask, causal: bool) -> Tensor:
    """The method's output (``attend(q, k, v, key_mask, causal)``) for the Lq new queries over the P + Lq keys of a
    key/value cache (B, H, Lq, D): causal attention's output at a position depends only on the keys up to it, so the
    past queries' values do not matter."""
    if not causal:
        raise ValueError("Performer attention over cached keys is causal only (a decoder's key/value cache).")
    past = key.shape[2] - query.shape[2]
    padded = torch.cat([query.new_zeros(*query.shape[:2], past, query.shape[-1]), query], dim=2)  # (B, H, Lk, D)
    context, _ = attend(padded, key, value, key_mask, causal)
    return context[:, :, past:]


ATTENTION_FUNCTIONS = {name: _performer_attention(name) for name in IMPLEMENTATIONS}


def register_attention_implementations(replace: bool = True) -> None:
    """Register the names of :data:`.IMPLEMENTATIONS` with transformers (done by ``import performer_hf``). With
    ``replace=False`` (the remote code of a converted folder), names registered already are left as they are."""
    for name, function in ATTENTION_FUNCTIONS.items():
        if replace or name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, function)
            AttentionMaskInterface.register(name, performer_mask)
