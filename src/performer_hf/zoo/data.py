"""The data sets the zoo recipes train and evaluate on, written as files for the training scripts.

The records come from :mod:`performer_hf.data_assets` (real corpora that install from package
registries), with the same seeded splits the compatibility studies use, so a zoo model's figures
and the studies' are measured on the same examples.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import data_assets
from .errors import ZooError

SEED = 0
SENTIMENT_LABELS = ("negative", "positive")

DATA_SETS = {
    "rotten_tomatoes": "Rotten-Tomatoes sentences rated by the VADER crowd (vaderSentiment 3.3.2 sdist), label = sign "
    "of the mean rating, fixed 80/10/10 split (seed 0)",
    "python_docs": "Python's documentation topics (pydoc_data.topics), documents split 80/10/10 (seed 0)",
    "python_docs_full": "Python's documentation topics and the standard library's long docstrings, documents split "
    "80/10/10 (seed 0)",
}
# Hub ids of the data sets, for the card metadata: the VADER file holds the same Rotten-Tomatoes
# sentences (Pang & Lee) as this Hub data set, with crowd-rating labels instead of the original ones.
HUB_DATASETS = {"rotten_tomatoes": "cornell-movie-review-data/rotten_tomatoes"}


def _splits(name: str) -> dict[str, list[dict]]:
    if name == "rotten_tomatoes":
        return {
            split: [{"text": r["text"], "label": SENTIMENT_LABELS[r["label"]]} for r in records]
            for split, records in data_assets.rotten_tomatoes(seed=SEED).items()
        }
    if name in ("python_docs", "python_docs_full"):
        documents = data_assets.python_docs(include_docstrings=name == "python_docs_full")
        return data_assets.seeded_split([{"text": text} for text in documents], SEED)
    raise ZooError(f"unknown data set {name!r}; choose from {sorted(DATA_SETS)}.")


def write_data(name: str, folder: Path, limit: int | None = None) -> dict[str, Path]:
    """Write data set ``name`` into ``folder`` as ``{train,validation,test}.jsonl`` (records with
    ``text``, and ``label`` for classification); ``limit`` keeps the first records of each split
    (quick builds). Returns ``{split: path}``."""
    try:
        splits = _splits(name)
    except data_assets.DataAssetError as error:
        raise ZooError(f"data set {name!r}: {error}") from error
    paths = {}
    for split, records in splits.items():
        fields = tuple(records[0]) if records else ("text",)
        paths[split] = data_assets.write_jsonl(records[:limit], Path(folder) / f"{split}.jsonl", fields=fields)
    return paths


def read_texts(path: Path) -> list[str]:
    """The ``text`` of every record of a JSON-lines file written by :func:`write_data`."""
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle if line.strip()]


def read_records(path: Path) -> list[dict]:
    """Every record of a JSON-lines file written by :func:`write_data`."""
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
