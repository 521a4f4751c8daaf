"""The pass-key task of the long-context studies, with no dependency on performer_hf (so that a study run in another
environment, ``kvpress_anchor.py``, builds the same prompts): a five-digit key in BBC News prose behind one line that
says a key is hidden, the question at the end, keys at evenly spaced depths from 0 to 100% of the prompt."""

from __future__ import annotations

import random

HEADER = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you "
    "about the important information there.\n"
)
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8  # a trial counts when the key is among the first 8 generated tokens (greedy)


def filler_tokens(tokenizer, articles: list[dict]) -> list[int]:
    """The filler: the articles' texts (BBC News' test split), one after another, as token ids."""
    return tokenizer("\n\n".join(record["text"] for record in articles))["input_ids"]


def trials(lengths: list[int], trials_per_length: int, seed: int) -> dict[int, list[tuple[float, int]]]:
    """(depth, key) of every trial by prompt length: the same keys for every arm and environment."""
    rng = random.Random(seed)
    depths = [trial / max(trials_per_length - 1, 1) for trial in range(trials_per_length)]
    return {length: [(depth, rng.randint(10000, 99999)) for depth in depths] for length in lengths}


def prompt(tokenizer, filler: list[int], length: int, depth: float, key: int) -> str:
    """A prompt of about ``length`` tokens with the key at ``depth`` (0: first, 1: last) of the filler."""
    needle = f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
    fixed = sum(len(tokenizer(text)["input_ids"]) for text in (HEADER, needle, QUESTION))
    body = length - fixed
    cut = int(body * depth)
    return HEADER + tokenizer.decode(filler[:cut]) + needle + tokenizer.decode(filler[cut:body]) + QUESTION
