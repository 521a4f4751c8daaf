"""Sequence classification finetuning (``run_classification.py``)."""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForSequenceClassification

from .arguments import TrainingInputError, parse_args
from .collators import classification_collator
from .data import build_label_mapping, classification_datasets, label_values, load_raw_datasets
from .metrics import classification_metrics
from .model_loading import load_model, load_tokenizer, removing_a_refused_conversion, resolve_sequence_length
from .trainer import TrainingData, TrainingTask, check_feature_redraws, create_accelerator, run_training

logger = logging.getLogger(__name__)


def _batch_statistics(outputs, batch) -> dict[str, torch.Tensor]:
    logits, labels = outputs.logits.float(), batch["labels"]  # (B, num_labels), (B,)
    return {
        "loss_sum": F.cross_entropy(logits, labels, reduction="none").double(),
        "predictions": logits.argmax(dim=-1),
        "references": labels,
    }


CLASSIFICATION_TASK = TrainingTask(
    name="classification", batch_statistics=_batch_statistics, compute_metrics=classification_metrics
)


def _existing_label2id(args) -> dict | None:
    """A loaded classifier's own label mapping, unless it is the LABEL_<i> placeholder."""
    if args.model_name_or_path is None:
        return None
    try:
        config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    except OSError as error:
        raise TrainingInputError(f"Could not load a model from {args.model_name_or_path!r}: {error}") from error
    label2id = getattr(config, "label2id", None) or {}
    if all(key == f"LABEL_{index}" for key, index in label2id.items()):
        return None
    return label2id


def train_classifier(argv: list[str] | None = None) -> dict:
    """Run ``training/run_classification.py`` with ``argv``; returns the final metrics. Raises
    :class:`TrainingInputError` for bad input, before training."""
    args = parse_args("classification", argv)
    accelerator = create_accelerator(args)
    raw = load_raw_datasets(args)
    existing = _existing_label2id(args)
    label2id = build_label_mapping(label_values(raw["train"], args.label_column_name), existing)
    other_labels = existing is not None and set(existing) != set(label2id)
    if other_labels:
        logger.warning(
            "%s was trained on the labels %s, this run's are %s: its classifier is drawn anew.",
            args.model_name_or_path,
            sorted(existing),
            sorted(label2id),
        )
    if len(label2id) < 2:
        raise TrainingInputError(
            f"Column {args.label_column_name!r} has a single label {list(label2id)}; classification needs at least two."
        )
    tokenizer = load_tokenizer(args)
    if tokenizer.pad_token is None:
        raise TrainingInputError(
            f"The tokenizer of {args.tokenizer_name or args.model_name_or_path or args.convert_from!r} has no pad "
            "token, which classification batches are padded with. Give it one (e.g. tokenizer.pad_token = "
            "tokenizer.eos_token; tokenizer.save_pretrained(folder)) and pass that folder as --tokenizer_name."
        )
    with removing_a_refused_conversion(args, accelerator):
        model = load_model(
            args,
            AutoModelForSequenceClassification,
            tokenizer,
            accelerator,
            new_head=True,
            redraw_head=other_labels,
            task="classification",
            num_labels=len(label2id),
            label2id=label2id,
            id2label={index: name for name, index in label2id.items()},
            problem_type="single_label_classification",
        )
        check_feature_redraws(args, model)
        max_length = resolve_sequence_length(args.max_seq_length, model.config)
        args.max_seq_length = max_length
        data = classification_datasets(raw, tokenizer, args, accelerator, label2id, max_length)
        collator = classification_collator(tokenizer, accelerator.mixed_precision)
        source = args.dataset_name or args.train_file
        data = TrainingData(data["train"], data["validation"], collator, collator, source)
    return run_training(args, CLASSIFICATION_TASK, accelerator, model, tokenizer, data)


def main(argv: list[str] | None = None) -> None:
    """Console entry: bad input ends the run with one ``error:`` line (exit status 1)."""
    try:
        train_classifier(argv)
    except TrainingInputError as error:
        sys.exit(f"error: {error}")
