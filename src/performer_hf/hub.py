"""Publishing a Performer checkpoint folder (or a model converted in place) on the Hugging Face Hub in one commit.

``model.push_to_hub(repo_id)`` (transformers) already uploads the weights, ``config.json`` (with the
``auto_map`` that ``register_for_auto_class`` writes) and the remote-code files; the tokenizer and
the card then need their own pushes. :func:`push_to_hub` uploads a finished folder - what
``performer-hf convert``, the training scripts or ``performer-hf zoo build`` wrote - as one commit,
after checking that it will load with ``trust_remote_code=True`` on a machine without performer-hf.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id

from .conversion import ConversionError
from .conversion.errors import one_line
from .conversion.sentence_pipeline import sentence_pipeline_files
from .modeling.attention_settings import CONFIG_ATTRIBUTE, IMPLEMENTATIONS, LEARNED_ATTRIBUTE, LEARNED_SUBMODULE
from .modeling.modeling_in_place import IN_PLACE_CLASSES

logger = logging.getLogger(__name__)


def _transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's errors of a request that got no answer (no network, a timeout): httpx's under
    huggingface_hub 1.x, httpx2's under 2.x; neither is an ``OSError``."""
    errors = []
    for name in ("httpx", "httpx2"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except ImportError:
            continue
    return tuple(errors)


# what an upload raises where the Hub refused it or could not be reached
HUB_ERRORS = (HfHubHTTPError, OfflineModeIsEnabled, OSError, *_transport_errors())


class PushError(ValueError):
    """The folder is not a complete Performer checkpoint, or the Hub did not take it; the message names the cause and
    the fix."""


# how a folder converted in place gets its code and attention back
_IN_PLACE_FIX = (
    "load the model with trust_remote_code=True (or call performer_hf.ship_remote_code(model) on it) and save it again"
)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")
# Top-level files a training run leaves that do not belong on the Hub.
SKIPPED_FILES = ("optimizer.bin", "scheduler.bin", "random_states_0.pkl")


def remote_code_files(folder: Path, config: dict) -> list[str]:
    """The ``.py`` files that ``trust_remote_code=True`` loading needs: the modules named in
    ``config["auto_map"]`` and every sibling they import (``from .x import y``), recursively."""
    from transformers.dynamic_module_utils import get_relative_imports

    pending = sorted({reference.split(".")[0] + ".py" for reference in config["auto_map"].values()})
    found, missing = set(), set()
    while pending:
        name = pending.pop()
        if name in found or name in missing:
            continue
        if not (folder / name).is_file():
            missing.add(name)
            continue
        found.add(name)
        pending += [f"{module}.py" for module in get_relative_imports(str(folder / name))]
    if missing:
        fix = (
            _IN_PLACE_FIX
            if CONFIG_ATTRIBUTE in config
            else "save the model again with save_pretrained, which copies them"
        )
        raise PushError(
            f"{folder} lacks remote-code files {sorted(missing)} (named in config.json's auto_map or imported by "
            f"its modules); {fix}."
        )
    return sorted(found)


def _stale_shards(folder: Path) -> list[str]:
    """The sharded weights of an earlier save that a later unsharded one left beside its ``model.safetensors`` (the
    index and the shards it names; transformers keeps them): loading reads ``model.safetensors`` alone."""
    index = folder / WEIGHT_FILES[1]
    if not (folder / WEIGHT_FILES[0]).is_file() or not index.is_file():
        return []
    try:
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (json.JSONDecodeError, AttributeError):  # not an index: it is left out all the same
        shards = set()
    return sorted({index.name, *shards} - {WEIGHT_FILES[0]})


def _holds_learned_tensors(folder: Path) -> bool:
    """Whether the safetensors weights that loading reads in ``folder`` (``model.safetensors`` before an index, as
    transformers reads them) hold attention transfer's trained tensors."""
    from safetensors import safe_open

    if (folder / WEIGHT_FILES[0]).is_file():
        with safe_open(folder / WEIGHT_FILES[0], framework="pt") as handle:
            names = list(handle.keys())
    else:
        names = json.loads((folder / WEIGHT_FILES[1]).read_text()).get("weight_map", {})
    return any(f".{LEARNED_SUBMODULE}." in name for name in names)


def checkpoint_files(folder: str | Path) -> list[str]:
    """The files of a Performer checkpoint folder to upload, as ``/``-separated paths relative to it: the
    top-level files and the module folders of a sentence-transformers pipeline (``1_Pooling/`` ...; see
    ``conversion/sentence_pipeline.py``). Training state, checkpoints, other subfolders, hidden files and the
    shards of an earlier sharded save beside ``model.safetensors`` stay local. Raises PushError naming what is
    missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PushError(f"{folder} is not a folder; pass the folder a Performer checkpoint was saved to.")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise PushError(f"{folder} has no config.json; save the model with save_pretrained first.")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise PushError(f"{config_path} is not valid JSON ({error}); save the model again.") from None
    if not isinstance(config, dict):
        raise PushError(f"{config_path} holds a {type(config).__name__}, not a config; save the model again.")
    in_place = CONFIG_ATTRIBUTE in config  # a transformers class with Performer attention settings
    if config.get("model_type") != "performer" and not in_place:
        raise PushError(
            f"{config_path} has model_type {config.get('model_type')!r} and no {CONFIG_ATTRIBUTE}: neither a "
            "Performer nor a model converted in place."
        )
    if in_place and not set(config.get("architectures") or ()) & set(IN_PLACE_CLASSES):
        raise PushError(
            f"{config_path} is a {', '.join(config.get('architectures') or ['model'])} with Performer attention "
            f"settings, which cannot carry the code that loads it (only {', '.join(IN_PLACE_CLASSES)} can): "
            "convert its source checkpoint with performer_hf.convert (BERT, RoBERTa and GPT-2 become "
            "Performer-family models, which do)."
        )
    if in_place and config.get("attn_implementation") not in IMPLEMENTATIONS:
        raise PushError(
            f"{config_path} has Performer attention settings ({CONFIG_ATTRIBUTE}) but attn_implementation "
            f"{config.get('attn_implementation')!r}, so it would load with that attention instead (transformers does "
            f"not save the implementation a model was loaded with); {_IN_PLACE_FIX}."
        )
    if not config.get("auto_map"):
        fix = _IN_PLACE_FIX if in_place else "save it with performer_hf's save_pretrained (import performer_hf first)"
        raise PushError(
            f"{config_path} has no auto_map, so the Hub copy would not load with trust_remote_code=True; {fix}."
        )
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise PushError(f"{folder} has no weights ({' or '.join(WEIGHT_FILES)}); save the model with safetensors.")
    if config.get(LEARNED_ATTRIBUTE) and not _holds_learned_tensors(folder):
        raise PushError(
            f"{config_path} says attention transfer trained this model's attention ({LEARNED_ATTRIBUTE}), but its "
            f"weights hold no '{LEARNED_SUBMODULE}' tensors (a copy saved before it read them, at its first forward): "
            "load the folder it was copied from, call performer_hf.ship_remote_code(model) (which reads them) and "
            "save it again."
        )
    remote_code_files(folder, config)
    if not (folder / "README.md").is_file():
        logger.warning("%s has no README.md: the Hub repo will have no model card", folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files: users will need the tokenizer from elsewhere", folder)
    try:
        pipeline = sentence_pipeline_files(folder)
    except ConversionError as error:
        raise PushError(str(error)) from None
    stale = _stale_shards(folder)
    if stale:
        logger.info("%s: left out %s, an earlier sharded save's (loading reads model.safetensors)", folder, stale)
    top_level = {
        path.name
        for path in folder.iterdir()
        if path.is_file() and not path.name.startswith(".") and path.name not in (*SKIPPED_FILES, *stale)
    }
    return sorted(top_level.union(pipeline))


def check_repo_id(repo_id: str) -> None:
    """Refuse, with a PushError, a repository id the Hub would not take (huggingface_hub's own rules), before anything
    is read or sent."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PushError(
            f'{repo_id!r} is not a Hub repository id ({one_line(error)}); pass one of the form "org/name".'
        ) from None


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str = "Upload Performer checkpoint",
    create_pr: bool = False,
):
    """Upload a Performer checkpoint folder (weights, config, remote code, tokenizer, card, reports and any
    sentence-transformers pipeline) to the Hub repository ``repo_id`` in one commit, creating the repository
    if needed.

    Args:
        folder: a folder written by ``save_pretrained``, ``performer-hf convert``, the training scripts
            or ``performer-hf zoo build``.
        repo_id: ``"user-or-org/name"``.
        token: a Hub token (default: the logged-in user's).
        private: visibility of a repository created here (default: the Hub's).
        revision: branch to commit to (default: the main branch).
        commit_message: the commit's title.
        create_pr: open a pull request instead of committing directly.

    Returns:
        The ``huggingface_hub.CommitInfo`` of the commit (its ``commit_url`` names it).

    Raises:
        PushError: ``repo_id`` is not a Hub repository id, ``folder`` is not a complete Performer checkpoint, or the
            Hub refused the upload or could not be reached (the message names the fix).
    """
    check_repo_id(repo_id)
    folder = Path(folder)
    files = checkpoint_files(folder)
    api = HfApi(token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision is not None and not create_pr:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in files]
        logger.info("uploading %d files to %s: %s", len(files), repo_id, ", ".join(files))
        return api.create_commit(
            repo_id, operations=operations, commit_message=commit_message, revision=revision, create_pr=create_pr
        )
    except HUB_ERRORS as error:  # the Hub refused, or could not be reached
        raise PushError(
            f"the Hub did not take {repo_id!r} ({one_line(error)}): check the network, that "
            "HF_HUB_OFFLINE is not set, and that you are logged in (huggingface-cli login, or token=...) with write "
            "access to the repository."
        ) from error
