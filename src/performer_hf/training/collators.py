"""Batch construction: reproducible MLM masking, causal-LM blocks, padded classification inputs."""

from __future__ import annotations

import numpy as np
import torch
from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, PreTrainedTokenizerBase

from .arguments import TrainingInputError

EXAMPLE_INDEX = "example_index"


class ReproducibleMaskingCollator:
    """transformers' ``DataCollatorForLanguageModeling`` (80/10/10 masking of ``mlm_probability`` of
    the tokens) where each example's mask is a pure function of ``(seed, epoch, example index)``.

    Features are equal-length blocks carrying their position in the dataset under
    ``"example_index"``. Because masks depend on neither the batch composition, the process, the
    prefetching of the data loader nor the RNG state, a resumed run, a run on N processes and an
    evaluation repeated later all mask each example exactly as an uninterrupted single-process run
    would. The training loop calls :meth:`set_epoch`, so an example is masked afresh every epoch.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, mlm_probability: float, seed: int):
        if tokenizer.mask_token is None:
            raise TrainingInputError(
                "The tokenizer has no mask token, so it cannot be used for masked language modeling; "
                "choose a tokenizer with a [MASK] / <mask> token (--tokenizer_name)."
            )
        # A seed makes the collator draw from `self._collator.generator`, which __call__ sets per example.
        self._collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability, seed=seed)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = []
        for feature in features:
            feature = dict(feature)
            index = int(feature.pop(EXAMPLE_INDEX))
            entropy = np.random.SeedSequence([self.seed, self.epoch, index]).generate_state(1, dtype=np.uint64)[0]
            self._collator.generator = torch.Generator().manual_seed(int(entropy))
            rows.append(self._collator([feature]))  # {"input_ids": (1, L), "labels": (1, L)}
        return {name: torch.cat([row[name] for row in rows]) for name in rows[0]}  # (B, L) each


def causal_lm_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """Stack equal-length blocks; ``labels`` are the inputs (the model shifts them)."""
    input_ids = torch.stack([torch.as_tensor(feature["input_ids"]) for feature in features])  # (B, L)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def classification_collator(tokenizer: PreTrainedTokenizerBase, mixed_precision: str) -> DataCollatorWithPadding:
    """Dynamic padding (to a multiple of 8 under mixed precision, for tensor cores)."""
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if mixed_precision != "no" else None)
