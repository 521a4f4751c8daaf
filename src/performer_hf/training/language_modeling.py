"""Masked (``run_mlm.py``) and causal (``run_clm.py``) language modeling."""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

from ..modeling.token_loss import IGNORE_INDEX
from .arguments import TrainingInputError, parse_args
from .collators import ReproducibleMaskingCollator, causal_lm_collate
from .data import language_modeling_datasets, load_raw_datasets
from .metrics import language_modeling_metrics, token_statistics
from .model_loading import load_model, load_tokenizer, removing_a_refused_conversion, resolve_sequence_length
from .trainer import TrainingData, TrainingTask, check_feature_redraws, create_accelerator, run_training

MODEL_CLASSES = {"mlm": AutoModelForMaskedLM, "clm": AutoModelForCausalLM}


def _score_a_token_if_none(batch: dict, items: torch.Tensor) -> dict:
    """``batch`` with its first row's last token scored (labelled as itself) when it scores no token (``items`` 0:
    a masked-LM micro-batch without a masked token), so that its mean loss is finite; the step weighs it by
    ``items``, 0. Decided on the device (no sync); the last token is scored with or without the causal shift."""
    labels = batch["labels"].clone()  # (batch, length)
    labels[0, -1] = torch.where(items > 0, labels[0, -1], batch["input_ids"][0, -1])
    return {**batch, "labels": labels}


def _task(name: str) -> TrainingTask:
    shift = name == "clm"
    return TrainingTask(
        name=name,
        batch_statistics=lambda outputs, batch: token_statistics(outputs.logits, batch["labels"], shift=shift),
        compute_metrics=language_modeling_metrics,
        loss_items=lambda batch: (batch["labels"][:, int(shift) :] != IGNORE_INDEX).sum(),  # the labelled tokens
        scorable=_score_a_token_if_none,
    )


def train_language_model(task: str, argv: list[str] | None = None) -> dict:
    """Run ``training/run_mlm.py`` (``task="mlm"``) or ``run_clm.py`` (``"clm"``) with ``argv``;
    returns the final metrics. Raises :class:`TrainingInputError` for bad input, before training."""
    args = parse_args(task, argv)
    accelerator = create_accelerator(args)
    tokenizer = load_tokenizer(args)
    with removing_a_refused_conversion(args, accelerator):
        model = load_model(args, MODEL_CLASSES[task], tokenizer, accelerator, task=task)
        check_feature_redraws(args, model)
        block_size = resolve_sequence_length(args.max_seq_length, model.config)
        args.max_seq_length = block_size
        if task == "mlm":
            train_collator = ReproducibleMaskingCollator(tokenizer, args.mlm_probability, args.seed)
            # Evaluation: another seed, epoch 0 forever, so every evaluation masks the same tokens.
            eval_collator = ReproducibleMaskingCollator(tokenizer, args.mlm_probability, args.seed + 1)
        else:
            train_collator = eval_collator = causal_lm_collate
        raw = load_raw_datasets(args)
        data = language_modeling_datasets(
            raw, tokenizer, args, accelerator, block_size, special_tokens_mask=task == "mlm"
        )
        source = args.dataset_name or args.train_file
        data = TrainingData(data["train"], data["validation"], train_collator, eval_collator, source)
    return run_training(args, _task(task), accelerator, model, tokenizer, data)


def main(task: str, argv: list[str] | None = None) -> None:
    """Console entry: bad input ends the run with one ``error:`` line (exit status 1)."""
    try:
        train_language_model(task, argv)
    except TrainingInputError as error:
        sys.exit(f"error: {error}")
