"""The zoo registry (``registry.yaml`` beside this file): one entry per model and its recipe."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from .data import DATA_SETS
from .errors import ZooError

REGISTRY_FILE = "registry.yaml"
SOURCE_KINDS = ("package", "checkpoint", "pretrain", "asset")
# source: {asset: NAME} -> the function of performer_hf.model_assets that writes the checkpoint folder
MODEL_ASSETS = {"smollm2": "smollm2_checkpoint"}
# ... and the one that names that folder without writing it
MODEL_ASSET_FOLDERS = {"smollm2": "smollm2_folder"}
FINETUNE_TASKS = ("classification", "mlm", "clm")
EVALUATIONS = ("embeddings", "classification", "language_modeling")
_FIELDS = {
    "description",
    "base_model",
    "license",
    "pipeline_tag",
    "source",
    "convert",
    "data",
    "finetune",
    "evaluate",
    "quick",
    "limits",
    "reference",
}
# the type each field must have (YAML: a mapping is `key: value` lines or {...}, a list `- item` lines or [...])
_MAPPINGS = ("source", "convert", "finetune", "evaluate", "quick", "reference")
_STRINGS = ("description", "base_model", "license", "pipeline_tag", "data")
_PRETRAIN = ("tokenizer", "model", "training")  # the mappings of `source: {pretrain: gpt2, data: ...}`
_RESERVED_ARGS = ("model_name_or_path", "convert_from", "train_file", "validation_file", "output_dir")


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo: where its weights start, how it is converted, finetuned and evaluated."""

    name: str
    description: str
    license: str
    pipeline_tag: str
    source: dict[str, Any]
    evaluate: dict[str, Any]
    base_model: str | None = None
    convert: dict[str, Any] = field(default_factory=dict)
    data: str | None = None
    data_limit: int | None = None  # rows per split kept by quick builds
    finetune: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None  # label + convert options of a model finetuned the same way
    limits: list[str] = field(default_factory=list)


def _merge(base: dict, update: dict) -> dict:
    """``base`` with ``update`` merged in, recursively for nested dicts."""
    merged = copy.deepcopy(base)
    for key, value in update.items():
        nested = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if nested else value
    return merged


def _check_types(name: str, raw: dict) -> None:
    """Raise ZooError naming the first field of entry ``name`` whose value has the wrong type (null is absent)."""
    wrong = None
    for key, value in raw.items():
        if value is None:
            continue
        if key in _MAPPINGS and not isinstance(value, dict):
            wrong = "a mapping (key: value)"
        elif key in _STRINGS and not isinstance(value, str):
            wrong = "a string"
        elif key == "limits" and not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
            wrong = "a list of strings"
        elif key == "data_limit" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            wrong = "a positive integer"
        elif key == "finetune" and not isinstance(value.get("args", {}), dict):
            key, value, wrong = "finetune.args", value["args"], "a mapping (flag: value)"
        if wrong:
            raise ZooError(f"zoo entry {name!r}: {key} must be {wrong}, got {value!r}.")


def _check(name: str, raw: dict) -> None:
    """Raise ZooError naming the first malformed field of entry ``name``."""
    unknown = sorted(set(raw) - _FIELDS - {"data_limit"})
    if unknown:
        raise ZooError(f"zoo entry {name!r}: unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}.")
    for required in ("description", "license", "pipeline_tag", "source", "evaluate"):
        if not raw.get(required):
            raise ZooError(f"zoo entry {name!r} lacks {required!r}.")
    _check_types(name, raw)
    source = raw["source"]
    kinds = [kind for kind in SOURCE_KINDS if kind in source]
    if len(kinds) != 1:
        raise ZooError(f"zoo entry {name!r}: source needs exactly one of {', '.join(SOURCE_KINDS)}; got {source}.")
    if "asset" in source and source["asset"] not in list(MODEL_ASSETS):  # (a list in the YAML: not hashable)
        raise ZooError(f"zoo entry {name!r}: unknown asset {source['asset']!r}; choose from {sorted(MODEL_ASSETS)}.")
    if "pretrain" in source and source["pretrain"] != "gpt2":
        raise ZooError(f"zoo entry {name!r}: only 'pretrain: gpt2' is supported, got {source['pretrain']!r}.")
    pretrain_fields = ("data" in source, *(isinstance(source.get(key), dict) for key in _PRETRAIN))
    if "pretrain" in source and not all(pretrain_fields):
        raise ZooError(
            f"zoo entry {name!r}: 'pretrain: gpt2' needs data (a data set) and {', '.join(_PRETRAIN)} (mappings); "
            f"got {source}."
        )
    data_names = [raw.get("data")] + ([source.get("data")] if "pretrain" in source else [])
    for data in data_names:
        if data is not None and (not isinstance(data, str) or data not in DATA_SETS):
            raise ZooError(f"zoo entry {name!r}: unknown data set {data!r}; choose from {sorted(DATA_SETS)}.")
    finetune = raw.get("finetune")
    if finetune is not None:
        if finetune.get("task") not in FINETUNE_TASKS:
            raise ZooError(f"zoo entry {name!r}: finetune.task must be one of {FINETUNE_TASKS}.")
        if raw.get("data") is None:
            raise ZooError(f"zoo entry {name!r}: finetuning needs a data set ('data').")
        reserved = sorted(set(finetune.get("args", {})) & set(_RESERVED_ARGS))
        if reserved:
            raise ZooError(f"zoo entry {name!r}: finetune.args must not set {reserved} (the build sets them).")
    reference = raw.get("reference")
    if reference is not None:
        if finetune is None or raw["evaluate"].get("kind") != "classification":
            raise ZooError(f"zoo entry {name!r}: a reference needs finetuning and a classification evaluation.")
        if not reference.get("label") or not isinstance(reference.get("convert"), dict):
            raise ZooError(f"zoo entry {name!r}: reference needs a label and convert options.")
    if raw["evaluate"].get("kind") not in EVALUATIONS:
        raise ZooError(f"zoo entry {name!r}: evaluate.kind must be one of {EVALUATIONS}.")
    if raw["evaluate"]["kind"] != "embeddings" and raw.get("data") is None:
        raise ZooError(f"zoo entry {name!r}: evaluation {raw['evaluate']['kind']!r} needs a data set ('data').")


def load_registry(text: str | None = None) -> dict[str, dict]:
    """The raw registry (``{name: entry dict}``), checked; ``text`` replaces the packaged file (tests)."""
    if text is None:
        text = resources.files(__package__).joinpath(REGISTRY_FILE).read_text(encoding="utf-8")
    registry = yaml.safe_load(text) or {}
    if not isinstance(registry, dict):
        raise ZooError("the zoo registry must map model names to entries.")
    for name, raw in registry.items():
        if not isinstance(raw, dict):
            raise ZooError(f"zoo entry {name!r} must be a mapping.")
        _check(name, raw)
        if "quick" in raw:
            _check(name, _merge({k: v for k, v in raw.items() if k != "quick"}, raw["quick"]))
    return registry


def model_names() -> list[str]:
    """Names of the zoo's models, in registry order."""
    return list(load_registry())


def get_entry(name: str, quick: bool = False, registry: dict[str, dict] | None = None) -> ZooEntry:
    """The entry ``name`` (with its ``quick`` values merged in when ``quick``)."""
    registry = load_registry() if registry is None else registry
    if name not in registry:
        raise ZooError(f"unknown zoo model {name!r}; choose from: {', '.join(registry)}.")
    raw = {key: value for key, value in registry[name].items() if key != "quick"}
    if quick:
        raw = _merge(raw, registry[name].get("quick", {}))
    return ZooEntry(name=name, **raw)
