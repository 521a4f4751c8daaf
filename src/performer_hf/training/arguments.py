"""Command line shared by the training scripts.

Argument names follow transformers' ``run_mlm_no_trainer.py`` / ``run_clm_no_trainer.py`` /
``run_glue_no_trainer.py`` examples, so users can carry their commands over. Checks that need only
the arguments (files exist, values in range) run here; checks that need the model or the data run
where those are loaded, all before the first training step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import huggingface_hub

from performer_hf_cli import at_least, output_replaces_source

from .redraw import ADAPTER_REDRAW_PROBLEM

TASKS = ("mlm", "clm", "classification")

# File extension -> `datasets` builder.
DATA_FILE_BUILDERS = {"txt": "text", "text": "text", "json": "json", "jsonl": "json", "csv": "csv"}

# the schedules transformers' get_scheduler builds from the arguments alone (a str, as typed on the command line)
LR_SCHEDULER_TYPES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)

REPORT_TO_JSON = "json"
LOG_FILE = "train_log.jsonl"  # the JSON tracker's records of a run
CHECKPOINT_NAME = re.compile(r"^(step|epoch)_\d+$")  # the folders --checkpointing_steps writes
ADAPTER_CONFIG = "adapter_config.json"  # what marks a LoRA (peft) adapter folder


class TrainingInputError(ValueError):
    """Bad input (arguments, files, columns, lengths) found before any training starts."""


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def _add_data_arguments(parser: argparse.ArgumentParser, task: str) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--dataset_name", help="A dataset on the Hub (needs network access).")
    group.add_argument("--dataset_config_name", help="The configuration of --dataset_name.")
    group.add_argument("--train_file", help="A local .txt, .json/.jsonl or .csv file with the training data.")
    group.add_argument("--validation_file", help="A local file with the evaluation data (same format as train).")
    group.add_argument(
        "--validation_split_percentage",
        type=int,
        default=5,
        help="Without a validation set: the percentage of the training set held out for evaluation.",
    )
    group.add_argument(
        "--text_column_name",
        help="Column holding the text (default: 'text' if present, else the first column that is not the label).",
    )
    if task == "classification":
        group.add_argument("--text_pair_column_name", help="Optional second text column (sentence pairs).")
        group.add_argument("--label_column_name", default="label", help="Column holding the labels.")
    group.add_argument(
        "--max_seq_length",
        "--block_size",
        dest="max_seq_length",
        type=at_least(1),
        help=(
            "Tokens per example: the block length texts are grouped into (language modeling) or the truncation "
            "length (classification). Default: the model's number of positions."
        ),
    )
    if task == "mlm":
        group.add_argument(
            "--mlm_probability", type=float, default=0.15, help="Share of tokens masked for the MLM loss."
        )
    group.add_argument("--max_train_samples", type=at_least(1), help="Keep only this many training examples.")
    group.add_argument("--max_eval_samples", type=at_least(1), help="Keep only this many evaluation examples.")
    group.add_argument("--preprocessing_num_workers", type=at_least(1), help="Processes for tokenization.")
    group.add_argument("--overwrite_cache", action="store_true", help="Redo tokenization instead of using the cache.")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model_name_or_path", help="A Performer checkpoint: a local folder or a Hub id.")
    group.add_argument(
        "--config_name", help="Train from scratch: a PerformerConfig (folder or JSON file) instead of weights."
    )
    group.add_argument(
        "--config_overrides",
        help=(
            "Comma-separated config values, e.g. 'num_hidden_layers=2,hidden_size=64,attention_kernel=relu'. "
            "Applied to the config of a new, loaded or converted model."
        ),
    )
    group.add_argument(
        "--convert_from",
        help=(
            "A softmax checkpoint (folder or Hub id) converted into OUTPUT_DIR/converted before training, as "
            "`performer-hf convert` does: BERT / RoBERTa / GPT-2 to a Performer, Llama / Mistral / Qwen2 / Qwen3 / "
            "Gemma3 in place (its own class with Performer attention)."
        ),
    )
    group.add_argument(
        "--convert_method",
        help=(
            "The attention method --convert_from converts to (`performer-hf convert --method`: e.g. hybrid, favor, "
            "sparse; default: the converter's); its settings go in --config_overrides."
        ),
    )
    group.add_argument("--tokenizer_name", help="Tokenizer folder or Hub id (default: the model's).")
    group.add_argument(
        "--trust_remote_code", action="store_true", help="Allow custom code from the checkpoint when loading."
    )
    group.add_argument(
        "--feature_redraw_interval",
        type=at_least(1),
        help=(
            "Redraw the FAVOR+ random features every N optimizer steps, seeded from the step so that all "
            "processes draw the same features (default: the config's feature_redraw_interval; never if unset)."
        ),
    )
    group.add_argument(
        "--gradient_checkpointing", action="store_true", help="Recompute activations in backward to save memory."
    )
    lora = parser.add_argument_group("LoRA (peft): train low-rank adapters of the attention, the rest frozen")
    lora.add_argument("--lora_r", type=at_least(1), help="LoRA rank (default: no LoRA, every weight trains).")
    lora.add_argument("--lora_alpha", type=float, help="LoRA scaling numerator (default: twice --lora_r).")
    lora.add_argument("--lora_dropout", type=_non_negative_float, default=0.0, help="Dropout on the LoRA input.")
    lora.add_argument(
        "--lora_target_modules",
        nargs="+",
        help="Module names to adapt (default: the attention projections of the model's type, "
        "performer_hf.training.lora.LORA_TARGET_MODULES).",
    )


def _add_optimization_arguments(parser: argparse.ArgumentParser, task: str) -> None:
    group = parser.add_argument_group("optimization")
    group.add_argument("--per_device_train_batch_size", type=at_least(1), default=8)
    group.add_argument("--per_device_eval_batch_size", type=at_least(1), default=8)
    group.add_argument("--learning_rate", type=_positive_float, default=5e-5 if task != "classification" else 2e-5)
    group.add_argument("--weight_decay", type=_non_negative_float, default=0.0)
    group.add_argument("--num_train_epochs", type=at_least(1), default=3)
    group.add_argument(
        "--max_train_steps", type=at_least(1), help="Optimizer steps to run; overrides --num_train_epochs."
    )
    group.add_argument("--gradient_accumulation_steps", type=at_least(1), default=1)
    group.add_argument(
        "--lr_scheduler_type",
        default="linear",
        choices=LR_SCHEDULER_TYPES,
        help="The learning-rate schedule after the warm-up (transformers' get_scheduler).",
    )
    group.add_argument("--num_warmup_steps", type=int, default=0, help="Optimizer steps of linear warm-up.")
    group.add_argument(
        "--max_grad_norm",
        type=_non_negative_float,
        default=0.5,
        help="Clip the gradient norm to this value (0 disables clipping). Default 0.5, as in the Performer paper.",
    )
    group.add_argument(
        "--mixed_precision",
        choices=("no", "fp16", "bf16"),
        help="Mixed precision (default: whatever `accelerate launch` / `accelerate config` says, else 'no').",
    )
    group.add_argument("--seed", type=int, default=42, help="Seed for initialisation, data order and masking.")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run")
    group.add_argument("--output_dir", required=True, help="Where checkpoints, logs and the final model go.")
    group.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help=(
            "Start over in an --output_dir that is not empty: everything in it (a previous run's model, log and "
            "checkpoints) is removed, once every check has passed, just before training."
        ),
    )
    group.add_argument(
        "--checkpointing_steps",
        help="Save a resumable checkpoint every N optimizer steps, or 'epoch' at the end of every epoch.",
    )
    group.add_argument(
        "--resume_from_checkpoint",
        help="A checkpoint folder written by --checkpointing_steps, or 'latest' for the newest in --output_dir.",
    )
    group.add_argument(
        "--eval_steps",
        type=at_least(1),
        help="Evaluate every N optimizer steps (default: at the end of every epoch).",
    )
    group.add_argument(
        "--with_tracking", action="store_true", help="Log metrics with the trackers named by --report_to."
    )
    group.add_argument(
        "--report_to",
        default=REPORT_TO_JSON,
        help="Trackers, comma-separated: 'json' (train_log.jsonl in --output_dir), 'tensorboard', 'wandb' or 'all'.",
    )
    group.add_argument("--push_to_hub", action="store_true", help="Push the final model, tokenizer and card.")
    group.add_argument("--hub_model_id", help="Repository to push to (default: the name of --output_dir).")
    group.add_argument("--hub_token", help="Token for --push_to_hub (default: the logged-in user's).")


def build_parser(task: str) -> argparse.ArgumentParser:
    """The argument parser of ``training/run_<task>.py``; ``task`` is one of :data:`TASKS`."""
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; choose one of {TASKS}.")
    descriptions = {
        "mlm": "Masked language modeling with a Performer, driven by Accelerate.",
        "clm": "Causal language modeling with a Performer, driven by Accelerate.",
        "classification": "Sequence classification finetuning of a Performer, driven by Accelerate.",
    }
    parser = argparse.ArgumentParser(description=descriptions[task])
    _add_data_arguments(parser, task)
    _add_model_arguments(parser)
    _add_optimization_arguments(parser, task)
    _add_run_arguments(parser)
    return parser


def _data_file_builder(path: str, flag: str) -> str:
    if not os.path.isfile(path):
        raise TrainingInputError(f"{flag} {path!r} does not exist (or is not a file).")
    extension = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    if extension not in DATA_FILE_BUILDERS:
        raise TrainingInputError(
            f"{flag} {path!r} has an unsupported extension {extension!r}; use one of {sorted(DATA_FILE_BUILDERS)}."
        )
    if os.path.getsize(path) == 0:
        raise TrainingInputError(f"{flag} {path!r} is empty.")
    return DATA_FILE_BUILDERS[extension]


def validate_args(args: argparse.Namespace, task: str) -> None:
    """Checks that need only the arguments; raises :class:`TrainingInputError` naming the fix."""
    if args.dataset_name is None and args.train_file is None:
        raise TrainingInputError("No training data: pass --train_file (local file) or --dataset_name (Hub).")
    if args.dataset_name is not None and args.train_file is not None:
        raise TrainingInputError("Pass either --dataset_name or --train_file, not both.")
    if args.train_file is not None:
        builder = _data_file_builder(args.train_file, "--train_file")
        if args.validation_file is not None and _data_file_builder(args.validation_file, "--validation_file") != (
            builder
        ):
            raise TrainingInputError("--train_file and --validation_file must have the same format.")
    if args.validation_file is not None and args.train_file is None:
        raise TrainingInputError("--validation_file needs a local --train_file.")
    if not 0 < args.validation_split_percentage < 100:
        raise TrainingInputError(
            f"--validation_split_percentage must be between 1 and 99, got {args.validation_split_percentage}."
        )

    if args.model_name_or_path is not None and args.convert_from is not None:
        raise TrainingInputError("Pass either --model_name_or_path or --convert_from, not both.")
    if args.convert_method is not None and args.convert_from is None:
        raise TrainingInputError("--convert_method is the method --convert_from converts to: pass --convert_from too.")
    if args.config_name is not None and (args.model_name_or_path or args.convert_from):
        raise TrainingInputError(
            "--config_name builds a new model from scratch; it cannot be combined with --model_name_or_path or "
            "--convert_from (use --config_overrides to change a loaded model's config)."
        )
    for flag in ("model_name_or_path", "convert_from", "config_name", "tokenizer_name"):
        value = getattr(args, flag)
        # Hub ids look like 'name' or 'org/name'; anything path-like must exist locally.
        if value is not None and value.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(value)):
            raise TrainingInputError(f"--{flag} {value!r} does not exist.")
    _check_not_an_adapter(args.model_name_or_path)
    for flag in ("model_name_or_path", "convert_from"):
        start = getattr(args, flag)
        if start is not None and (replaced := output_replaces_source(Path(args.output_dir), Path(start).expanduser())):
            raise TrainingInputError(f"--output_dir: {replaced}")
    if args.tokenizer_name is None and args.model_name_or_path is None and args.convert_from is None:
        raise TrainingInputError("Training from scratch needs a tokenizer: pass --tokenizer_name (a folder or Hub id).")

    if task == "classification":
        texts = {"--text_column_name": args.text_column_name, "--text_pair_column_name": args.text_pair_column_name}
        for flag, column in texts.items():
            if column is not None and column == args.label_column_name:
                raise TrainingInputError(
                    f"{flag} and --label_column_name both name {column!r}: the model would read its labels. Name the "
                    "column of the text."
                )
    if task == "mlm" and not 0.0 < args.mlm_probability < 1.0:
        raise TrainingInputError(f"--mlm_probability must be in (0, 1), got {args.mlm_probability}.")
    if args.checkpointing_steps is not None and args.checkpointing_steps != "epoch":
        if not args.checkpointing_steps.isdigit() or int(args.checkpointing_steps) < 1:
            raise TrainingInputError(
                f"--checkpointing_steps must be a positive number of steps or 'epoch', got "
                f"{args.checkpointing_steps!r}."
            )
    _check_output_dir(args)
    if args.resume_from_checkpoint not in (None, "latest") and not os.path.isdir(args.resume_from_checkpoint):
        raise TrainingInputError(
            f"--resume_from_checkpoint {args.resume_from_checkpoint!r} is not a folder; pass a checkpoint folder "
            "written by --checkpointing_steps, or 'latest'."
        )
    if args.num_warmup_steps < 0:
        raise TrainingInputError(f"--num_warmup_steps must be >= 0, got {args.num_warmup_steps}.")
    lora_options = [flag for flag in ("lora_alpha", "lora_target_modules") if getattr(args, flag) is not None]
    if args.lora_r is None and (lora_options or args.lora_dropout):
        raise TrainingInputError(f"--{(lora_options or ['lora_dropout'])[0]} needs --lora_r (the LoRA rank).")
    if args.lora_r is not None and args.model_name_or_path is None and args.convert_from is None:
        raise TrainingInputError(
            "--lora_r adapts a pretrained model and saves the adapter alone, without the base weights: a base built "
            "from scratch would be lost. Pass --model_name_or_path or --convert_from, or train every weight (no "
            "--lora_r)."
        )
    if args.lora_r is not None and args.feature_redraw_interval:
        raise TrainingInputError(
            f"--lora_r with --feature_redraw_interval {args.feature_redraw_interval}: {ADAPTER_REDRAW_PROBLEM}. Drop "
            "--feature_redraw_interval, or train every weight (no --lora_r)."
        )
    if args.with_tracking:
        _check_trackers(args.report_to)
    if args.push_to_hub and huggingface_hub.constants.HF_HUB_OFFLINE:
        raise TrainingInputError(
            "--push_to_hub with HF_HUB_OFFLINE set: the run could not push its model at the end. Unset "
            "HF_HUB_OFFLINE, or drop --push_to_hub (and push the output folder later)."
        )


def _check_not_an_adapter(model_name_or_path: str | None) -> None:
    """Refuse a LoRA run's output (an adapter: ``adapter_config.json``) as the model to train: transformers loads it
    as base + adapter, which a full run could not backpropagate through and ``--lora_r`` replaced with a new
    adapter."""
    if model_name_or_path is None:
        return
    adapter_config = Path(model_name_or_path).expanduser() / ADAPTER_CONFIG
    if not adapter_config.is_file():
        return
    try:
        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        base = None
    raise TrainingInputError(
        f"--model_name_or_path {model_name_or_path!r} is a LoRA adapter ({ADAPTER_CONFIG}), not a model to train: "
        f"pass its base ({base or 'the model it was trained on'}) as --model_name_or_path to train a new adapter, or "
        f"merge it first (PeftModel.from_pretrained(base, {model_name_or_path!r}).merge_and_unload()"
        ".save_pretrained(folder), with the tokenizer) and pass that folder."
    )


def _check_trackers(report_to: str) -> None:
    """``--report_to``: known tracker names whose packages are installed (Accelerate dropped a missing one
    silently and raised its own traceback for an unknown name)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    names = [name.strip() for name in report_to.split(",") if name.strip()]
    known = {REPORT_TO_JSON, "all", *LOGGER_TYPE_TO_CLASS}
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise TrainingInputError(
            f"--report_to {report_to!r}: {', '.join(map(repr, unknown)) or 'no tracker'} is not a tracker; name "
            f"{REPORT_TO_JSON!r}, 'all' or any of {', '.join(sorted(LOGGER_TYPE_TO_CLASS))}, comma-separated."
        )
    from accelerate.utils import imports

    for name in names:
        available = getattr(imports, f"is_{name}_available", None)
        if name in LOGGER_TYPE_TO_CLASS and available is not None and not available():
            raise TrainingInputError(
                f"--report_to {name}: its package is not installed (pip install {name}); "
                f"install it, or report to another tracker ({REPORT_TO_JSON!r} needs nothing)."
            )


def _check_output_dir(args: argparse.Namespace) -> None:
    """A new run writes its model, tokenizer, card and log into ``--output_dir``: refuse a folder with anything in it
    (a previous run, whose adapter_config.json would make the new model load as the old one; the user's own
    README.md or config.json, which the run would overwrite) unless it resumes there or ``--overwrite_output_dir``
    replaces its contents, which must then hold none of the run's inputs."""
    output_dir = args.output_dir
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise TrainingInputError(f"--output_dir {output_dir!r} exists and is not a folder.")
    if args.resume_from_checkpoint is not None:
        return
    if args.overwrite_output_dir:
        output = Path(output_dir).expanduser().resolve()
        for flag in ("train_file", "validation_file", "tokenizer_name", "config_name"):
            value = getattr(args, flag, None)
            if value is not None and output in Path(value).expanduser().resolve().parents:
                raise TrainingInputError(
                    f"--{flag} {value!r} is inside --output_dir {output_dir!r}, whose contents "
                    "--overwrite_output_dir removes. Move it out, or choose another --output_dir."
                )
        return
    contents = sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    if not contents:
        return
    previous = previous_run(output_dir)
    held = (
        f"holds a previous run ({', '.join(previous[:3])}): a new run would append to its log, and 'latest' would "
        "resume its checkpoints"
        if previous
        else f"exists and is not empty ({', '.join(contents[:3])}{', ...' if len(contents) > 3 else ''}): the run "
        "would write its model, tokenizer and card (README.md) among them, overwriting or mixing with what is there"
    )
    raise TrainingInputError(
        f"--output_dir {output_dir!r} {held}. Pass --resume_from_checkpoint latest to continue a run there, "
        "--overwrite_output_dir to replace its contents, or another --output_dir."
    )


def previous_run(output_dir: str) -> list[str]:
    """What a previous run left in ``output_dir`` besides its final model: its log and checkpoint folders."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(name for name in os.listdir(output_dir) if name == LOG_FILE or CHECKPOINT_NAME.match(name))


def parse_args(task: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line of ``training/run_<task>.py``."""
    args = build_parser(task).parse_args(argv)
    validate_args(args, task)
    return args
