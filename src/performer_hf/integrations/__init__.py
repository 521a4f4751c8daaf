"""Performer attention for transformers model classes that are not ours: the ``"performer"`` and
``"performer_hybrid"`` attention implementations (``attention_interface.py``), where their settings live
(``attention_settings.py``) and their constant-size decoding cache (``cache.py``)."""

from .attention_interface import register_attention_implementations
from .cache import CACHE_KEYWORD, PerformerCache

__all__ = ["CACHE_KEYWORD", "PerformerCache", "register_attention_implementations"]
