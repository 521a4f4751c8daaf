"""FAVOR+ feature redraw during training.

The paper redraws the random features periodically while training and keeps them fixed for
evaluation. Here the redraw after optimizer step ``s`` is ``model.redraw_projections(s)``: a pure
function of the step, so every process draws the same features without communicating, and a run
resumed from a checkpoint (which holds the projection buffers) continues with the same features.

:func:`redraw_if_due` is the one place that decides; the Accelerate loop (``training/run_*.py``)
and :class:`PerformerRedrawCallback` (for ``transformers.Trainer``) both call it, so the two paths
redraw at the same steps from the same seeds.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from transformers import PreTrainedModel, TrainerCallback

from ..attention_card import uses_projection

logger = logging.getLogger(__name__)


def redraw_due(step: int, interval: int | None) -> bool:
    """Whether the features are redrawn after optimizer step ``step`` (1-based); never when
    ``interval`` is 0 or None."""
    return bool(interval) and step > 0 and step % interval == 0


def redraw_seed(step: int) -> int:
    """The seed of the features drawn after optimizer step ``step``: the step itself."""
    return step


def redraw_features(model: torch.nn.Module, step: int) -> None:
    """Redraw every layer's projection from ``step`` (``model`` unwrapped from DDP / FSDP)."""
    model.redraw_projections(redraw_seed(step))


def check_redraw(config, interval: int | None) -> None:
    """Refuse a redraw schedule for a Performer whose attention reads no random features (exact attention, the
    deterministic polynomial far fields, the sparse method): redrawing would change nothing."""
    if interval and not uses_projection(config):
        raise ValueError(
            f"a feature redraw every {interval} steps, but this Performer's attention ({config.attention_method}, "
            f"attention_kernel={config.attention_kernel!r}) reads no random features: drop the redraw (interval 0)."
        )


def redraw_if_due(model: torch.nn.Module, step: int, interval: int | None) -> bool:
    """Redraw ``model``'s features if the schedule says so after optimizer step ``step``; returns
    whether it did."""
    if not redraw_due(step, interval):
        return False
    redraw_features(model, step)
    return True


def projection_checksum(model: torch.nn.Module) -> int:
    """A 48-bit digest of all projection buffers (exact in float64, so it can be gathered as a tensor)."""
    digest = hashlib.sha256()
    for name, buffer in model.named_buffers():
        if name.endswith("projection"):
            digest.update(name.encode())
            digest.update(buffer.detach().float().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest()[:6], "big")


def _is_performer(model: torch.nn.Module) -> bool:
    # Looked up on the class: PEFT wrappers forward unknown attributes to the model they wrap.
    return isinstance(model, PreTrainedModel) and callable(getattr(type(model), "redraw_projections", None))


# why LoRA (an adapter saved without its base) and feature redraws do not go together
ADAPTER_REDRAW_PROBLEM = (
    "the redrawn features live in the frozen base model, which the adapter is saved without, so the base and "
    "adapter would not give back the trained model"
)


def _unwrap(model: torch.nn.Module) -> tuple[PreTrainedModel, bool]:
    """:func:`find_performer`'s Performer, and whether a PEFT adapter wraps it."""
    current, adapted = model, False
    while not _is_performer(current):
        if isinstance(getattr(current, "module", None), torch.nn.Module):
            current = current.module
        elif isinstance(getattr(current, "_orig_mod", None), torch.nn.Module):
            current = current._orig_mod
        elif callable(getattr(type(current), "get_base_model", None)):
            current, adapted = current.get_base_model(), True
        else:
            raise ValueError(
                f"PerformerRedrawCallback needs a Performer model (one with redraw_projections), got "
                f"{type(model).__name__}; train a performer_hf model or remove the callback."
            )
    return current, adapted


def find_performer(model: torch.nn.Module) -> PreTrainedModel:
    """The Performer inside ``model``, unwrapped from DDP / DataParallel / DeepSpeed / FSDP
    (``.module``), ``torch.compile`` (``._orig_mod``) and PEFT (``.get_base_model()``) wrappers.

    Raises ``ValueError`` when there is none.
    """
    return _unwrap(model)[0]


class PerformerRedrawCallback(TrainerCallback):
    """Redraws the FAVOR+ random features while ``transformers.Trainer`` trains, exactly as the
    Accelerate scripts do: after every ``interval``-th optimizer step ``s``,
    ``model.redraw_projections(s)`` (through :func:`redraw_if_due`, the function the scripts call).

    The redraw happens in ``on_step_end``, before the Trainer logs, evaluates or saves that step, so
    evaluations and checkpoints see the new features (checkpoints hold the projection buffers, so a
    resumed run continues with them). Evaluation never redraws.

    Args:
        interval: optimizer steps between redraws. ``None`` (default) takes the model config's
            ``feature_redraw_interval``; 0 (or a config value of None) never redraws. The interval
            used is written to ``config.feature_redraw_interval``, so the saved config records it.

    Raises ``ValueError`` at the start of training when the model is not a Performer, when it
    would redraw a model whose attention reads no random features (:func:`check_redraw`), or when it would redraw
    the frozen base of a PEFT (LoRA) model (its saved adapter would not give back the trained model).

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[PerformerRedrawCallback(100)])
    """

    def __init__(self, interval: int | None = None):
        if interval is not None and interval < 0:
            raise ValueError(f"PerformerRedrawCallback(interval={interval}): pass a number of steps >= 0 (0: never).")
        self.interval = interval
        self._performer: PreTrainedModel | None = None
        self._active_interval: int | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Find the Performer in the Trainer's model and settle the interval."""
        performer, adapted = _unwrap(model)
        interval = performer.config.feature_redraw_interval if self.interval is None else self.interval
        check_redraw(performer.config, interval)
        if interval and adapted:
            raise ValueError(
                f"PerformerRedrawCallback on a PEFT (LoRA) model, redrawing every {interval} steps: "
                f"{ADAPTER_REDRAW_PROBLEM}. Pass interval=0 (and no feature_redraw_interval in the config), or train "
                "every weight."
            )
        performer.config.feature_redraw_interval = interval or None
        self._performer, self._active_interval = performer, interval
        if interval:
            logger.info("Redrawing the FAVOR+ features every %d optimizer steps", interval)

    def on_step_end(self, args, state, control, **kwargs):
        """Redraw when optimizer step ``state.global_step`` is due."""
        if redraw_if_due(self._performer, state.global_step, self._active_interval):
            logger.info(
                "Redrew the FAVOR+ features after step %d (checksum %012x)",
                state.global_step,
                projection_checksum(self._performer),
            )
