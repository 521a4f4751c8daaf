"""Resumable checkpoints.

A checkpoint folder holds ``accelerator.save_state`` (model with its projection buffers, optimizer,
scheduler, every process's RNG states, the data sampler) and ``trainer_state.json``: the optimizer
step, the epoch and how many batches of that epoch were consumed, which is exactly what
``skip_first_batches`` needs to continue the same data order.
"""

from __future__ import annotations

import json
import os
import shutil

from .arguments import CHECKPOINT_NAME, TrainingInputError

TRAINER_STATE_FILE = "trainer_state.json"


def save_checkpoint(accelerator, path: str, state: dict) -> None:
    """``accelerator.save_state(path)`` plus ``trainer_state.json`` (written last: its presence marks
    a complete checkpoint). Call on every process."""
    accelerator.save_state(path)
    if accelerator.is_main_process:
        with open(os.path.join(path, TRAINER_STATE_FILE), "w") as handle:
            json.dump(state, handle, indent=2)
    accelerator.wait_for_everyone()


def clear_previous_run(output_dir: str, keep: tuple[str, ...] = ()) -> None:
    """Remove everything in ``output_dir`` but the entries named in ``keep`` (this run's own, e.g. the folder
    ``--convert_from`` converted into): ``--overwrite_output_dir``."""
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if name in keep:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


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
            if CHECKPOINT_NAME.match(name) and os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
                candidates.append((read_trainer_state(path)["completed_steps"], path))
    if not candidates:
        raise TrainingInputError(f"--resume_from_checkpoint latest: no checkpoint found in {output_dir!r}.")
    return max(candidates)[1]


def batching(args, accelerator, train_examples: int) -> dict:
    """What a checkpoint's count of batches and steps is in: the batch per device, the number of processes, the
    batches per optimizer step, the seed of the data order (and masks) and the training examples (how many are kept,
    how many there are)."""
    return {
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "num_processes": accelerator.num_processes,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "seed": args.seed,
        "max_train_samples": args.max_train_samples,
        "train_examples": train_examples,
    }


def load_checkpoint(accelerator, path: str, current_batching: dict) -> dict:
    """Restore everything ``save_checkpoint`` saved; returns the trainer state. Refuses a checkpoint of other
    batching (its batches of the epoch are another count, order or set of examples: the resumed run would skip
    others; a field an older checkpoint lacks is not compared) and one of another model."""
    state = read_trainer_state(path)
    other = {name: state[name] for name, value in current_batching.items() if state.get(name, value) != value}
    if other:
        saved = ", ".join(f"{name}={value}" for name, value in other.items())
        raise TrainingInputError(
            f"the checkpoint {path!r} was written with {saved}, which this run changes: its position in the epoch "
            "counts batches of those examples, in that order and size, so resuming would skip other examples. "
            "Resume with the same settings and data."
        )
    try:
        accelerator.load_state(path)
    except RuntimeError as error:  # its weights (or optimizer state) do not fit this model
        raise TrainingInputError(
            f"the checkpoint {path!r} does not fit this model ({' '.join(str(error).split())[:300]}): resume with "
            "the model and --config_overrides it was trained with."
        ) from None
    return state


def resume_position(state: dict, batches_per_epoch: int) -> tuple[int, int]:
    """(epoch to continue, batches of it to skip) after the checkpointed step."""
    epoch, consumed = state["epoch"], state["batches_in_epoch"]
    if consumed >= batches_per_epoch:
        return epoch + 1, 0
    return epoch, consumed
