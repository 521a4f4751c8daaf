"""performer-hf: Performers (FAVOR+ linear attention) as a Hugging Face model family.

Importing the package registers the Performer classes with the ``Auto*`` factories under
model_type ``"performer"``, and the attention implementations ``"performer"`` (FAVOR+), ``"performer_hybrid"``
and ``"performer_sparse"`` with transformers' ``AttentionInterface``, for any model class.
"""

import transformers
from transformers.models.auto import modeling_auto

from .conversion import convert
from .integrations import (
    CACHE_KEYWORD,
    PerformerCache,
    held_bytes,
    register_attention_implementations,
    ship_remote_code,
    transfer_attention,
)
from .modeling import modeling_performer
from .modeling.cache_performer import FavorCacheLayer
from .modeling.configuration_performer import PerformerConfig
from .modeling.modeling_performer import *  # noqa: F403 (the model classes, as listed in its __all__)

__version__ = "0.1.0"

# transformers' tables of each task's class names by model type, which Auto*.register leaves as they are: the Trainer
# reads the causal one to shift the labels of its label smoothing (without it, the next token's loss scored each
# token against itself), and pipelines read them to check a model's task
_TASK_TABLES = {
    "AutoModel": "MODEL_MAPPING_NAMES",
    "AutoModelForMaskedLM": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForTokenClassification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForQuestionAnswering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
}

transformers.AutoConfig.register(PerformerConfig.model_type, PerformerConfig, exist_ok=True)
for _model, _auto in modeling_performer.AUTO_CLASSES.items():
    getattr(transformers, _auto).register(PerformerConfig, _model, exist_ok=True)
    getattr(modeling_auto, _TASK_TABLES[_auto]).setdefault(PerformerConfig.model_type, _model.__name__)
register_attention_implementations()

__all__ = [
    "CACHE_KEYWORD",
    "FavorCacheLayer",
    "PerformerCache",
    "PerformerConfig",
    *modeling_performer.__all__,
    "convert",
    "held_bytes",
    "ship_remote_code",
    "transfer_attention",
]
