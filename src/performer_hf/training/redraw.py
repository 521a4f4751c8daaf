"""FAVOR+ feature redraw during training.

The paper redraws the random features periodically while training and keeps them fixed for
evaluation. Here the redraw after optimizer step ``s`` is ``model.redraw_projections(s)``: a pure
function of the step, so every process draws the same features without communicating, and a run
resumed from a checkpoint (which holds the projection buffers) continues with the same features.
"""

from __future__ import annotations

import hashlib

import torch


def redraw_due(step: int, interval: int | None) -> bool:
    """Whether the features are redrawn after optimizer step ``step`` (1-based)."""
    return interval is not None and step > 0 and step % interval == 0


def redraw_features(model: torch.nn.Module, step: int) -> None:
    """Redraw every layer's projection from ``step`` (``model`` unwrapped from DDP / FSDP)."""
    model.redraw_projections(step)


def projection_checksum(model: torch.nn.Module) -> int:
    """A 48-bit digest of all projection buffers (exact in float64, so it can be gathered as a tensor)."""
    digest = hashlib.sha256()
    for name, buffer in model.named_buffers():
        if name.endswith("projection"):
            digest.update(name.encode())
            digest.update(buffer.detach().float().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest()[:6], "big")
