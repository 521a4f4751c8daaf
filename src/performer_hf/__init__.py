"""performer-hf: Performers (FAVOR+ linear attention) as a Hugging Face model family.

Importing the package registers the Performer classes with the ``Auto*`` factories under
model_type ``"performer"``.
"""

import transformers

from .conversion import convert
from .modeling.cache_performer import FavorCacheLayer
from .modeling.configuration_performer import PerformerConfig
from .modeling.modeling_performer import (
    AUTO_CLASSES,
    PerformerForCausalLM,
    PerformerForMaskedLM,
    PerformerForQuestionAnswering,
    PerformerForSequenceClassification,
    PerformerForTokenClassification,
    PerformerModel,
    PerformerPreTrainedModel,
)

__version__ = "0.1.0"

transformers.AutoConfig.register(PerformerConfig.model_type, PerformerConfig, exist_ok=True)
for _model, _auto in AUTO_CLASSES.items():
    getattr(transformers, _auto).register(PerformerConfig, _model, exist_ok=True)

__all__ = [
    "FavorCacheLayer",
    "PerformerConfig",
    "PerformerForCausalLM",
    "PerformerForMaskedLM",
    "PerformerForQuestionAnswering",
    "PerformerForSequenceClassification",
    "PerformerForTokenClassification",
    "PerformerModel",
    "PerformerPreTrainedModel",
    "convert",
]
