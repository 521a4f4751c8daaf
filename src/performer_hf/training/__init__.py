"""Training support for the Accelerate scripts in ``training/`` (``run_mlm.py``, ``run_clm.py``,
``run_classification.py``) and, through :class:`PerformerRedrawCallback`, for ``transformers.Trainer``.

One job per module:

- :mod:`.arguments` - the command line shared by the scripts (transformers' ``*_no_trainer`` names)
  and :class:`TrainingInputError`, raised for bad input before any training starts.
- :mod:`.model_loading` - tokenizer and model: a Performer folder, a Performer config (from scratch)
  or a source checkpoint converted on the fly; the sequence-length check.
- :mod:`.data` - raw datasets from local files or the Hub, cached tokenization, grouping into
  blocks, classification labels.
- :mod:`.collators` - reproducible MLM masking (checkpointed), causal-LM and classification batches.
- :mod:`.metrics` - evaluation metrics computed locally (loss, perplexity, token accuracy,
  accuracy, macro-F1).
- :mod:`.redraw` - the FAVOR+ feature-redraw schedule, a projection checksum and
  :class:`PerformerRedrawCallback`, the same schedule for ``transformers.Trainer``.
- :mod:`.checkpointing` - save / locate / load checkpoints and the exact resume position.
- :mod:`.tracking` - a JSON-lines tracker for ``accelerator.log``.
- :mod:`.model_card` - the card written next to the final model.
- :mod:`.trainer` - the Accelerate training loop shared by the three tasks.
- :mod:`.language_modeling`, :mod:`.classification` - the tasks behind the scripts.
"""

from .arguments import TrainingInputError
from .redraw import PerformerRedrawCallback

__all__ = ["PerformerRedrawCallback", "TrainingInputError"]
