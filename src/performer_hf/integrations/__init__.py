"""Performer attention for transformers model classes that are not ours: the ``"performer"``,
``"performer_hybrid"`` and ``"performer_sparse"`` attention implementations (``attention_interface.py``), where
their settings live (``attention_settings.py``), their decoding cache (``cache.py``) and attention transfer, which
trains their small learnable parts to match the source's softmax attention (``attention_transfer.py``)."""

from ..modeling.cache_performer import held_bytes
from .attention_interface import register_attention_implementations
from .attention_transfer import TransferReport, text_batches, transfer_attention
from .cache import CACHE_KEYWORD, PerformerCache

__all__ = [
    "CACHE_KEYWORD",
    "PerformerCache",
    "TransferReport",
    "register_attention_implementations",
    "text_batches",
    "held_bytes",
    "transfer_attention",
]
