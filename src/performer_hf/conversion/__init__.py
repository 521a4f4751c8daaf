"""Convert pretrained BERT / RoBERTa / GPT-2 checkpoints into Performers (see ``convert``).

``mapping`` holds the per-architecture tables, ``source`` reads checkpoints safely, ``fidelity``
measures the converted model against its source, ``model_card`` writes the README.md card.
"""

from .convert import convert
from .errors import ConversionError
from .in_place import TransferSettings
from .mapping import SUPPORTED_ARCHITECTURES

__all__ = ["SUPPORTED_ARCHITECTURES", "ConversionError", "TransferSettings", "convert"]
