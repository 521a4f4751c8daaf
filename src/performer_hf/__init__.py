"""performer-hf: Performers (FAVOR+ linear attention) as a Hugging Face model family.

Importing the package registers the Performer classes with the ``Auto*`` factories under
model_type ``"performer"``.
"""

import transformers

from .conversion import convert
from .modeling import modeling_performer
from .modeling.cache_performer import FavorCacheLayer
from .modeling.configuration_performer import PerformerConfig
from .modeling.modeling_performer import *  # noqa: F403 (the model classes, as listed in its __all__)

__version__ = "0.1.0"

transformers.AutoConfig.register(PerformerConfig.model_type, PerformerConfig, exist_ok=True)
for _model, _auto in modeling_performer.AUTO_CLASSES.items():
    getattr(transformers, _auto).register(PerformerConfig, _model, exist_ok=True)

__all__ = ["FavorCacheLayer", "PerformerConfig", *modeling_performer.__all__, "convert"]
