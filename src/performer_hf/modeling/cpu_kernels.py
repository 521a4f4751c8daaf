"""Compiled CPU kernels, built on first use with PyTorch's C++ extension JIT (needs a C++ compiler).

The kernels are optional fast paths (forward and backward, :mod:`.hybrid_compiled`; sparse attention's
decoding step and blocks of queries, :mod:`.sparse_attention`) with pure-PyTorch fallbacks. When the build fails (no
compiler, no ninja), :func:`hybrid_kernels` logs why once and returns ``None``, and callers use the PyTorch code.
``PERFORMER_HF_CPU_KERNELS=0`` turns the kernels off.

The build is cached by PyTorch (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``),
under a name that includes this machine's CPU flags, since it is compiled with ``-march=native``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "bindings.cpp",
        "hybrid_support.cpp",
        "hybrid_far_field.cpp",
        "hybrid_routing.cpp",
        "sparse_decode.cpp",
        "sparse_block.cpp",
        "sparse_walk.cpp",
    )
]
_HEADER = Path(__file__).parent / "csrc" / "hybrid_kernels.h"
_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]


def kernels_enabled() -> bool:
    """Whether compiled CPU kernels may be used (``PERFORMER_HF_CPU_KERNELS`` is not ``0``)."""
    return os.environ.get("PERFORMER_HF_CPU_KERNELS", "1") != "0"


def _cpu_signature() -> str:
    """A short hash of what the build depends on: the CPU's model and flags (``-march=native``), the flags,
    the source and torch's release (whose headers and ABI it is built against: CI builds it with both ends of
    torch's range in one cache)."""
    cpu = platform.processor()
    try:
        cpu += next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    sources = "".join(path.read_text() for path in (*_SOURCES, _HEADER))
    return hashlib.sha256((cpu + " ".join(_FLAGS) + sources + torch.__version__).encode()).hexdigest()[:12]


def _put_ninja_on_path() -> None:
    """PyTorch runs ``ninja`` from PATH; the ninja wheel's binary is not there when the venv is not activated."""
    try:
        import ninja
    except ImportError:
        return  # then a system ninja is needed; its absence is reported as a build failure
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


@functools.cache
def _compiled_kernels():
    """Build (or load from PyTorch's cache) the extension; ``None``, with a warning, when that fails."""
    if not all(path.exists() for path in _SOURCES):  # e.g. a trust_remote_code copy, which carries no C++ source
        logger.info(
            "No source for the fused hybrid-attention CPU kernel at %s; using the PyTorch implementation.",
            _SOURCES[0].parent,
        )
        return None
    logger.info("Loading the fused hybrid-attention CPU kernel (compiled on first use: about a minute on 2 cores)")
    try:
        from torch.utils import cpp_extension  # imported lazily: it pulls in setuptools

        _put_ninja_on_path()
        module = cpp_extension.load(
            name=f"performer_hf_hybrid_{_cpu_signature()}",
            sources=[str(path) for path in _SOURCES],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # any build failure (no compiler, no ninja, ...) means: use PyTorch
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        logger.warning(
            "Fused hybrid-attention CPU kernel unavailable (%s: %s); using the PyTorch implementation, about "
            "2.5x slower at 8K tokens. For the kernel, install a C++ compiler (g++) and the ninja package; to "
            "silence this, set PERFORMER_HF_CPU_KERNELS=0.",
            type(error).__name__,
            reason,
        )
        return None
    return module


def hybrid_kernels():
    """The compiled module (``hybrid_support_sums``, ``quadratic_far_state``, ``quadratic_far_apply``, each
    with its ``_backward``, ``top_blocks``, ``routed_candidates``, ``max_value_width``, and sparse attention's
    ``sparse_decode_step``, ``sparse_block_attend`` and ``sparse_walk_attend``; see ``csrc/hybrid_kernels.h``), or
    ``None`` when disabled or the build failed."""
    return _compiled_kernels() if kernels_enabled() else None
