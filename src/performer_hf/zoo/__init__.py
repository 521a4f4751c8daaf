"""The performer-hf model zoo: every model is a recipe in ``registry.yaml`` that ``build`` (CLI:
``performer-hf zoo build NAME OUT``) runs end to end - source checkpoint, conversion, optional
finetuning with the training scripts' library, evaluation - writing the checkpoint and its card.

- :mod:`.registry` - the registry file and its checks; :mod:`.data` - the data sets as files;
  :mod:`.pretrain` - the small softmax GPT-2 trained here; :mod:`.evaluation` - the evaluations;
  :mod:`.card` - the model card renderer; :mod:`.builder` - the recipe runner.

``build`` is imported on first use: it pulls in the training stack (Accelerate, datasets), which
``zoo list`` and the error class do not need.
"""

from .errors import ZooError
from .registry import get_entry, load_registry, model_names

__all__ = ["ZooError", "build", "get_entry", "load_registry", "model_names"]


def __getattr__(name: str):
    if name == "build":
        from .builder import build

        return build
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
