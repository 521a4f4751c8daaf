"""Python's documentation as an lm-evaluation-harness perplexity task that needs no download: the pages of
``pydoc_data.topics``, which ships with Python, of at least ``min_chars`` characters (metadata; default 8,000, about
2,000 tokens: 15 pages on Python 3.11). No dependency on performer_hf, so that the task runs where it is not
installed (``lm_eval --include_path benchmarks/lm_eval_tasks``)."""

import re
from pydoc_data.topics import topics

import datasets


def documents(min_chars: int = 8000, **metadata) -> dict[str, datasets.Dataset]:
    """The test split: one record ``{"name", "text"}`` per page, in the order of their names. ``metadata`` (the task's
    and the run's: the model's arguments among them) is not used."""
    names = [name for name in sorted(topics) if len(topics[name]) >= min_chars]
    records = [{"name": name, "text": topics[name]} for name in names]
    return {"test": datasets.Dataset.from_list(records, split=datasets.Split.TEST)}


def process_results(doc: dict, results: list[float]) -> dict[str, tuple[float, int]]:
    """A page's log-likelihood, with the counts its perplexities are normalised by (words and UTF-8 bytes)."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"].strip()))
    size = len(doc["text"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, size),
        "bits_per_byte": (loglikelihood, size),
    }
