"""FAVOR+ as an attention method (``attention_method="favor"``): the paper's linear attention with the module's
random projection, and its constant-size decoding state in a :class:`.FavorCacheLayer`."""

from __future__ import annotations

import functools

import torch
from torch import nn

from .device_compile import call_compiled_attention, compiles, decode_step
from .favor_attention import favor_attention
from .method_exact import exact_or_approximate


def favor_method(module: nn.Module, q, k, v, key_mask, causal, layer_cache=None, output_attentions=False):
    """FAVOR+ (:func:`.favor_attention`) with ``module.projection``; with ``layer_cache``, its
    constant-size :class:`FavorCacheLayer` state holds every earlier token."""
    approximate = functools.partial(_favor, module, causal=causal, layer_cache=layer_cache)
    return exact_or_approximate(approximate, module, q, k, v, key_mask, causal, layer_cache)


def _favor(module: nn.Module, q, k, v, key_mask, causal, layer_cache) -> torch.Tensor:
    """FAVOR+'s context (B, H, L, D), updating ``layer_cache``'s state."""
    length = q.shape[2]
    new_key_mask = None if key_mask is None else key_mask[:, -length:]  # (B, L): past keys live in the state
    kwargs = {
        "causal": causal,
        "kernel": module.kernel,
        "key_padding_mask": new_key_mask,
        "chunk_size": module.chunk_size,
    }
    # The kernel computes in float32 whatever the input dtype; autocast must not lower its
    # exponentials and prefix sums to bf16/fp16.
    with torch.autocast(q.device.type, enabled=False):
        if layer_cache is None:  # compiled on CUDA (device_compile)
            return call_compiled_attention(favor_attention, q, k, v, module.projection, **kwargs)
        if causal and layer_cache.get_state() is None and compiles(q.device):
            # a prefill, compiled with its state: the keys that pad it to its bucket have no features, so the state
            # after them is the state after the prompt
            context, state = call_compiled_attention(
                favor_attention, q, k, v, module.projection, return_state=True, **kwargs
            )
        elif length == 1 and compiles(q.device):  # a decoding step (decode_step)
            context, state = decode_step(
                favor_attention, q, k, v, module.projection, initial_state=layer_cache.get_state(), **kwargs
            )
        else:
            context, state = favor_attention(
                q, k, v, module.projection, initial_state=layer_cache.get_state(), return_state=True, **kwargs
            )
    layer_cache.update_state(state, num_new_tokens=length)
    return context
