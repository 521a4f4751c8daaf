"""Attention calls (and the token loss's chunks) compiled on CUDA devices: ``torch.compile`` fuses the elementwise
work around their matrix products and FlexAttention calls, which eager PyTorch runs as hundreds of separate kernels
per call.

Measured on an H200 (bfloat16, one bidirectional call of 12 heads x 32K tokens x 32 dims, forward + backward,
``benchmarks/results/attention_parts_h200``): FAVOR+ 10.96 -> 6.13 ms (flash attention: 26.8 ms), the hybrid
218.5 -> 39.2 ms. Every call without a cache is compiled: FAVOR+ and the hybrid, bidirectional and causal (each a
graph without breaks), and a decoder's prefill (FAVOR+'s with its state, which padding keys leave as it is; the
hybrid's state, which holds the last keys themselves, apart: ``hybrid_prefill_state`` compiled as well, with
dynamic lengths from a second one on), and a decoding step (:func:`decode_step`). The CPU keeps its own kernels
(``cpu_kernels``, ``hybrid_compiled``) and eager PyTorch.

- :func:`compile_settings`: every kind of call (method, mask, score, gradient mode, length bucket) compiles its own
  graphs, more than dynamo's default limit of 8 per function (and 256 in all); past its limit dynamo would silently
  run the function eagerly (for FlexAttention: the whole (L, L) score matrix, 96 GiB at 32K tokens). So higher
  limits, and an error instead of that fallback.
- :func:`call_compiled`: a function's call compiled where the inputs live on a device in
  :data:`COMPILED_DEVICES` (once for a first shape, again for a second, then with dynamic shapes); eager
  elsewhere, inside a caller's own compiled region, with ``PERFORMER_HF_COMPILE=0``, and on a torch without those
  settings.
- :func:`call_compiled_attention`: an attention call compiled at a bucketed length (:func:`bucket_length`), its
  padding masked out. The attention functions cut long inputs into slabs whose count and sizes depend on the length,
  so their graphs hold for one length only: without buckets, a training run on varied lengths compiled a graph for
  every length it met, then failed at the limit.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

# graphs per function: up to 8 length buckets per octave (bucket_length), with and without a mask, for training and
# inference; and in all. The first two exist in torch >= 2.7, which compile_enabled() requires.
COMPILE_LIMITS = {"recompile_limit": 256, "fail_on_recompile_limit_hit": True, "accumulated_recompile_limit": 2048}
_REQUIRED = ("recompile_limit", "fail_on_recompile_limit_hit")
logger = logging.getLogger(__name__)
COMPILED_DEVICES = ("cuda",)
BACKEND = "inductor"  # the tests compile on the CPU with "aot_eager": the same graphs, without code generation


def compile_enabled() -> bool:
    """Whether calls may be compiled: ``PERFORMER_HF_COMPILE`` is not ``0``, and this torch has the recompile limit
    and its error (torch >= 2.7; older ones run eagerly, as without a GPU)."""
    return os.environ.get("PERFORMER_HF_COMPILE", "1") != "0" and _has_settings()


@functools.cache
def compile_settings() -> dict:
    """The dynamo settings every compiled call runs under (:data:`COMPILE_LIMITS`, those this torch has)."""
    return {name: value for name, value in COMPILE_LIMITS.items() if hasattr(torch._dynamo.config, name)}


@functools.cache
def _has_settings() -> bool:
    return all(name in compile_settings() for name in _REQUIRED)


@functools.cache
def _compiled(function: Callable, backend, dynamic: bool | None) -> Callable:
    return torch.compile(function, backend=backend, dynamic=dynamic)


def compiles(device: torch.device) -> bool:
    """Whether calls on ``device`` run compiled here (see :func:`call_compiled`)."""
    return device.type in COMPILED_DEVICES and compile_enabled() and not torch.compiler.is_compiling()


def call_compiled(function: Callable, device: torch.device, *args, **kwargs):
    """``function(*args, **kwargs)``, through ``torch.compile`` when ``device`` is one of :data:`COMPILED_DEVICES`
    (under :func:`compile_settings`); directly elsewhere, when already compiling, or when compiling is off."""
    if not compiles(device):
        return function(*args, **kwargs)
    with torch._dynamo.config.patch(compile_settings()):
        return _compiled(function, BACKEND, None)(*args, **kwargs)


def decode_step(function: Callable, q, k, v, *args, initial_state, **kwargs):
    """A causal method's decoding step, ``function(q, k, v, *args, initial_state=initial_state, return_state=True,
    **kwargs)`` for one new token (q, k, v: (B, H, 1, .)) after ``initial_state``, through :func:`call_compiled`: its
    few hundred small operations (the hybrid's window, global keys and far field; FAVOR+'s state) in a handful of
    fused kernels, where eagerly each is a kernel launch of its own per layer and token. One graph for a first step,
    then one with dynamic sizes (the past's length, a state buffer still filling), shared by the layers. Returns
    ``(output, state)``."""
    return call_compiled(function, q.device, q, k, v, *args, initial_state=initial_state, return_state=True, **kwargs)


# the kinds of attention call (function, dtype, head dims) whose compiled graph needed more shared memory than the GPU
# has: eager from then on
_EAGER_KINDS: set[tuple] = set()


def bucket_length(length: int) -> int:
    """The length a compiled attention call runs at: ``length`` rounded up to a multiple of an eighth of the power of
    two at or below it (at most 12.5% more; powers of two unchanged), so that the lengths of one octave share at
    most 8 graphs."""
    granule = 1 << max(0, length.bit_length() - 4)
    return -(-length // granule) * granule


def call_compiled_attention(function: Callable, q, k, v, *args, key_padding_mask=None, **kwargs):
    """``function(q, k, v, *args, key_padding_mask=key_padding_mask, **kwargs)`` for self-attention inputs
    (B, H, L, .) and a key mask (B, L) (True or 1: a real token) or None, compiled as :func:`call_compiled` does, at
    :func:`bucket_length`: the inputs padded at the end with keys the mask leaves out (queries and keys see no
    padding, causally or not), the padded queries' outputs dropped (of an ``(output, state)`` pair, the output's).
    One static graph per bucket. A kind of call whose graph needs more GPU shared memory than there is runs eagerly
    from then on, with a warning."""
    length, kind = q.shape[2], (function, q.dtype, q.shape[-1], v.shape[-1])
    if not compiles(q.device) or kind in _EAGER_KINDS:
        return function(q, k, v, *args, key_padding_mask=key_padding_mask, **kwargs)
    padded, mask = (q, k, v), key_padding_mask
    extra = bucket_length(length) - length
    if extra and k.shape[2] == length:
        if mask is None:
            mask = torch.ones(q.shape[0], length, dtype=torch.bool, device=q.device)
        mask = F.pad(mask.bool(), (0, extra), value=False)  # (B, L + extra)
        padded = tuple(F.pad(t, (0, 0, 0, extra)) for t in (q, k, v))  # (B, H, L + extra, .)
    try:
        with torch._dynamo.config.patch(compile_settings()):
            result = _compiled(function, BACKEND, False)(*padded, *args, key_padding_mask=mask, **kwargs)
        if isinstance(result, tuple):  # (B, H, L + extra, .) and a state
            return result[0][:, :, :length], *result[1:]
        return result[:, :, :length]
    except Exception as error:  # Triton's "out of resource" (shared memory) comes as inductor's own error types
        if "out of resource" not in str(error):
            raise
    _EAGER_KINDS.add(kind)  # a failed compilation is not cached: it would be tried again at every call
    logger.warning(
        "%s compiled needs more GPU shared memory than this GPU has (%s, head dims %d / %d): it runs eagerly, its "
        "FlexAttention calls compiled on their own (with smaller tiles where needed).",
        function.__name__,
        q.dtype,
        q.shape[-1],
        v.shape[-1],
    )
    return function(q, k, v, *args, key_padding_mask=key_padding_mask, **kwargs)
