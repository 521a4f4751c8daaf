"""The vocabulary projection (hidden states -> logits) with rows of a length that matrix kernels take whole.

A vocabulary of odd size (GPT-2's 50,257 words, BERT's 30,522) gives the logits rows that are not a multiple of
16 bytes long, and cuBLAS then leaves its Hopper kernels for an sm_75 one at alignment 1 or 2. On the H200 that
one product was the largest kernel of the source and of its conversion alike: 14.1 ms of the decoder's inference at
32K tokens (flash's whole step 44.0 ms; 89 TFLOPS), 7.1 ms forward and 4.6 + 4.3 ms backward of its 38 ms training
step at 32 x 512 (``benchmarks/results/flex_h200``, runs 1 and 9). Here the weight gets zero rows up to a multiple
of 64 words for the product, and the logits are its first ``vocab_size`` columns: a view whose rows keep the padded
length, and :func:`.token_cross_entropy` reads those rows whole (:func:`padded_rows`), so that its gradient is the
padded product's, aligned for the backward products too. nanoGPT pads its vocabulary to the same end (50,257 ->
50,304); here the model's vocabulary and its logits' shape stay as they are.

A CPU gains too, in float32 (2 threads, 6 layers of 384 at 8 x 512 tokens, exact attention): the masked LM's and
the causal LM's whole inference 1.15x and 1.18x faster (the product alone 1.05x-1.32x at 256 to 2,048 rows), a
training step at 4 x 512 1.02x and 1.04x (1.01x either way where the loss's gradient went through the view);
bfloat16 0.99x-1.01x. GPU time not measured.

Only where the product is large (at least :data:`MIN_ROWS` rows): a few sequences' next-token logits in ``generate``
read the weight once, and a padded copy of it would double that. The padded copy lives until backward (one more
weight's memory in training).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .compiled_lengths import exported

Tensor = torch.Tensor

ALIGNMENT = 64  # words: a multiple of the 8 (16 bytes of bfloat16) that cuBLAS's vectorized kernels need
MIN_ROWS = 256  # rows (tokens): a GPU's product is compute-bound from about here (an estimate, not timed there)


def alignment_for(hidden: Tensor) -> int:
    """The row length the logits of ``hidden`` (..., hidden_size) are padded to a multiple of: :data:`ALIGNMENT`
    for at least :data:`MIN_ROWS` rows, else 1 (no padding); 1 in a graph being exported, which holds for every
    length (the exported program's runtime picks its own kernels)."""
    if exported():
        return 1
    rows = hidden.numel() // max(hidden.shape[-1], 1)
    return ALIGNMENT if rows >= MIN_ROWS else 1


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes exactly ``F.linear(x, module.weight)``: a bias-free ``nn.Linear`` itself, not a
    subclass (quantized layers), and without hooks, which only its own call runs (forward and backward ones;
    Accelerate's offloading replaces ``forward`` and sets ``_hf_hook``). A head's own product
    (:func:`vocabulary_logits`) may stand in for such a module's call only."""
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    return type(module) is nn.Linear and module.bias is None and not any(hooks) and not hasattr(module, "_hf_hook")


def vocabulary_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None = None, alignment: int | None = None
) -> Tensor:
    """``F.linear(hidden, weight, bias)``: (..., hidden_size) -> (..., vocab_size) logits, computed with the
    weight's rows padded to a multiple of ``alignment`` (default :func:`alignment_for`) and returned as the first
    ``vocab_size`` columns of that product (a view; contiguous where nothing is padded)."""
    vocab_size = weight.shape[0]
    alignment = alignment_for(hidden) if alignment is None else alignment
    padding = -vocab_size % alignment
    if padding == 0:
        return F.linear(hidden, weight, bias)
    weight = F.pad(weight, (0, 0, 0, padding))  # (vocab_size + padding, hidden_size)
    bias = None if bias is None else F.pad(bias, (0, padding))
    return F.linear(hidden, weight, bias)[..., :vocab_size]  # (..., vocab_size), rows of vocab_size + padding


def padded_rows(logits: Tensor) -> Tensor:
    """Rows (N, W) whose first C columns are the logits (..., C): the padded product the logits are a view of where
    :func:`vocabulary_logits` made them, else the logits themselves. A loss that reads the padded rows (ignoring the
    padding) gives its gradient to the product directly; through the view, autograd would fill a zero tensor of the
    product's size and copy the gradient into it (on this CPU 85 ms of a 3.3 s training step at 2,048 x 30,522)."""
    base = logits._base  # the tensor a view was taken of (torch's documented view attribute)
    if (
        base is not None
        and not (logits.retains_grad or logits._backward_hooks)  # what asked for the logits' own gradient gets it
        and base.is_contiguous()
        and base.shape[:-1] == logits.shape[:-1]
        and logits.stride() == base.stride()
        and logits.storage_offset() == base.storage_offset()
    ):
        return base.reshape(-1, base.shape[-1])  # (N, W >= C)
    return logits.reshape(-1, logits.shape[-1])  # (N, C)
