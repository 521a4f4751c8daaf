"""Batch construction: reproducible MLM masking, causal-LM blocks, padded classification inputs."""

from __future__ import annotations

import numpy as np
import torch
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase

from .arguments import TrainingInputError

EXAMPLE_INDEX = "example_index"
SPECIAL_TOKENS_MASK = "special_tokens_mask"
# BERT's split of the selected tokens (as transformers' DataCollatorForLanguageModeling defaults):
MASK_REPLACE_PROB = 0.8  # replaced by the mask token
RANDOM_REPLACE_PROB = 0.1  # replaced by a uniformly random token; the rest stay unchanged


def example_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of one example's mask: well mixed, so nearby (seed, epoch, index) triples draw
    unrelated masks."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0])


class ReproducibleMaskingCollator:
    """BERT masking (``mlm_probability`` of the non-special tokens are selected; 80% of those become
    the mask token, 10% a random token, 10% stay) where each example's mask is a pure function of
    ``(seed, epoch, example index)``.

    Features are equal-length blocks carrying their position in the dataset under
    ``"example_index"`` and, optionally, the tokenizer's ``"special_tokens_mask"`` (otherwise the
    tokenizer computes it from the ids). Because masks depend on neither the batch composition, the
    process, the data-loader workers, the prefetching nor any RNG state, a resumed run, a run on N
    processes and an evaluation repeated later all mask each example exactly as an uninterrupted
    single-process run would. The training loop calls :meth:`set_epoch`, so an example is masked
    afresh every epoch.

    The draws follow transformers' ``DataCollatorForLanguageModeling.torch_mask_tokens`` step for
    step, with a ``torch.Generator`` seeded per example; the masking is implemented here rather than
    delegated because that collator re-creates its generator on its own schedule, which changed
    between transformers releases (5.24 re-creates it from its own seed on the first call in every
    process, discarding a generator set from outside).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, mlm_probability: float, seed: int):
        if tokenizer.mask_token is None:
            raise TrainingInputError(
                "The tokenizer has no mask token, so it cannot be used for masked language modeling; "
                "choose a tokenizer with a [MASK] / <mask> token (--tokenizer_name)."
            )
        self.tokenizer = tokenizer
        self.mlm_probability = mlm_probability
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Mask the examples of ``epoch`` (each epoch draws fresh masks)."""
        self.epoch = epoch

    def mask_tokens(
        self, input_ids: torch.Tensor, special_tokens_mask: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mask one example: returns ``(inputs, labels)``, labels -100 where nothing is predicted.

        ``input_ids`` and ``special_tokens_mask`` are (L,); special tokens (1 in the mask) are never
        selected. The order of the draws is transformers' ``torch_mask_tokens``.
        """
        inputs, labels = input_ids.clone(), input_ids.clone()  # (L,) each
        probability = torch.full(labels.shape, self.mlm_probability)  # (L,)
        probability.masked_fill_(special_tokens_mask.bool(), 0.0)
        selected = torch.bernoulli(probability, generator=generator).bool()  # (L,)
        labels[~selected] = -100
        replaced = torch.bernoulli(torch.full(labels.shape, MASK_REPLACE_PROB), generator=generator).bool() & selected
        inputs[replaced] = self.tokenizer.convert_tokens_to_ids(self.tokenizer.mask_token)
        random_prob = RANDOM_REPLACE_PROB / (1 - MASK_REPLACE_PROB)  # of the selected tokens not replaced
        randomized = (
            torch.bernoulli(torch.full(labels.shape, random_prob), generator=generator).bool() & selected & ~replaced
        )
        random_words = torch.randint(len(self.tokenizer), labels.shape, dtype=torch.long, generator=generator)  # (L,)
        inputs[randomized] = random_words[randomized]
        return inputs, labels

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lengths = {len(feature["input_ids"]) for feature in features}
        if len(lengths) > 1:
            raise ValueError(
                f"ReproducibleMaskingCollator got blocks of lengths {sorted(lengths)}; it takes equal-length blocks "
                "(group the tokens with performer_hf.training.data.group_into_blocks)."
            )
        inputs, labels = [], []
        for feature in features:
            input_ids = torch.as_tensor(feature["input_ids"], dtype=torch.long)  # (L,)
            if SPECIAL_TOKENS_MASK in feature:
                special = torch.as_tensor(feature[SPECIAL_TOKENS_MASK])  # (L,)
            else:
                special = torch.tensor(
                    self.tokenizer.get_special_tokens_mask(input_ids.tolist(), already_has_special_tokens=True)
                )  # (L,)
            generator = torch.Generator().manual_seed(example_seed(self.seed, self.epoch, int(feature[EXAMPLE_INDEX])))
            masked, example_labels = self.mask_tokens(input_ids, special, generator)
            inputs.append(masked)
            labels.append(example_labels)
        return {"input_ids": torch.stack(inputs), "labels": torch.stack(labels)}  # (B, L) each


def causal_lm_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """Stack equal-length blocks; ``labels`` are the inputs (the model shifts them)."""
    input_ids = torch.stack([torch.as_tensor(feature["input_ids"]) for feature in features])  # (B, L)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def classification_collator(tokenizer: PreTrainedTokenizerBase, mixed_precision: str) -> DataCollatorWithPadding:
    """Dynamic padding (to a multiple of 8 under mixed precision, for tensor cores)."""
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if mixed_precision != "no" else None)
