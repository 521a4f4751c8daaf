"""Reading a source checkpoint: resolve a folder or Hub id, read its config and its weights safely.

Weights are read with ``safetensors`` or ``torch.load(weights_only=True)``: nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import ConversionError, one_line
from .mapping import SUPPORTED_ARCHITECTURES, Family, find_family

logger = logging.getLogger(__name__)

SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PYTORCH_FILE, PYTORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# everything but the weights: config, tokenizer, model card
_METADATA_PATTERNS = ["*.json", "*.txt", "*.model", "README.md"]


def resolve_source(source: str | Path, revision: str | None = None) -> tuple[Path, str | None]:
    """A local folder, or a Hub id fetched with ``huggingface_hub.snapshot_download`` (so HF_ENDPOINT,
    HF_HUB_OFFLINE and the local cache apply). Returns the folder and the Hub id (None for a folder). A
    ``revision`` with a folder is refused: the folder holds one revision only."""
    path = Path(source).expanduser()
    if path.is_dir() and revision is not None:
        raise ConversionError(
            f"source {source} is a local folder: "
            "--revision applies to Hub ids; check out that revision in the folder, or pass the Hub id."
        )
    if path.is_dir():
        return path.resolve(), None
    if path.exists():
        raise ConversionError(f"source {source} is a file; pass the checkpoint folder or a Hub id.")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    repo_id = str(source)
    try:
        folder = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=_METADATA_PATTERNS + ["*.safetensors"])
        )
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=["pytorch_model*.bin"]))
    except HFValidationError:
        raise ConversionError(f"source {source!r} is neither an existing folder nor a valid Hub id.") from None
    except Exception as error:  # huggingface_hub raises many types (offline, 404, HTTP); all mean "not found"
        raise ConversionError(
            f"source {source!r} is not a local folder and could not be fetched from the Hub ({one_line(error)})."
        ) from None
    return folder, repo_id


@dataclass
class SourceCheckpoint:
    folder: Path
    repo_id: str | None
    config: Any  # the transformers config (BertConfig, RobertaConfig, GPT2Config)
    architecture: str
    family: Family


def _config_json(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{folder} has no config.json; it is not a transformers checkpoint.")
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{config_file} is not valid JSON ({one_line(error)}).") from None


def source_architecture(folder: Path) -> str:
    """The one architecture that ``folder``'s ``config.json`` names."""
    return _one_architecture(_config_json(folder))


def _one_architecture(raw: dict) -> str:
    architectures = raw.get("architectures") or []
    if len(architectures) != 1:
        raise ConversionError(
            f"config.json must name exactly one architecture (got {architectures}); supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    return architectures[0]


def read_source(folder: Path, repo_id: str | None) -> SourceCheckpoint:
    """Read ``config.json`` and pick the family / head that converts it."""
    from transformers import CONFIG_MAPPING

    raw = _config_json(folder)
    architecture = _one_architecture(raw)
    if raw.get("model_type") == "performer":
        raise ConversionError(
            f"{folder} holds a {architecture} (model_type 'performer'): it was converted already. A conversion starts "
            "from the source's own softmax attention, which it measures against and which this folder no longer runs. "
            "Convert the original checkpoint (its card names it), or load this one and change its attention settings "
            "with from_pretrained(folder, attention_method=..., ...)."
        )
    family = find_family(architecture)
    if raw.get("model_type") != family.model_type:
        raise ConversionError(
            f"config.json has model_type={raw.get('model_type')!r} but architecture {architecture} needs "
            f"{family.model_type!r}."
        )
    try:
        config = CONFIG_MAPPING[family.model_type].from_dict(raw)
    except (ValueError, TypeError) as error:
        raise ConversionError(
            f"{folder / 'config.json'} is not a valid {family.model_type} config ({one_line(error)})."
        ) from None
    return SourceCheckpoint(folder, repo_id, config, architecture, family)


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files in ``folder`` (one file, or the shards its index names), refused in one line
    where there are none or shards are missing."""
    for single, index in ((SAFETENSORS_FILE, SAFETENSORS_INDEX), (PYTORCH_FILE, PYTORCH_INDEX)):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError, UnicodeDecodeError) as error:
                raise ConversionError(f"{folder / index} is not a valid shard index ({one_line(error)}).") from None
            missing = [name for name in shards if not (folder / name).is_file()]
            if missing:
                raise ConversionError(f"{folder} is missing weight shards listed in {index}: {', '.join(missing)}.")
            return [folder / name for name in shards]
    raise ConversionError(
        f"{folder} has no weights: expected {SAFETENSORS_FILE}, {PYTORCH_FILE} or a sharded index of either."
    )


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in ``folder``, as float32 (integer buffers kept as they are)."""
    return as_float32(read_tensors(folder))


def as_float32(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with the floating ones in float32 (the conversion's arithmetic: position tables, splits)."""
    return {name: t.float() if t.is_floating_point() else t for name, t in tensors.items()}


def stored_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype that holds most of the values of a checkpoint's ``tensors`` (float32 without any)."""
    counts: dict[torch.dtype, int] = {}
    for tensor in tensors.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in ``folder``, as stored."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        try:
            if file.suffix == ".safetensors":
                part = load_file(file)
            else:
                part = torch.load(file, map_location="cpu", weights_only=True)
                if not isinstance(part, dict) or not all(isinstance(t, torch.Tensor) for t in part.values()):
                    raise ConversionError(f"{file} does not hold a flat state dict of tensors.")
        except ConversionError:
            raise
        except (SafetensorError, OSError, RuntimeError, EOFError, ValueError) as error:
            raise ConversionError(f"cannot read weights from {file} ({one_line(error)}).") from None
        except Exception as error:  # torch.load(weights_only=True) refuses pickled objects with UnpicklingError
            raise ConversionError(f"refusing to read {file}: not plain tensors ({one_line(error)}).") from None
        tensors.update(part)
    if not tensors:
        raise ConversionError(f"the weights in {folder} are empty.")
    return tensors
