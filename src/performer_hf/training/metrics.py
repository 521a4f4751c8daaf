"""Evaluation metrics computed locally (``evaluate.load`` needs the Hub, which may be unreachable).

Per-example statistics are computed on each process, gathered with
``accelerator.gather_for_metrics`` (which drops the duplicates padding the last batch), then reduced
here, so the figures do not depend on how the data was sharded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_statistics(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> dict[str, torch.Tensor]:
    """Per-example sums for token-level language-modeling metrics.

    logits: (B, L, V); labels: (B, L) with ``-100`` where nothing is scored. ``shift=True`` scores
    position ``t`` against label ``t + 1`` (causal LM). Returns ``loss_sum``, ``tokens`` and
    ``correct``, each (B,) float64.
    """
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]  # (B, L-1, V), (B, L-1)
    scored = labels != IGNORE_INDEX  # (B, L)
    # rows of (B * L, V): cross_entropy over the (B, V, L) transpose accumulates the log-sum-exp along a strided
    # axis, 1.5e-4 off in the mean loss of a 49K-token vocabulary (SmolLM2) where rows are 1e-5 off float64
    losses = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)  # (B, L), 0 where ignored
    correct = (logits.argmax(dim=-1) == labels) & scored  # (B, L)
    return {
        "loss_sum": losses.double().sum(dim=1),
        "tokens": scored.double().sum(dim=1),
        "correct": correct.double().sum(dim=1),
    }


def language_modeling_metrics(loss_sum: torch.Tensor, tokens: torch.Tensor, correct: torch.Tensor) -> dict:
    """Token-weighted ``loss``, ``perplexity`` = exp(loss) and token ``accuracy`` over all examples."""
    total = float(tokens.sum())
    if total == 0:
        return {"loss": float("nan"), "perplexity": float("nan"), "accuracy": float("nan"), "tokens": 0}
    loss = float(loss_sum.sum()) / total
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = float("inf")
    return {"loss": loss, "perplexity": perplexity, "accuracy": float(correct.sum()) / total, "tokens": int(total)}


def accuracy(predictions: torch.Tensor, references: torch.Tensor) -> float:
    """Share of ``predictions`` equal to ``references`` (both (N,) class ids)."""
    return float((predictions == references).double().mean()) if references.numel() else float("nan")


def macro_f1(predictions: torch.Tensor, references: torch.Tensor) -> float:
    """Unweighted mean over classes of F1 = 2 TP / (2 TP + FP + FN).

    Classes are those occurring in ``references`` or ``predictions`` (scikit-learn's default); a
    class predicted but never present scores 0.
    """
    classes = torch.unique(torch.cat([predictions, references]))
    if classes.numel() == 0:
        return float("nan")
    scores = []
    for label in classes:
        predicted, actual = predictions == label, references == label
        true_positives = float((predicted & actual).sum())
        denominator = 2 * true_positives + float((predicted & ~actual).sum()) + float((~predicted & actual).sum())
        scores.append(2 * true_positives / denominator)
    return sum(scores) / len(scores)


def classification_metrics(loss_sum: torch.Tensor, predictions: torch.Tensor, references: torch.Tensor) -> dict:
    """Mean ``loss``, ``accuracy`` and macro ``f1`` over all examples."""
    count = references.numel()
    return {
        "loss": float(loss_sum.sum()) / count if count else float("nan"),
        "accuracy": accuracy(predictions, references),
        "f1": macro_f1(predictions, references),
        "examples": count,
    }
