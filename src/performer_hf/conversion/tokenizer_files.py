"""The source's tokenizer files, copied beside the converted model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# A source's tokenizer files, copied beside the converted model: every tokenizer class's own file names, and any file
# named like a tokenizer's (tokenizer.model, tokenizer_config.json, special_tokens_map.json, chat templates).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
_TOKENIZER_PREFIXES = ("tokenizer", "special_tokens", "chat_template")


def tokenizer_files(folder: Path) -> list[str]:
    """The names of the tokenizer files in ``folder`` (sorted; empty where it has none)."""
    return sorted(
        path.name
        for path in folder.iterdir()
        if path.is_file() and (path.name in TOKENIZER_FILES or path.name.startswith(_TOKENIZER_PREFIXES))
    )


def copy_tokenizer(source: Path, target: Path, max_length: int | None = None) -> list[str]:
    """Copy ``source``'s tokenizer files into ``target``; with ``max_length``, its ``tokenizer_config.json`` names that
    ``model_max_length`` (a model extended to longer inputs). Returns the names copied."""
    copied = tokenizer_files(source)
    for name in copied:
        shutil.copy2(source / name, target / name)
    config_file = target / "tokenizer_config.json"
    if max_length is not None and config_file.is_file():  # let the tokenizer produce the longer inputs the model reads
        tokenizer_config = json.loads(config_file.read_text())
        tokenizer_config["model_max_length"] = max_length
        config_file.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return copied
