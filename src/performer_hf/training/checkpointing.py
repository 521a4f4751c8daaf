"""Resumable checkpoints.

A checkpoint folder holds ``accelerator.save_state`` (model with its projection buffers, optimizer,
scheduler, every process's RNG states, the data sampler) and ``trainer_state.json``: the optimizer
step, the epoch and how many batches of that epoch were consumed, which is exactly what
``skip_first_batches`` needs to continue the same data order.
"""

from __future__ import annotations

import json
import os
import re

from .arguments import TrainingInputError

TRAINER_STATE_FILE = "trainer_state.json"
_CHECKPOINT_NAME = re.compile(r"^(step|epoch)_\d+$")


def save_checkpoint(accelerator, path: str, state: dict) -> None:
    """``accelerator.save_state(path)`` plus ``trainer_state.json`` (written last: its presence marks
    a complete checkpoint). Call on every process."""
    accelerator.save_state(path)
    if accelerator.is_main_process:
        with open(os.path.join(path, TRAINER_STATE_FILE), "w") as handle:
            json.dump(state, handle, indent=2)
    accelerator.wait_for_everyone()


def read_trainer_state(path: str) -> dict:
    state_file = os.path.join(path, TRAINER_STATE_FILE)
    if not os.path.isfile(state_file):
        raise TrainingInputError(
            f"{path!r} is not a complete checkpoint of these scripts (no {TRAINER_STATE_FILE}); pass a folder "
            "written by --checkpointing_steps."
        )
    with open(state_file) as handle:
        return json.load(handle)


def find_latest_checkpoint(output_dir: str) -> str:
    """The complete checkpoint in ``output_dir`` with the most optimizer steps."""
    candidates = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            path = os.path.join(output_dir, name)
            if _CHECKPOINT_NAME.match(name) and os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
                candidates.append((read_trainer_state(path)["completed_steps"], path))
    if not candidates:
        raise TrainingInputError(f"--resume_from_checkpoint latest: no checkpoint found in {output_dir!r}.")
    return max(candidates)[1]


def load_checkpoint(accelerator, path: str) -> dict:
    """Restore everything ``save_checkpoint`` saved; returns the trainer state."""
    state = read_trainer_state(path)
    accelerator.load_state(path)
    return state


def resume_position(state: dict, batches_per_epoch: int) -> tuple[int, int]:
    """(epoch to continue, batches of it to skip) after the checkpointed step."""
    epoch, consumed = state["epoch"], state["batches_in_epoch"]
    if consumed >= batches_per_epoch:
        return epoch + 1, 0
    return epoch, consumed
