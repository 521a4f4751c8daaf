"""performer-hf: Performers (FAVOR+ linear attention) as a Hugging Face model family.

Importing the package registers the Performer classes with the ``Auto*`` factories under
model_type ``"performer"``.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .cache_performer import FavorCacheLayer
from .configuration_performer import PerformerConfig
from .conversion import convert
from .modeling_performer import (
    PerformerForCausalLM,
    PerformerForMaskedLM,
    PerformerForQuestionAnswering,
    PerformerForSequenceClassification,
    PerformerForTokenClassification,
    PerformerModel,
    PerformerPreTrainedModel,
)

__version__ = "0.1.0"

_AUTO_CLASSES = {
    AutoModel: PerformerModel,
    AutoModelForMaskedLM: PerformerForMaskedLM,
    AutoModelForCausalLM: PerformerForCausalLM,
    AutoModelForSequenceClassification: PerformerForSequenceClassification,
    AutoModelForTokenClassification: PerformerForTokenClassification,
    AutoModelForQuestionAnswering: PerformerForQuestionAnswering,
}

AutoConfig.register(PerformerConfig.model_type, PerformerConfig, exist_ok=True)
for _auto, _model in _AUTO_CLASSES.items():
    _auto.register(PerformerConfig, _model, exist_ok=True)

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
