"""Long inputs are processed slab by slab, so that memory stays linear in the sequence length (FAVOR+'s
feature buffers, hybrid attention's query blocks and routing scores, the polynomial far field's state); in
training, a slab's temporaries are recomputed in backward rather than kept (:func:`recomputed`).

How large a slab may be depends on the device. On a CPU, a slab's largest temporary should stay about
cache-sized: the allocator reuses it and no page faults occur. On a GPU, each slab costs a round of kernel
launches (a few microseconds each, whatever their size), so slabs are made as large as memory allows:
measured on an H100 in bf16, the CPU's budgets made hybrid training 150x slower than SDPA at 512 tokens x 32.
"""

import itertools

import torch
from torch.utils.checkpoint import checkpoint

from .compiled_lengths import exported, spans

# Elements of one slab's largest temporary, by device type ("cpu", or any accelerator) and use:
#   blocks    hybrid attention's query blocks (B, H, n, block_q, C, X) and routing scores
#   far       the polynomial far field's (B, H, rows, X) temporaries (outer products on a CPU, features elsewhere)
#   features  FAVOR+'s (B, H, S, m) feature buffers (8 MiB in float32 on a CPU)
#   loss      the token loss's (rows, vocabulary) float32 softmax (4 MiB on a CPU)
SLAB_ELEMENTS = {
    "cpu": {"blocks": 1 << 24, "far": 1 << 20, "features": 1 << 21, "loss": 1 << 20},
    "accelerator": {"blocks": 1 << 28, "far": 1 << 27, "features": 1 << 27, "loss": 1 << 26},
}
# Chunks per slab of causal FAVOR+: its chunk scan costs (G + 1)^2 m' d per (batch, head) and slab.
MAX_SLAB_CHUNKS = {"cpu": 16, "accelerator": 64}


def _kind(device: torch.device | str) -> str:
    return "cpu" if torch.device(device).type == "cpu" else "accelerator"


def slab_elements(device: torch.device | str, use: str) -> int:
    """The element budget of one slab's largest temporary for ``use`` (a key of :data:`SLAB_ELEMENTS`)."""
    return SLAB_ELEMENTS[_kind(device)][use]


def max_slab_chunks(device: torch.device | str) -> int:
    """The most causal chunks in one slab on ``device``."""
    return MAX_SLAB_CHUNKS[_kind(device)]


def slab_sizes(length: int, per_row: int, use: str, device: torch.device | str) -> list[int]:
    """Rows per slab of ``range(length)``, about ``slab_elements(device, use) / per_row`` each: the sizes for
    ``Tensor.split``. (Split, not index, tensors that need gradients: the backward of each slice writes a
    zero gradient of the full tensor, which makes a slab loop quadratic in time.)"""
    rows = max(1, slab_elements(device, use) // max(1, per_row))
    return [stop - start for start, stop in spans(length, rows)]


def slabs(length: int, per_row: int, use: str, device: torch.device | str) -> list[slice]:
    """The slabs of :func:`slab_sizes` as slices of ``range(length)``."""
    bounds = itertools.accumulate(slab_sizes(length, per_row, use, device), initial=0)
    return [slice(start, stop) for start, stop in itertools.pairwise(bounds)]


def recomputed(fn, *args):
    """``fn(*args)`` for one slab, with its intermediates recomputed in backward instead of stored
    (``torch.utils.checkpoint``): a training step then keeps no slab's temporaries, only its inputs. Not in an
    exported program (an inference graph: a strict export, which traces with dynamo, refuses the checkpoint)."""
    if not torch.is_grad_enabled() or exported():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)
