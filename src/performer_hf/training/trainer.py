"""The Accelerate training loop shared by ``run_mlm.py``, ``run_clm.py`` and ``run_classification.py``.

One optimizer step = ``--gradient_accumulation_steps`` batches on every process. After each step:
clip (paper default 0.5), step the optimizer and LR schedule, redraw the FAVOR+ features when due
(seeded from the step), log, evaluate and checkpoint when due. Resuming restores everything a
checkpoint holds and skips the batches the checkpointed run had consumed, so the continued run
sees the same data, masks, features and losses as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import datasets
import torch
import transformers
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.logging import get_logger
from accelerate.utils import (
    DistributedType,
    get_cpu_distributed_information,
    get_int_from_env,
    parse_flag_from_env,
    set_seed,
)
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from ..conversion.errors import one_line
from ..cpu_memory import retain_freed_memory
from ..hub import HUB_ERRORS
from ..modeling.configuration_performer import PerformerConfig
from .arguments import TrainingInputError
from .checkpointing import (
    batching,
    clear_previous_run,
    find_latest_checkpoint,
    load_checkpoint,
    resume_position,
    save_checkpoint,
)
from .model_card import build_model_card, write_model_card
from .model_loading import CONVERTED_SUBDIR
from .redraw import ADAPTER_REDRAW_PROBLEM, check_redraw, projection_checksum, redraw_if_due
from .tracking import select_trackers

logger = get_logger(__name__)

RESULTS_FILE = "all_results.json"


@dataclass(frozen=True)
class TrainingTask:
    """What differs between the scripts' evaluation.

    ``batch_statistics(outputs, batch)`` returns per-example tensors (first dimension = batch) that
    are gathered across processes; ``compute_metrics`` reduces their concatenation to floats.
    ``loss_items(batch)`` counts what the batch's mean loss averages over (its labelled tokens; by default its
    examples), so that an optimizer step weighs its micro-batches and processes by it. ``scorable(batch, items)``
    gives a batch of ``items`` 0 (nothing scored: its mean loss 0/0, whose gradient is NaN however it is weighed)
    something to score, which the step then weighs 0 (by default the batch itself: every batch scores its examples).
    """

    name: str
    batch_statistics: Callable[[object, dict], dict[str, torch.Tensor]]
    compute_metrics: Callable[..., dict]
    loss_items: Callable[[dict], torch.Tensor] = lambda batch: torch.tensor(len(batch["labels"]))
    scorable: Callable[[dict, torch.Tensor], dict] = lambda batch, items: batch


def configure_script_logging() -> None:
    """The logging of a process that a training script (``training/run_*.py``) runs, as transformers' example scripts
    set it up: timestamped records on stderr, performer_hf's INFO records on the main process (only errors on the
    others), transformers' and datasets' warnings on each machine's main process (only errors on the others). The
    scripts call it before training; the trainer called as a library (the zoo builder, a notebook) leaves the
    caller's logging as it was. The process's rank is read from the launcher's environment, as Accelerate reads it.
    """
    place = get_cpu_distributed_information()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S")
    logging.getLogger("performer_hf").setLevel(logging.INFO if place.rank == 0 else logging.ERROR)
    logging.getLogger(__name__).setLevel(logging.INFO)  # every process states its Accelerate setup
    verbosity = logging.WARNING if place.local_rank == 0 else logging.ERROR
    datasets.utils.logging.set_verbosity(verbosity)
    transformers.utils.logging.set_verbosity(verbosity)


def _shows_training_progress() -> bool:
    """Whether the training run shows its progress bar: where transformers' bars are on (a script, a notebook), or
    where performer_hf's INFO records are shown (`performer-hf` commands turn transformers' bars off, and ``-q``
    their INFO records too: a quiet ``zoo build`` prints its folder alone)."""
    return transformers.utils.logging.is_progress_bar_enabled() or logging.getLogger("performer_hf").isEnabledFor(
        logging.INFO
    )


def create_accelerator(args: argparse.Namespace) -> Accelerator:
    """The Accelerator for a run, with the seed set (the logging is the caller's: :func:`configure_script_logging`
    for the scripts).

    The seedable sampler makes the shuffled order a function of (seed, epoch) on every process.
    """
    launched = get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)
    if launched == 1 and parse_flag_from_env("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ:
        # what `accelerate launch --cpu --num_processes N` (N > 1) leaves: its simple launcher starts one process
        raise TrainingInputError(
            "accelerate launch --cpu --num_processes N starts a single process (Accelerate's simple launcher), so "
            "this run would train alone. For N CPU processes type `accelerate launch --multi_gpu --num_processes N "
            "...` (without GPUs the scripts train on the CPU); for one, drop --num_processes."
        )
    os.makedirs(args.output_dir, exist_ok=True)
    accelerator = Accelerator(
        # Several processes on a machine without GPUs (`accelerate launch --multi_gpu` / torchrun):
        # without cpu=True Accelerate would let each process train alone.
        cpu=launched > 1 and not torch.accelerator.is_available(),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=select_trackers(args.report_to, args.output_dir) if args.with_tracking else None,
        project_dir=args.output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    )
    if launched > 1 and accelerator.num_processes == 1:
        raise TrainingInputError(
            f"{launched} processes were launched but Accelerate set up {accelerator.num_processes}; each would "
            "train on its own. Check the launcher's distributed settings (`accelerate env`)."
        )
    logger.info(accelerator.state, main_process_only=False)
    if accelerator.device.type == "cpu" and retain_freed_memory():
        logger.info("CPU training: freed memory stays in the process for reuse (performer_hf.cpu_memory).")
    set_seed(args.seed)
    return accelerator


# devices whose fused AdamW step (one kernel over all parameters) we train on; DeepSpeed's engine keeps the default
FUSED_OPTIMIZER_DEVICES = ("cpu", "cuda")


def _optimizer(model: torch.nn.Module, args: argparse.Namespace, accelerator: Accelerator) -> torch.optim.AdamW:
    """AdamW; biases and LayerNorm weights get no weight decay. Fused on the CPU and CUDA, as transformers' Trainer
    defaults to with torch >= 2.8: on a CPU (2 threads) the step over all-MiniLM-L6-v2's 22.7M parameters takes 26 ms
    where the default's loop over them took 126; a whole training step at 8 x 256 tokens, 1.03x faster."""
    no_decay = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            if isinstance(module, torch.nn.LayerNorm) or param_name == "bias":
                no_decay.add(f"{module_name}.{param_name}" if module_name else param_name)
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    groups = [
        {"params": [p for n, p in named if n not in no_decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
    ]
    fused = (
        accelerator.device.type in FUSED_OPTIMIZER_DEVICES
        and getattr(accelerator.state, "deepspeed_plugin", None) is None
    )
    return torch.optim.AdamW(groups, lr=args.learning_rate, fused=fused)


def _configure_deepspeed(accelerator: Accelerator, args: argparse.Namespace) -> None:
    """DeepSpeed clips inside its engine: give it --max_grad_norm where its config says 'auto'."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    plugin.fill_match("gradient_clipping", must_match=False, gradient_clipping=args.max_grad_norm)
    clipping = plugin.get_value("gradient_clipping")
    if clipping != args.max_grad_norm:
        logger.warning(
            "The DeepSpeed config clips gradients at %s, not --max_grad_norm %s; DeepSpeed's value applies.",
            clipping,
            args.max_grad_norm,
        )


def _batches_per_process(num_examples: int, batch_size: int, num_processes: int) -> int:
    """Length of a prepared dataloader on each process (Accelerate pads shards to even length)."""
    return math.ceil(math.ceil(num_examples / batch_size) / num_processes)


@dataclass(frozen=True)
class _Plan:
    """How many batches, optimizer steps and epochs the run takes."""

    batches_per_epoch: int
    max_train_steps: int
    num_epochs: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, batches_per_epoch: int) -> _Plan:
        updates_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
        max_train_steps = args.max_train_steps or args.num_train_epochs * updates_per_epoch
        return cls(batches_per_epoch, max_train_steps, math.ceil(max_train_steps / updates_per_epoch))


def _config_for_trackers(args: argparse.Namespace) -> dict:
    """The arguments as plain values, without the Hub token (trackers and cards are often public)."""
    return {
        key: (value.value if hasattr(value, "value") else value)
        for key, value in vars(args).items()
        if key != "hub_token"
    }


def _evaluate(model, dataloader, accelerator: Accelerator, task: TrainingTask) -> dict:
    """Metrics over the whole evaluation set; never redraws features, never touches the global RNG."""
    model.eval()
    parts: dict[str, list[torch.Tensor]] = {}
    for batch in dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        statistics = accelerator.gather_for_metrics(task.batch_statistics(outputs, batch))
        for name, values in statistics.items():
            parts.setdefault(name, []).append(values.cpu())
    model.train()
    return task.compute_metrics(**{name: torch.cat(values) for name, values in parts.items()})


@dataclass
class _Progress:
    """Position of the run; what ``trainer_state.json`` stores (with the batching its batch count is in)."""

    completed_steps: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    batching: dict = field(default_factory=dict)

    def state(self) -> dict:
        position = {
            "completed_steps": self.completed_steps,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
        }
        return {**position, **self.batching}


class _StepWindow:
    """The micro-batches of one optimizer step (its gradient accumulation window, on every process), weighed by
    what each one's mean loss averages over: the step's gradient is that of the mean over all of them, as one
    batch of the same examples gives (each micro-batch's mean weighed alike gave a masked-LM micro-batch with few
    masked tokens as much weight as one with many, and a short last window of an epoch half its weight). Its
    micro-batches backpropagate their loss sums (times the accumulation steps and processes that Accelerate and
    DDP divide by); :meth:`close` divides the gradients by the window's count. Under DeepSpeed, which owns the
    gradients, each micro-batch's mean weighs alike (``reweigh=False``)."""

    def __init__(self, accelerator: Accelerator, reweigh: bool):
        self.accelerator, self.reweigh = accelerator, reweigh
        self.totals = []  # this process's (items, loss sum) per micro-batch of the window, on the device

    def weighed(self, loss: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """What to backpropagate for a micro-batch's mean ``loss`` over ``items`` items (no device sync)."""
        items = items.to(device=loss.device, dtype=torch.float64)
        self.totals.append(torch.stack([items, loss.detach().double() * items]))
        if not self.reweigh:
            return loss * (items > 0).to(loss.dtype)  # a micro-batch that scores nothing adds nothing
        return (
            loss * items.to(loss.dtype) * self.accelerator.gradient_accumulation_steps * self.accelerator.num_processes
        )

    def close(self, model) -> float:
        """At the window's optimizer step: the gradients divided by its count (every process's), and its mean
        loss."""
        count, loss_sum = self.accelerator.reduce(torch.stack(self.totals).sum(dim=0), reduction="sum").tolist()
        if self.reweigh:
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.grad.div_(max(count, 1.0))
        self.totals = []
        return loss_sum / max(count, 1.0)


def _epoch_examples_only(batch: dict, accelerator: Accelerator, per_device: int) -> tuple[dict, int]:
    """``batch`` without the examples that Accelerate repeated from the start of the epoch's order to fill an epoch's
    short last global batch on several processes (``even_batches``), which that step counted as its own; and 1, or 0
    where all this process's rows are repeats (the batch still runs, since DDP needs every process's backward, and
    weighs nothing). The global batch holds the epoch's ``remainder`` own examples first, process by process."""
    state = accelerator.gradient_state
    if accelerator.num_processes == 1 or not state.end_of_dataloader or state.remainder <= 0:
        return batch, 1
    own = min(max(state.remainder - accelerator.process_index * per_device, 0), per_device)
    if own == 0:
        return batch, 0
    return {name: rows[:own] for name, rows in batch.items()}, 1


@dataclass(frozen=True)
class TrainingData:
    """What a run trains and evaluates on: the tokenized splits, a collator for each, and where the text came
    from (the dataset name or file, for the model card)."""

    train: Any
    validation: Any
    train_collator: Callable
    eval_collator: Callable
    source: str


def check_feature_redraws(args: argparse.Namespace, model) -> int | None:
    """Refuse a redraw schedule that ``model`` cannot follow (it has no random features, or LoRA would save the
    redrawn ones nowhere); on a Performer, set the schedule on its config, so that the saved config records it.
    Returns the interval of the redraws (None: none)."""
    redraw_interval = None
    if isinstance(model.config, PerformerConfig):  # other models (a baseline such as BigBird) have no features
        redraw_interval = args.feature_redraw_interval or model.config.feature_redraw_interval
        try:
            check_redraw(model.config, args.feature_redraw_interval)
        except ValueError as error:
            raise TrainingInputError(f"--feature_redraw_interval: {error}") from None
        if redraw_interval and args.lora_r is not None:
            raise TrainingInputError(
                f"--lora_r with feature redraws (every {redraw_interval} steps): {ADAPTER_REDRAW_PROBLEM}. "
                "Drop --feature_redraw_interval (a config that sets one: --config_overrides "
                "feature_redraw_interval=None), or train every weight (no --lora_r)."
            )
        model.config.feature_redraw_interval = redraw_interval
    elif args.feature_redraw_interval:
        raise TrainingInputError(
            f"--feature_redraw_interval redraws the random features of a Performer-family model; this "
            f"{model.config.model_type} model has none to redraw (with Performer attention, its features are fixed "
            "by projection_seed). Drop the argument."
        )
    return redraw_interval


def run_training(
    args: argparse.Namespace, task: TrainingTask, accelerator: Accelerator, model, tokenizer, data: TrainingData
) -> dict:
    """Train, evaluate, checkpoint, save the final model (+ tokenizer, card, ``all_results.json``) and
    optionally push it. Returns the final evaluation metrics (with ``train_*`` figures)."""
    redraw_interval = check_feature_redraws(args, model)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.overwrite_output_dir and args.resume_from_checkpoint is None:  # every check has passed
        if accelerator.is_main_process:
            clear_previous_run(args.output_dir, keep=(CONVERTED_SUBDIR,) if args.convert_from else ())
        accelerator.wait_for_everyone()

    # Explicit generators: iterating a DataLoader then draws its base seed from them, not from the
    # global RNG (which dropout uses), so evaluations and resumes leave the training RNG untouched.
    train_dataloader = DataLoader(
        data.train,
        shuffle=True,
        batch_size=args.per_device_train_batch_size,
        collate_fn=data.train_collator,
        generator=torch.Generator().manual_seed(args.seed),
    )
    eval_dataloader = DataLoader(
        data.validation,
        batch_size=args.per_device_eval_batch_size,
        collate_fn=data.eval_collator,
        generator=torch.Generator().manual_seed(args.seed),
    )
    optimizer = _optimizer(model, args, accelerator)

    plan = _Plan.from_args(
        args, _batches_per_process(len(data.train), args.per_device_train_batch_size, accelerator.num_processes)
    )
    # The prepared scheduler steps once per process per optimizer step, hence the factor.
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=plan.max_train_steps * accelerator.num_processes,
    )
    _configure_deepspeed(accelerator, args)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if len(train_dataloader) != plan.batches_per_epoch:  # a backend that shards differently
        plan = _Plan.from_args(args, len(train_dataloader))
    max_train_steps = plan.max_train_steps
    if args.with_tracking:
        accelerator.init_trackers(f"performer_{task.name}", _config_for_trackers(args))

    checkpoint_every = int(args.checkpointing_steps) if (args.checkpointing_steps or "").isdigit() else None
    total_batch = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(
        "***** Running training *****\n  examples = %d, epochs = %d, batch per device = %d, total batch = %d, "
        "accumulation = %d, optimizer steps = %d, feature redraw every %s steps",
        len(data.train),
        plan.num_epochs,
        args.per_device_train_batch_size,
        total_batch,
        args.gradient_accumulation_steps,
        max_train_steps,
        redraw_interval,
    )

    progress = _Progress(batching=batching(args, accelerator, len(data.train)))
    if args.resume_from_checkpoint:
        path = args.resume_from_checkpoint
        if path == "latest":
            path = find_latest_checkpoint(args.output_dir)
        logger.info("Resuming from checkpoint %s", path)
        state = load_checkpoint(accelerator, path, progress.batching)
        progress.completed_steps = state["completed_steps"]
        progress.epoch, progress.batches_in_epoch = resume_position(state, plan.batches_per_epoch)

    unwrapped = accelerator.unwrap_model(model)
    progress_bar = tqdm(
        total=max_train_steps,
        initial=progress.completed_steps,
        disable=not (accelerator.is_local_main_process and _shows_training_progress()),
    )
    metrics: dict = {}
    evaluated_at = -1
    first_step = progress.completed_steps + 1  # excluded from the throughput figure (warm-up)
    timed_seconds, timed_steps = 0.0, 0
    model.train()
    for epoch in range(progress.epoch, plan.num_epochs):
        if progress.completed_steps >= max_train_steps:
            break
        if epoch != progress.epoch:
            progress.epoch, progress.batches_in_epoch = epoch, 0
        train_dataloader.set_epoch(epoch)
        if hasattr(data.train_collator, "set_epoch"):
            data.train_collator.set_epoch(epoch)
        active = train_dataloader
        if progress.batches_in_epoch:
            active = accelerator.skip_first_batches(train_dataloader, progress.batches_in_epoch)
        window = _StepWindow(accelerator, reweigh=accelerator.distributed_type != DistributedType.DEEPSPEED)
        tick = time.perf_counter()
        for batch in active:
            with accelerator.accumulate(model):
                batch, counted = _epoch_examples_only(batch, accelerator, args.per_device_train_batch_size)
                items = task.loss_items(batch) * counted
                loss = model(**task.scorable(batch, items)).loss
                accelerator.backward(window.weighed(loss, items))
                grad_norm = None
                if accelerator.sync_gradients:
                    train_loss = window.close(model)
                    if args.max_grad_norm > 0:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            progress.batches_in_epoch += 1
            if not accelerator.sync_gradients:
                continue

            progress.completed_steps += 1
            step = progress.completed_steps
            progress_bar.update(1)
            redrawn = redraw_if_due(unwrapped, step, redraw_interval)
            step_seconds = time.perf_counter() - tick
            if step != first_step:
                timed_seconds, timed_steps = timed_seconds + step_seconds, timed_steps + 1
            progress_bar.set_postfix(loss=f"{train_loss:.4f}")
            if redrawn:
                logger.info(
                    "Redrew the FAVOR+ features after step %d (checksum %012x)", step, projection_checksum(unwrapped)
                )
            if args.with_tracking:
                record = {
                    "train_loss": train_loss,
                    "learning_rate": lr_scheduler.get_last_lr()[0],
                    "epoch": epoch,
                    "step_seconds": step_seconds,
                    "feature_redraw": redrawn,
                    "projection_checksums": _gathered_checksums(accelerator, unwrapped),
                }
                if grad_norm is not None:
                    record["grad_norm"] = float(grad_norm)
                accelerator.log(record, step=step)

            if args.eval_steps and step % args.eval_steps == 0:
                metrics = _evaluate(model, eval_dataloader, accelerator, task)
                evaluated_at = step
                _log_eval(accelerator, args, metrics, step)
            if checkpoint_every and step % checkpoint_every == 0:
                save_checkpoint(accelerator, os.path.join(args.output_dir, f"step_{step}"), progress.state())
            if step >= max_train_steps:
                break
            tick = time.perf_counter()

        if not args.eval_steps and evaluated_at != progress.completed_steps:
            metrics = _evaluate(model, eval_dataloader, accelerator, task)
            evaluated_at = progress.completed_steps
            _log_eval(accelerator, args, metrics, progress.completed_steps)
        if args.checkpointing_steps == "epoch":
            save_checkpoint(accelerator, os.path.join(args.output_dir, f"epoch_{epoch}"), progress.state())
    progress_bar.close()

    if evaluated_at != progress.completed_steps:
        metrics = _evaluate(model, eval_dataloader, accelerator, task)
        _log_eval(accelerator, args, metrics, progress.completed_steps)
    metrics = {f"eval_{name}": value for name, value in metrics.items()}
    metrics["train_steps"] = progress.completed_steps
    if timed_steps:
        metrics["train_steps_per_second"] = timed_steps / timed_seconds
    _save_final(args, task, accelerator, model, tokenizer, metrics, data.source)
    # Every process drops its DDP wrapper at the same point, while its peers are alive, then closes the
    # trackers and the process group: a gloo reducer torn down after a peer has exited can hang that
    # process at exit (seen here: one rank stuck in ~ProcessGroupGloo after the run had finished).
    accelerator.wait_for_everyone()
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
    accelerator.end_training()
    return metrics


def _gathered_checksums(accelerator: Accelerator, model) -> list[int]:
    """Every process's projection checksum, in rank order (a collective: call on all processes)."""
    local = torch.tensor([projection_checksum(model)], dtype=torch.float64, device=accelerator.device)
    return [int(value) for value in accelerator.gather(local).tolist()]


def _log_eval(accelerator: Accelerator, args: argparse.Namespace, metrics: dict, step: int) -> None:
    logger.info("step %d: %s", step, ", ".join(f"eval_{k} = {v:.4g}" for k, v in metrics.items()))
    if args.with_tracking:
        accelerator.log({f"eval_{name}": value for name, value in metrics.items()}, step=step)


def _adapter_settings(model) -> dict | None:
    """A PEFT model's LoRA settings and the base it goes on (where its base was loaded from), for the model card;
    None for a whole model."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return None
    settings = {key: getattr(config, key) for key in ("r", "lora_alpha", "lora_dropout", "target_modules")}
    return {**settings, "modules_to_save": config.modules_to_save, "base": config.base_model_name_or_path}


def _save_final(args, task: TrainingTask, accelerator: Accelerator, model, tokenizer, metrics, data_source) -> None:
    """save_pretrained + tokenizer + model card + all_results.json; push when asked."""
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        args.output_dir, is_main_process=accelerator.is_main_process, state_dict=accelerator.get_state_dict(model)
    )
    if not accelerator.is_main_process:
        return
    tokenizer.save_pretrained(args.output_dir)
    with open(os.path.join(args.output_dir, RESULTS_FILE), "w") as handle:
        json.dump(metrics, handle, indent=2)
    card = build_model_card(
        task.name,
        unwrapped.config,
        args.model_name_or_path or args.convert_from,
        data_source,
        metrics,
        {**_config_for_trackers(args), "num_processes": accelerator.num_processes},
        starting_folder=unwrapped.config._name_or_path or None,
        adapter=_adapter_settings(unwrapped),
    )
    write_model_card(args.output_dir, card)
    logger.info("Saved the model, tokenizer and card to %s", args.output_dir)
    if args.push_to_hub:
        from huggingface_hub import ModelCard

        repo_id = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
        try:
            unwrapped.push_to_hub(repo_id, token=args.hub_token, commit_message="Upload Performer model")
            tokenizer.push_to_hub(repo_id, token=args.hub_token, commit_message="Upload tokenizer")
            ModelCard(card).push_to_hub(repo_id, token=args.hub_token, commit_message="Upload model card")
        except HUB_ERRORS as error:  # the Hub refused, or could not be reached: the run itself is saved
            raise TrainingInputError(
                f"the model is saved in {args.output_dir}, but the Hub did not take {repo_id!r} ({one_line(error)}): "
                "check the network and that you are logged in (huggingface-cli login, or --hub_token) with write "
                "access, then upload that folder (huggingface-cli upload)."
            ) from error
        logger.info("Pushed the model, tokenizer and card to %s", repo_id)
