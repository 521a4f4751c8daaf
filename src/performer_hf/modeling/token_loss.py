"""Token cross entropy in float32 (at least) without a float32 copy of the logits.

``F.cross_entropy(logits.float(), labels)`` keeps a float32 copy of the (tokens, vocabulary) logits and its
float32 log-softmax for backward: at 16K tokens and BERT's 30,522 words, 4 GB beside the bfloat16 logits, most of a
training step's peak. Here each chunk of rows gets its float32 log-softmax, of which only the labels' entries are kept,
and backward recomputes each chunk's softmax from the logits: beyond the logits and their gradient (in their dtype),
one chunk.
On a CPU, in cache-sized chunks, it is also faster: 1.9x / 3.8x ``F.cross_entropy(logits.float())`` forward and
backward at 4,096 tokens x 30,522 words in float32 / bfloat16 (2 threads). On CUDA each chunk's forward (the labels'
log-probabilities) and backward (softmax minus the one-hot label, times the gradient) run compiled
(:mod:`.device_compile`), fused, where eager PyTorch writes and reads float32 copies of the chunk (an H200 step of
16K tokens took 3.8 ms longer than the source's bfloat16 loss, eager). Compiled, nothing of a chunk's size is
written but the gradient: forward reduces each row, backward reads the logits and writes their gradient. So all rows
go in one chunk there (no gradient copied into place), and backward subtracts the label by comparing column indices
with it, not by a scatter into the softmax, which inductor can only do after writing the float32 softmax out
(inductor's count on a CPU, 4,096 tokens x 30,522 words in bfloat16: 2.50 GB and 6 kernels with the scatter, 0.50 GB
with the comparison: the logits read, their gradient written).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .compiled_lengths import traced
from .device_compile import call_compiled, compiles
from .slabs import slabs
from .vocabulary_projection import padded_rows

Tensor = torch.Tensor

IGNORE_INDEX = -100  # labels of tokens that are not scored (transformers' convention)


def _chunks(logits: Tensor) -> list[slice]:
    """Rows of logits (N, C) per chunk: all of them where the chunks run compiled (no chunk-sized temporary), on
    CUDA or in a graph being compiled (where a chunk loop would be unrolled); eagerly, cache-sized on a CPU (faster
    than one pass over all), large on a GPU."""
    if compiles(logits.device) or torch.compiler.is_compiling():
        return [slice(0, logits.shape[0])]
    return slabs(logits.shape[0], logits.shape[1], "loss", logits.device)


def _chunk_log_probabilities(logits: Tensor, target: Tensor, dtype: torch.dtype, classes: int) -> Tensor:
    """Rows (n, >= C) whose first ``classes`` columns are logits, and their labels (n, 1) -> the labels'
    log-probabilities (n,), in ``dtype``."""
    return torch.log_softmax(logits[:, :classes], dim=-1, dtype=dtype).gather(1, target).squeeze(1)


def _chunk_gradient(logits: Tensor, target: Tensor, weight: Tensor, classes: int) -> Tensor:
    """The loss's gradient for rows (n, >= C) whose first ``classes`` columns are logits, from their labels (n, 1) and
    the gradient of each row's loss (n, 1), in ``weight``'s dtype: ``(softmax - one_hot(label)) * weight``, zero
    beyond the logits, in the logits' dtype."""
    probs = torch.softmax(logits[:, :classes], dim=-1, dtype=weight.dtype)  # (n, C)
    if torch.compiler.is_compiling():  # one fused pass: the label found by comparison, nothing written in place
        label = torch.arange(classes, device=logits.device) == target  # (n, C)
        grad = ((probs - label.to(probs.dtype)) * weight).to(logits.dtype)
    else:
        probs.scatter_add_(1, target, torch.full_like(weight, -1.0))  # minus the one-hot label
        grad = probs.mul_(weight).to(logits.dtype)
    return F.pad(grad, (0, logits.shape[1] - classes)) if logits.shape[1] > classes else grad  # (n, >= C)


class _CrossEntropySum(torch.autograd.Function):
    """The summed cross entropy of the scored rows of logits (N, >= C: the first ``classes`` columns) against labels
    (N,)."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, classes: int) -> Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        scored = labels != IGNORE_INDEX  # (N,)
        target = torch.where(scored, labels, 0)[:, None]  # (N, 1)
        picked = [  # (n,) per chunk: the labels' log-probabilities
            call_compiled(_chunk_log_probabilities, logits.device, logits[rows], target[rows], dtype, classes)
            for rows in _chunks(logits)
        ]
        ctx.save_for_backward(logits, target, scored)
        ctx.dtype, ctx.classes = dtype, classes
        return -torch.where(scored, torch.cat(picked), 0.0).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_sum: Tensor) -> tuple[Tensor, None, None]:
        logits, target, scored = ctx.saved_tensors
        weight = (scored * grad_sum).to(ctx.dtype)[:, None]  # (N, 1)
        chunks = _chunks(logits)
        gradient = functools.partial(call_compiled, _chunk_gradient, logits.device)
        if len(chunks) == 1:  # the gradient as computed, not copied into place
            return gradient(logits, target, weight, ctx.classes), None, None
        grad = torch.empty_like(logits)
        for rows in chunks:
            grad[rows] = gradient(logits[rows], target[rows], weight[rows], ctx.classes)
        return grad, None, None


def token_cross_entropy(logits: Tensor, labels: Tensor, num_items_in_batch=None) -> Tensor:
    """Cross entropy of (..., C) logits against (...) labels in float32 (float64 logits: float64), labels
    ``-100`` not scored: the mean over scored tokens (NaN when there are none, as ``F.cross_entropy``); with
    ``num_items_in_batch`` (passed by the HF ``Trainer``) the sum divided by it, which keeps gradient accumulation
    exact. Equal to ``F.cross_entropy(logits.float(), labels)``; the memory it needs beyond the logits and their
    gradient is one chunk of rows. Logits that are the first columns of wider rows (the heads' padded product:
    :func:`.padded_rows`) are read in those rows, which get the gradient whole, zero beyond the logits."""
    if labels.shape != logits.shape[:-1] or labels.is_floating_point() or labels.is_complex():
        raise ValueError(
            f"labels must be integer token ids of shape {tuple(logits.shape[:-1])} (one per logits row, -100 where "
            f"not scored), got {labels.dtype} labels of shape {tuple(labels.shape)}."
        )
    _check_label_range(labels, logits.shape[-1])
    labels = labels.to(logits.device, torch.long).reshape(-1)
    total = _CrossEntropySum.apply(padded_rows(logits), labels, logits.shape[-1])
    if num_items_in_batch is None:
        return total / (labels != IGNORE_INDEX).sum()
    return total / num_items_in_batch


def _check_label_range(labels: Tensor, classes: int) -> None:
    """Labels (...) outside ``0 .. classes - 1`` (but -100) end here, by name, not in torch's index error inside the
    loss (one host read, skipped while tracing)."""
    if not labels.numel() or traced():
        return
    scored = torch.where(labels == IGNORE_INDEX, 0, labels)  # (...): -100 read as a valid label
    smallest, largest = (int(bound) for bound in torch.aminmax(scored))
    if smallest < 0 or largest >= classes:
        raise ValueError(
            f"labels hold {smallest if smallest < 0 else largest}, out of range: the logits have {classes} classes "
            f"(labels 0 to {classes - 1}, or {IGNORE_INDEX} for a token not scored). A collator that marks ignored "
            f"tokens with -1 (not {IGNORE_INDEX}), or labels from another tokenizer, does this."
        )
