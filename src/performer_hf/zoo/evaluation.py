"""The evaluations a zoo recipe ends with; each returns the figures that go into the card.

Every evaluation returns ``{"task", "dataset", "rows"}``: ``rows`` maps a model description
(``"this model"`` first, then references such as the softmax source) to its metrics.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..conversion.fidelity import embedding_agreement, english_sentences, sentence_embeddings
from ..training.metrics import classification_metrics, language_modeling_metrics, token_statistics
from .data import DATA_SETS, read_records, read_texts
from .pretrain import token_blocks

logger = logging.getLogger(__name__)

THIS_MODEL = "this model"


def _quiet_load(cls, folder: Path, **kwargs):
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return cls.from_pretrained(folder, **kwargs).eval()
    finally:
        hf_logging.set_verbosity(verbosity)


def evaluate_embeddings(model_dir: Path, source_dir: Path, sentences: int = 200) -> dict:
    """Mean-pooled sentence embeddings of the Performer against its softmax source (``BertModel`` et al.,
    loaded by transformers) on ``sentences`` English sentences of Python's documentation."""
    from transformers import AutoModel, AutoTokenizer

    from ..modeling.modeling_performer import PerformerModel

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = english_sentences(sentences)
    source = _quiet_load(AutoModel, source_dir, attn_implementation="sdpa")
    performer = _quiet_load(PerformerModel, model_dir)
    agreement = embedding_agreement(
        sentence_embeddings(source, tokenizer, texts), sentence_embeddings(performer, tokenizer, texts)
    )
    return {
        "task": {"type": "feature-extraction", "name": "sentence embeddings"},
        "dataset": {"type": "pydoc_data.topics", "name": f"{len(texts)} English sentences of Python's documentation"},
        "rows": {
            THIS_MODEL: {
                "mean_cosine_to_source": agreement["mean_cosine"],
                "pairwise_spearman_to_source": agreement["pairwise_spearman"],
            }
        },
    }


@torch.no_grad()
def classification_figures(model_dir: Path, records: list[dict], batch_size: int = 64, max_length: int = 128) -> dict:
    """Accuracy, macro-F1 and the count of ``records`` (``text``, ``label``) for the classifier in ``model_dir``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = _quiet_load(AutoModelForSequenceClassification, model_dir)
    label2id = model.config.label2id
    parts: dict[str, list[torch.Tensor]] = {"loss_sum": [], "predictions": [], "references": []}
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        batch = tokenizer(
            [row["text"] for row in chunk], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        logits = model(**batch).logits.float()  # (b, num_labels)
        labels = torch.tensor([label2id[row["label"]] for row in chunk])
        parts["loss_sum"].append(torch.nn.functional.cross_entropy(logits, labels, reduction="none").double())
        parts["predictions"].append(logits.argmax(-1))
        parts["references"].append(labels)
    metrics = classification_metrics(**{name: torch.cat(values) for name, values in parts.items()})
    return {"accuracy": metrics["accuracy"], "f1": metrics["f1"], "examples": metrics["examples"]}


def evaluate_classification(
    model_dir: Path, test_file: Path, data: str, references: dict[str, Path] | None = None, **options
) -> dict:
    """Accuracy and macro-F1 on ``test_file`` (JSON lines with ``text`` and ``label``) of the classifier in
    ``model_dir`` and of each reference classifier (e.g. the softmax model finetuned the same way);
    ``options``: ``batch_size``, ``max_length``."""
    records = read_records(test_file)
    rows = {}
    for name, folder in {THIS_MODEL: model_dir, **(references or {})}.items():
        rows[name] = classification_figures(folder, records, **options)
        logger.info("%s: accuracy %.4f, F1 %.4f", name, rows[name]["accuracy"], rows[name]["f1"])
    return {
        "task": {"type": "text-classification", "name": "sentiment classification"},
        "dataset": {"type": data, "name": DATA_SETS[data], "split": "test"},
        "rows": rows,
    }


@torch.no_grad()
def language_modeling_figures(model, blocks: torch.Tensor, batch_size: int = 32) -> dict:
    """Perplexity and next-token accuracy of a causal LM over ``blocks`` (N, L), token-weighted."""
    parts: dict[str, list[torch.Tensor]] = {"loss_sum": [], "tokens": [], "correct": []}
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size]  # (b, L)
        statistics = token_statistics(model(input_ids=batch).logits, batch, shift=True)
        for name, values in statistics.items():
            parts[name].append(values)
    metrics = language_modeling_metrics(**{name: torch.cat(values) for name, values in parts.items()})
    return {"perplexity": metrics["perplexity"], "accuracy": metrics["accuracy"], "tokens": metrics["tokens"]}


def evaluate_language_modeling(
    model_dir: Path,
    test_file: Path,
    data: str,
    block_size: int,
    references: dict[str, Path],
    max_blocks: int | None = None,
    batch_size: int = 32,
) -> dict:
    """Perplexity / next-token accuracy on ``test_file`` (its first ``max_blocks`` blocks, default all) of
    the model in ``model_dir`` and of each reference (e.g. the softmax source, the Performer right
    after conversion), ``batch_size`` blocks at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    blocks = token_blocks(tokenizer, read_texts(test_file), block_size)[:max_blocks]  # (N, block_size)
    rows = {}
    for name, folder in {THIS_MODEL: model_dir, **references}.items():
        rows[name] = language_modeling_figures(_quiet_load(AutoModelForCausalLM, folder), blocks, batch_size)
        logger.info("%s: perplexity %.3f, accuracy %.4f", name, rows[name]["perplexity"], rows[name]["accuracy"])
    return {
        "task": {"type": "text-generation", "name": "causal language modeling"},
        "dataset": {"type": data, "name": DATA_SETS[data], "split": "test"},
        "rows": rows,
    }
