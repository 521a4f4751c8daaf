"""Attention calls (and the token loss's chunks) compiled on CUDA devices: ``torch.compile`` fuses the elementwise
work around their matrix products and FlexAttention calls, which eager PyTorch runs as hundreds of separate kernels
per call.

Measured on an H200 (bfloat16, one bidirectional call of 12 heads x 32K tokens x 32 dims, forward + backward,
``benchmarks/results/attention_parts_h200``): FAVOR+ 10.96 -> 6.13 ms (flash attention: 26.8 ms), the hybrid
218.5 -> 39.2 ms. The CPU keeps its own kernels (``cpu_kernels``, ``hybrid_compiled``) and eager PyTorch.

- :data:`COMPILE_SETTINGS`: every kind of call (method, mask, score, gradient mode) compiles its own graphs, more
  than dynamo's default limit of 8 in a process that runs an encoder and a decoder; past its limit dynamo would
  silently run the function eagerly (for FlexAttention: the whole (L, L) score matrix, 96 GiB at 32K tokens). So
  a higher limit, and an error instead of that fallback.
- :func:`call_compiled`: a function's call compiled where the inputs live on a device in
  :data:`COMPILED_DEVICES` (once for a first shape, again for a second, then with dynamic shapes); eager
  elsewhere, inside a caller's own compiled region, with ``PERFORMER_HF_COMPILE=0``, and on a torch without those
  settings.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

COMPILE_SETTINGS = {"recompile_limit": 64, "fail_on_recompile_limit_hit": True}
COMPILED_DEVICES = ("cuda",)
BACKEND = "inductor"  # the tests compile on the CPU with "aot_eager": the same graphs, without code generation


def compile_enabled() -> bool:
    """Whether calls may be compiled: ``PERFORMER_HF_COMPILE`` is not ``0``, and this torch has both
    :data:`COMPILE_SETTINGS` (torch >= 2.7; older ones run eagerly, as without a GPU)."""
    return os.environ.get("PERFORMER_HF_COMPILE", "1") != "0" and _has_settings()


@functools.cache
def _has_settings() -> bool:
    return all(hasattr(torch._dynamo.config, name) for name in COMPILE_SETTINGS)


@functools.cache
def _compiled(function: Callable, backend: str) -> Callable:
    return torch.compile(function, backend=backend)


def call_compiled(function: Callable, device: torch.device, *args, **kwargs):
    """``function(*args, **kwargs)``, through ``torch.compile`` when ``device`` is one of :data:`COMPILED_DEVICES`
    (under :data:`COMPILE_SETTINGS`); directly elsewhere, when already compiling, or when compiling is off."""
    if device.type not in COMPILED_DEVICES or not compile_enabled() or torch.compiler.is_compiling():
        return function(*args, **kwargs)
    with torch._dynamo.config.patch(COMPILE_SETTINGS):
        return _compiled(function, BACKEND)(*args, **kwargs)
