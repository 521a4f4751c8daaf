"""LoRA finetuning through peft: the training scripts' ``--lora_r`` and friends.

:data:`LORA_TARGET_MODULES` is the one table of the modules LoRA adapts, per ``model_type``: the attention's
query, key, value and output projections of the Performer family and of the architectures that
``performer_hf.integrations`` gives Performer attention (peft matches a name as a suffix after a ``.``, so a name
that another module shares is qualified by its parent: GPT-2's ``attn.c_proj``, not each MLP's ``mlp.c_proj``). The
rest of the model is frozen; the run saves the adapter (``adapter_config.json``, ``adapter_model.safetensors``),
which ``PeftModel.from_pretrained(base, folder)`` puts back on the base model.
"""

from __future__ import annotations

import argparse
import logging

from torch import nn

from .arguments import TrainingInputError

logger = logging.getLogger(__name__)

_LLAMA_STYLE = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_TARGET_MODULES: dict[str, list[str]] = {
    "performer": ["query", "key", "value", "output"],
    "llama": _LLAMA_STYLE,
    "mistral": _LLAMA_STYLE,
    "qwen2": _LLAMA_STYLE,
    "qwen3": _LLAMA_STYLE,
    "gemma3_text": _LLAMA_STYLE,
    "gpt2": ["attn.c_attn", "attn.c_proj"],
    "bert": ["query", "key", "value", "attention.output.dense"],
    "roberta": ["query", "key", "value", "attention.output.dense"],
}

TASK_TYPES = {"mlm": None, "clm": "CAUSAL_LM", "classification": "SEQ_CLS"}


def target_modules(model: nn.Module, requested: list[str] | None) -> list[str]:
    """``--lora_target_modules``, else the table's entry for the model's ``model_type``."""
    if requested:
        return requested
    model_type = model.config.model_type
    if model_type not in LORA_TARGET_MODULES:
        raise TrainingInputError(
            f"no LoRA target modules are known for model_type {model_type!r}; pass --lora_target_modules "
            f"(module names, e.g. q_proj v_proj). Known: {', '.join(sorted(LORA_TARGET_MODULES))}."
        )
    return LORA_TARGET_MODULES[model_type]


def _head_modules(model: nn.Module, task: str) -> list[str] | None:
    """What a classifier trains and saves beside its ``classifier`` (peft's ``SEQ_CLS`` task keeps that one): its
    pooler, which a masked LM's checkpoint does not have (it starts random), so that the adapter gives it back."""
    if task != "classification":
        return None
    return ["pooler"] if any(name.split(".")[-1] == "pooler" for name, _ in model.named_modules()) else None


def apply_lora(model: nn.Module, args: argparse.Namespace, task: str) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with a LoRA of rank ``args.lora_r`` (alpha
    ``args.lora_alpha``, default twice the rank; dropout ``args.lora_dropout``); classification keeps the new
    head trainable and saves it with the adapter (peft's ``SEQ_CLS`` task: the classifier; and the pooler)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise TrainingInputError(
            "--lora_r needs peft: pip install 'performer-hf[train]' (or pip install peft)."
        ) from error
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r,
        lora_dropout=args.lora_dropout,
        target_modules=target_modules(model, args.lora_target_modules),
        task_type=TASK_TYPES[task],
        modules_to_save=_head_modules(model, task),
    )
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as error:  # e.g. target modules the model does not have
        raise TrainingInputError(f"LoRA could not be applied: {error}") from error
    trainable, total = wrapped.get_nb_trainable_parameters()
    logger.info(
        "LoRA r=%d on %s: %d of %d parameters trainable (%.2f%%)",
        args.lora_r,
        ", ".join(config.target_modules),
        trainable,
        total,
        100 * trainable / total,
    )
    return wrapped
