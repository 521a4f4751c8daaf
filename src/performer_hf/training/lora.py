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


def new_modules(model: nn.Module, new: set[str]) -> list[str] | None:
    """The modules to train and save beside the adapter: those the base's load drew anew (``new``: its weights'
    names), which a restore on the same base would draw again otherwise (a classifier's pooler, a masked LM's head
    on an encoder without one). The topmost modules whose weights are all new; a new weight of a module that also
    holds loaded ones (a masked LM's output bias beside the decoder tied to the embeddings) brings that module, unless
    it is a constant (zeros, ones), which the restore draws alike."""
    fresh = {
        name
        for name, module in model.named_modules()
        if name
        and (weights := {f"{name}.{p}" for p, _ in module.named_parameters(remove_duplicate=False)})
        and weights <= new
    }
    chosen = {name for name in fresh if name.rpartition(".")[0] not in fresh}
    for weight in sorted(new):
        if any(weight.startswith(f"{name}.") for name in chosen):
            continue
        try:
            value = model.get_parameter(weight).detach()
        except AttributeError:  # a buffer: not trained
            continue
        if value.numel() == 0 or bool((value == value.flatten()[0]).all()):
            continue  # a constant: drawn alike on restore
        owner = weight.rpartition(".")[0]
        if not owner:
            raise TrainingInputError(
                f"--lora_r: the base's {weight} is drawn anew at load and is no module's that the adapter could save. "
                "Train every weight (no --lora_r), or start from a checkpoint that has it."
            )
        chosen.add(owner)
    chosen = {name for name in chosen if not any(name.startswith(f"{other}.") for other in chosen)}
    return sorted(chosen) or None


def apply_lora(model: nn.Module, args: argparse.Namespace, task: str, new: set[str] = frozenset()) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with a LoRA of rank ``args.lora_r`` (alpha
    ``args.lora_alpha``, default twice the rank; dropout ``args.lora_dropout``). The modules of the weights its load
    drew anew (``new``: a classifier's head and pooler, a masked LM's head) train and are saved with the adapter
    (:func:`new_modules`; peft's ``SEQ_CLS`` task adds the classifier)."""
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
        modules_to_save=new_modules(model, set(new)),
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
