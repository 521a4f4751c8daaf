"""Hybrid attention as an attention method (``attention_method="hybrid"``): exact softmax on the module's sparse
support and a linear far field elsewhere (:func:`.hybrid_attention`), its constant-size decoding state in a
:class:`.HybridCacheLayer`, and the exact prefix of causal models (``exact_max_length``)."""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .compiled_lengths import refuse_dynamic_length
from .device_compile import call_compiled, call_compiled_attention, compiles, decode_step
from .far_fields import get_far_field
from .favor_hybrid import hybrid_attention, hybrid_prefill_state
from .hybrid_spec import HybridSpec, HybridState
from .method_exact import exact_or_approximate, softmax_attention
from .sink_order import check_sinks_in_place, in_sink_order, sink_order, sinks_first, warn_of_short_padded_rows

Tensor = torch.Tensor


def hybrid_layer_settings(config, layer_idx: int) -> dict[str, Any]:
    """What a layer's method state holds for hybrid attention: the :class:`.HybridSpec` derived from the config,
    and the layer's FAVOR++ ``A`` and far-field gain (a float, one per head, or None; plain values, as models are
    also built on the ``meta`` device)."""
    return {
        "hybrid_spec": HybridSpec.from_config(config),
        "far_field_parameter": config.layer_far_field_parameter(layer_idx),
        "far_field_gain": config.layer_far_field_gain(layer_idx),
    }


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
    approximate = functools.partial(_hybrid, module, causal=causal, layer_cache=layer_cache)
    return exact_or_approximate(approximate, module, q, k, v, key_mask, causal, layer_cache)


def _hybrid(module: nn.Module, q, k, v, key_mask, causal, layer_cache=None, after=None) -> Tensor:
    """:func:`.hybrid_attention` with the module's settings, after ``after`` (the state of an exact prefix) or
    continuing from ``layer_cache``'s state, and updating it. Where calls compile (CUDA), a call without a cache, a
    prefill (its state computed apart) and a decoding step are compiled; a prefill in chunks after a cache's own
    state is not (each length of the past and of the chunk would compile its own graph)."""
    if not causal:
        refuse_dynamic_length(
            q.shape[2], "the bidirectional hybrid", "or a range within exact_max_length (exact attention)"
        )
    projection, kwargs = _call_settings(module, q.device, causal, key_mask, q.shape[2])
    spec = module.hybrid_spec
    with torch.autocast(q.device.type, enabled=False):  # float32 inside, as for FAVOR+
        if layer_cache is None:  # compiled on CUDA (device_compile)
            return call_compiled_attention(hybrid_attention, q, k, v, projection, spec, initial_state=after, **kwargs)
        state = layer_cache.get_state() if after is None else after
        if state is None:  # a state from this call's tokens alone: its global tokens are fixed after them
            warn_of_short_padded_rows(kwargs["key_padding_mask"], spec.num_global_tokens, "hybrid")
        if (after is not None or state is None) and compiles(q.device):  # a prefill: output compiled, state apart
            context = call_compiled_attention(
                hybrid_attention, q, k, v, projection, spec, initial_state=after, **kwargs
            )
            state = _prefill_state(module, k, v, projection, after, kwargs)
        elif q.shape[2] == 1 and compiles(q.device):  # a decoding step (decode_step)
            context, state = decode_step(hybrid_attention, q, k, v, projection, spec, initial_state=state, **kwargs)
        else:
            context, state = hybrid_attention(
                q, k, v, projection, spec, initial_state=state, return_state=True, **kwargs
            )
    layer_cache.update_state(state)
    return context


def _prefill_state(module: nn.Module, k, v, projection, after: HybridState | None, kwargs: dict) -> HybridState:
    """The hybrid's state after the keys and values (B, H, L, .) of a prefill (after ``after``, or from the first
    token; ``kwargs``: :func:`_call_settings`'), as decoding reads it: compiled where calls compile, since eagerly it
    is about a hundred small kernels per layer. One graph for a first length, then one with dynamic lengths
    (:func:`.call_compiled`); an exact prefix is always ``exact_max_length`` long. The inputs are copied contiguous
    (a few megabytes): as views of a longer sequence's tensors their strides would follow its length (a graph each).
    The state reads no query: the keys stand in for them."""
    k, v = k.contiguous(), v.contiguous()  # (B, H, L, .)
    mask = kwargs["key_padding_mask"]
    kwargs = {**kwargs, "key_padding_mask": None if mask is None else mask.contiguous()}  # (B, L)
    with torch.autocast(k.device.type, enabled=False):
        return call_compiled(
            hybrid_prefill_state, k.device, k, k, v, projection, module.hybrid_spec, initial_state=after, **kwargs
        )


def _exact_prefix_state(module: nn.Module, k, v, key_mask) -> HybridState:
    """The hybrid's state after the positions of an exact prefix, from their keys and values (B, H, T, .) and the
    key mask (B, >= T) or None: what the queries after it read (their far field, window buffer and global keys)."""
    visible = None if key_mask is None else key_mask[:, : k.shape[2]]  # (B, T)
    projection, kwargs = _call_settings(module, k.device, True, visible, k.shape[2])
    return _prefill_state(module, k, v, projection, None, kwargs)


def _call_settings(module: nn.Module, device, causal: bool, key_mask, length: int) -> tuple[Tensor | None, dict]:
    """The module's projection (None where its far field takes none) and the keyword arguments of a hybrid call of
    its last ``length`` tokens (``key_mask``: (B, >= length) or None; the past is in the state)."""
    spec = module.hybrid_spec
    new_key_mask = None if key_mask is None else key_mask[:, -length:]  # (B, length)
    kwargs = {"causal": causal, "key_padding_mask": new_key_mask}
    if causal and spec.center:  # fixed centres: causal outputs must not depend on later tokens
        kwargs.update(query_center=module.query_center, key_center=module.key_center)
    for name in ("far_field_parameter", "far_field_gain"):
        if getattr(module, name) is not None:
            kwargs[name] = _setting_tensor(module, name, device)
    return (module.projection if spec.uses_projection else None), kwargs


def _setting_tensor(module: nn.Module, name: str, device: torch.device) -> Tensor | float | list:
    """The module's per-layer setting ``name`` (a float, one per head, or a tensor) where calls run compiled: as a
    float64 tensor on ``device``, made once per value and device (as numbers, each layer's values would be constants
    of a compiled graph: a graph per layer). Elsewhere as it is."""
    value = getattr(module, name)
    if torch.is_tensor(value) or not compiles(device):  # learned (attention transfer); eager
        return value
    key = (name, device, tuple(value) if isinstance(value, list) else value)
    made = module.__dict__.setdefault("_setting_tensors", {})
    if key not in made:
        made[key] = torch.tensor(value, dtype=torch.float64, device=device)
    return made[key]


def _causal_exact_prefix(module: nn.Module, q, k, v, key_mask, layer_cache) -> tuple[Tensor, None]:
    """Causal hybrid attention whose first ``T = module.exact_max_length`` positions attend exactly (SDPA).

    The rule is by position, so that cached decoding equals a full forward: queries at positions below T see
    every earlier key exactly (the cache layer keeps their keys and values until then); from position T on, the
    hybrid itself, after the state of the first T positions (the cache layer switches to its constant-size state
    when the sequence passes T).

    A left-padded row's global tokens are its first real tokens. A call from the first position that passes T moves
    them in front of the row's pads (:func:`.sinks_first`; a row padded past T would otherwise start the hybrid with
    pads as its global tokens); a later call orders the exact prefix's keys when it builds the state from them, and
    is refused where a padded row's first real tokens come after the prefix."""
    T = module.exact_max_length
    past = 0 if layer_cache is None else layer_cache.get_seq_length()
    prefix = None if layer_cache is None else layer_cache.get_exact_prefix()  # (B, H, P, D) keys, values
    if past and prefix is None:  # decoding past the prefix: the hybrid's state
        return _hybrid(module, q, k, v, key_mask, True, layer_cache), None
    if past:
        k, v = torch.cat([prefix[0], k], dim=2), torch.cat([prefix[1], v], dim=2)  # (B, H, P + L, D)
    total = k.shape[2]
    within = statically_known_true(total <= T)  # every query in the prefix (a dynamic length within it exports)
    if not within:
        refuse_dynamic_length(
            total,
            "a causal hybrid with an exact prefix",
            f"a range within its {T} exact positions, or set exact_max_length=0",
        )
    # queries before it attend exactly (within the prefix, no min: torch 2.11's export could not simplify it)
    exact_end = total if within else max(past, min(T, total))
    attend = functools.partial(_exact_then_hybrid, module, layer_cache=layer_cache, past=past, exact_end=exact_end)
    count = module.hybrid_spec.num_global_tokens
    if exact_end < total and not past:  # (exact attention alone does not depend on the keys' order)
        attend = sinks_first(attend, count, key_mask, total, total)
    elif exact_end < total and key_mask is not None:
        check_sinks_in_place(key_mask[:, :total], count, exact_end)
    return attend(q, k, v, key_mask)


def _exact_then_hybrid(module: nn.Module, q, k, v, key_mask, layer_cache, past: int, exact_end: int):
    """:func:`_causal_exact_prefix`'s attention of the queries after the ``past`` cached positions, over keys and
    values (B, H, total, D) from the first position: exact before ``exact_end``, the hybrid after the exact
    positions' state from there on. -> (context (B, H, total - past, D), None)"""
    total = k.shape[2]
    visible = None if key_mask is None else key_mask[:, :exact_end]
    context, _ = softmax_attention(q[:, :, : exact_end - past], k[:, :, :exact_end], v[:, :, :exact_end], visible, True)
    if exact_end == total:
        if layer_cache is not None:
            layer_cache.update_exact_prefix(k, v)
        return context, None
    # The rest: the hybrid after the exact positions' state; with a cache, its state after them takes over. Its
    # global tokens are each row's first real tokens of the prefix (the exact prefix itself is the same in any key
    # order).
    prefix_keys, prefix_values = k[:, :, :exact_end], v[:, :, :exact_end]
    prefix_mask = None if key_mask is None else key_mask[:, :exact_end]
    order = sink_order(prefix_mask, module.hybrid_spec.num_global_tokens)
    if order is not None:
        prefix_keys, prefix_values, prefix_mask = in_sink_order(order, prefix_keys, prefix_values, prefix_mask)
    after = _exact_prefix_state(module, prefix_keys, prefix_values, prefix_mask)
    if layer_cache is not None:
        layer_cache.reset()
    rest = (t[:, :, exact_end - offset :] for t, offset in ((q, past), (k, 0), (v, 0)))
    hybrid = _hybrid(module, *rest, key_mask, True, layer_cache, after)  # (B, H, total - exact_end, D)
    return torch.cat([context, hybrid], dim=2), None


def hybrid_card_lines(config) -> list[str]:
    """The hybrid-attention settings as card bullet points."""
    routed = (
        f"{config.routed_blocks} blocks of {config.route_block_size} keys per block of {config.query_block_size} "
        "queries, chosen by the mean logit between the blocks (bidirectional only)"
        + (
            f"; only the blocks of the {config.routed_blocks} groups of {config.route_group_size} blocks that may "
            "hold the best ones are scored"
            if config.route_group_size
            else ""
        )
        if config.routed_blocks
        else "none"
    )
    if isinstance(config.far_field_parameter, list):
        parameter = "per layer and head, calibrated or learned at conversion"
    elif config.far_field_parameter is not None:
        parameter = f"{config.far_field_parameter}"
    else:
        parameter = "closed-form optimum from each sequence's statistics"
    lines = [
        f"- exact local window: {config.local_window} tokens" if config.local_window else "- exact local window: none",
        f"- global tokens (exact for every query): {config.num_global_tokens}",
        f"- routed exact key blocks: {routed}",
        "- centred queries and keys before the far field: "
        + (
            "yes (per-sequence means bidirectionally; fixed per-layer centres, calibrated at conversion, when causal)"
            if config.center_features
            else "no"
        ),
    ]
    if get_far_field(config.attention_kernel).uses_parameter:
        lines.append(f"- FAVOR++ parameter A: {parameter}")
    if isinstance(config.far_field_gain, list):
        gains = sorted(gain for row in config.far_field_gain for gain in row)
        lines.append(
            "- far-field gain per layer and head (learned by attention transfer): "
            f"median {statistics.median(gains):.3g}, from {gains[0]:.3g} to {gains[-1]:.3g}"
        )
    elif config.far_field_gain is not None:
        lines.append(f"- far-field gain: {config.far_field_gain}")
    return lines
