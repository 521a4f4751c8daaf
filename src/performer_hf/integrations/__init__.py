"""Performer attention for transformers model classes that are not ours: the ``"performer"``,
``"performer_hybrid"`` and ``"performer_sparse"`` attention implementations (``attention_interface.py``), where
their settings live (``attention_settings.py``) and their decoding cache (``interface_cache.py``), all in the
remote-code bundle ``performer_hf/modeling/``; attention transfer, which trains their small learnable parts to match
the source's softmax attention (``attention_transfer.py``), and :func:`ship_remote_code`, which makes a model's saved
folder load without performer_hf (``remote_code.py``)."""

from ..modeling.attention_interface import register_attention_implementations
from ..modeling.cache_performer import held_bytes
from ..modeling.interface_cache import CACHE_KEYWORD, PerformerCache
from .attention_transfer import TransferReport, text_batches, transfer_attention
from .remote_code import ship_remote_code

__all__ = [
    "CACHE_KEYWORD",
    "PerformerCache",
    "TransferReport",
    "register_attention_implementations",
    "text_batches",
    "held_bytes",
    "ship_remote_code",
    "transfer_attention",
]
