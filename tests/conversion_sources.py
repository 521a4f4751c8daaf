"""Tiny randomly initialised source checkpoints for conversion: one table of cases (BERT, RoBERTa, GPT-2; heads and
bare models) shared by the conversion, CLI and hybrid-model tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    BertConfig,
    GPT2Config,
    RobertaConfig,
)

TINY_BERT = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
    type_vocab_size=2,
)
TINY_GPT2 = dict(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=98, eos_token_id=98)


@dataclass(frozen=True)
class Case:
    """One source model: transformers ``architecture`` on ``config``, loaded back with ``auto``, converts to
    ``target``; ``pad_token_id`` is the source's."""

    name: str
    architecture: str
    config: object
    auto: type
    target: str
    pad_token_id: int


CASES = [
    Case("bert-mlm", "BertForMaskedLM", BertConfig(**TINY_BERT), AutoModelForMaskedLM, "PerformerForMaskedLM", 0),
    Case(
        "roberta-mlm",
        "RobertaForMaskedLM",
        RobertaConfig(**TINY_BERT, pad_token_id=1),
        AutoModelForMaskedLM,
        "PerformerForMaskedLM",
        1,
    ),
    Case("gpt2-lm", "GPT2LMHeadModel", GPT2Config(**TINY_GPT2), AutoModelForCausalLM, "PerformerForCausalLM", 0),
    Case(
        "bert-cls",
        "BertForSequenceClassification",
        BertConfig(**TINY_BERT, num_labels=3),
        AutoModelForSequenceClassification,
        "PerformerForSequenceClassification",
        0,
    ),
    Case(
        "roberta-cls",
        "RobertaForSequenceClassification",
        RobertaConfig(**TINY_BERT, pad_token_id=1, num_labels=3),
        AutoModelForSequenceClassification,
        "PerformerForSequenceClassification",
        1,
    ),
    Case("bert-base", "BertModel", BertConfig(**TINY_BERT), AutoModel, "PerformerModel", 0),
    Case("gpt2-base", "GPT2Model", GPT2Config(**TINY_GPT2), AutoModel, "PerformerModel", 0),
    Case(
        "bert-pretraining",
        "BertForPreTraining",
        BertConfig(**TINY_BERT),
        AutoModelForMaskedLM,
        "PerformerForMaskedLM",
        0,
    ),
]


def save_source(case: Case, folder: Path, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised source model of ``case`` saved to ``folder`` (LayerNorms perturbed so
    that they matter); returns it in eval mode."""
    torch.manual_seed(seed)
    model = getattr(transformers, case.architecture)(case.config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or "ln_" in name or "layer_norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    return model
