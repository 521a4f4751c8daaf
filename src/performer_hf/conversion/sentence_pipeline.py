"""Carrying a source's sentence-transformers pipeline over to the converted folder.

A sentence-transformers checkpoint (e.g. all-MiniLM-L6-v2) lists its modules in ``modules.json``: the
transformer at ``path ""`` (the checkpoint folder itself, which the converter rewrites) and the steps
after it (``1_Pooling``, ``2_Normalize``, ``2_Dense`` ...) in their own folders. Copying that file, the
module folders and the top-level sentence-transformers configs lets ``SentenceTransformer(converted)``
run the source's pipeline instead of guessing a default one (mean pooling, no normalisation).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path, PurePosixPath

from .errors import ConversionError

logger = logging.getLogger(__name__)

MODULES_FILE = "modules.json"
# the transformer module's config under the names sentence-transformers reads, in its order
TRANSFORMER_CONFIG_FILES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
TOP_LEVEL_FILES = (MODULES_FILE, "config_sentence_transformers.json", *TRANSFORMER_CONFIG_FILES)


def _read_json(file: Path):
    """The JSON in ``file``; a ConversionError naming the file if it is not valid JSON."""
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(
            f"{file} is not valid JSON ({type(error).__name__}: {error}); fix it or delete it to do without "
            "the sentence-transformers pipeline."
        ) from None


def _module_folders(modules_file: Path) -> list[str] | None:
    """The module folders ``modules_file`` lists besides the root; None when no module is the root."""
    try:
        paths = [PurePosixPath(module["path"]) for module in _read_json(modules_file)]
    except (TypeError, KeyError) as error:
        raise ConversionError(
            f"{modules_file} is not a sentence-transformers module list (each entry needs a 'path' string: {error!r}); "
            "fix it or delete it to do without the sentence-transformers pipeline."
        ) from None
    unsafe = [str(path) for path in paths if path.is_absolute() or ".." in path.parts]
    if unsafe:
        raise ConversionError(
            f"{modules_file} names module folders outside the checkpoint ({', '.join(unsafe)}); "
            "fix the paths or delete the file."
        )
    if PurePosixPath("") not in paths:
        return None
    return [str(path) for path in paths if path != PurePosixPath("")]


def sentence_pipeline_files(folder: Path) -> list[str]:
    """The files of the sentence-transformers pipeline of ``folder`` (a converted checkpoint), as
    ``/``-separated paths relative to it: the top-level sentence-transformers files and every file of the
    module folders ``modules.json`` lists (hidden files excluded). [] for a folder without a pipeline
    (no ``modules.json``, or none with the folder itself as a module). Raises ConversionError for a
    broken ``modules.json``.

    What must travel with a converted folder for ``SentenceTransformer(folder)`` to run its pipeline;
    other subfolders (training checkpoints, ``.git``) are not part of it.
    """
    modules_file = folder / MODULES_FILE
    folders = _module_folders(modules_file) if modules_file.is_file() else None
    if folders is None:
        return []
    files = [name for name in TOP_LEVEL_FILES if (folder / name).is_file()]
    for module in folders:
        relative = sorted(path.relative_to(folder) for path in (folder / module).rglob("*") if path.is_file())
        files += [path.as_posix() for path in relative if not any(part.startswith(".") for part in path.parts)]
    return files


def copy_sentence_pipeline(source: Path, target: Path, positions: int, extended: bool) -> list[str]:
    """Copy the sentence-transformers files of ``source`` into ``target`` (the converted folder, already
    holding the converted transformer): ``modules.json``, every module folder it lists but the root,
    and the top-level sentence-transformers configs. Returns the copied names ([] for a plain checkpoint).

    ``max_seq_length`` (the truncation sentence-transformers applies) keeps the source's value, unless
    the conversion extended the positions: then it becomes ``positions``, the new usable length, as the
    tokenizer's ``model_max_length`` does (long inputs are the point of extending them).
    """
    modules_file = source / MODULES_FILE
    if not modules_file.is_file():
        return []
    folders = _module_folders(modules_file)
    if folders is None:
        logger.warning(
            '%s has no module at the checkpoint folder itself (path ""), so its pipeline would not use the '
            "converted model: the sentence-transformers files are not carried over",
            modules_file,
        )
        return []
    copied = []
    for name in TOP_LEVEL_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    for folder in folders:
        if (source / folder).is_dir():  # a module without files (Normalize) may have no folder
            shutil.copytree(source / folder, target / folder)
            copied.append(f"{folder}/")
    config_file = next((target / name for name in TRANSFORMER_CONFIG_FILES if (target / name).is_file()), None)
    config = _read_json(config_file) if extended and config_file is not None else {}
    if config.get("max_seq_length") is not None:
        logger.info(
            "sentence-transformers max_seq_length raised from %d to %d, the extended positions (set "
            "model.max_seq_length after loading to truncate earlier)",
            config["max_seq_length"],
            positions,
        )
        config["max_seq_length"] = positions
        config_file.write_text(json.dumps(config, indent=2) + "\n")
    logger.info("carried the sentence-transformers pipeline over: %s", ", ".join(copied))
    return copied
