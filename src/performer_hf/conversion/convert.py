"""``convert``: a pretrained BERT / RoBERTa / GPT-2 checkpoint in, a Performer checkpoint out."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import GenerationConfig
from transformers.utils import GENERATION_CONFIG_NAME as GENERATION_CONFIG

from ..attention_card import states_kernel, uses_projection
from ..modeling import modeling_performer
from ..modeling.attention_methods import ATTENTION_METHODS, preset_under
from ..modeling.configuration_performer import PerformerConfig
from ..modeling.far_fields import FAR_FIELDS
from .calibration import calibrate as calibrate_model
from .errors import ConversionError, one_line
from .fidelity import FidelityReport, mapping_check, measure_fidelity, sample_batch
from .in_place import IN_PLACE_ARCHITECTURES, TransferSettings, convert_in_place
from .mapping import POSITION_TABLE, MappingResult, extend_positions, map_weights
from .model_card import CardSource, build_model_card, source_license
from .output_folder import check_output_dir, publish, staging_folder
from .sentence_pipeline import copy_sentence_pipeline
from .source import (
    SourceCheckpoint,
    as_float32,
    read_source,
    read_tensors,
    resolve_source,
    source_architecture,
    stored_dtype,
)
from .tokenizer_files import copy_tokenizer, tokenizer_files

logger = logging.getLogger(__name__)

# Fields the source weights determine: overriding them would not match the tensors.
FIXED_BY_SOURCE = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "hidden_act",
        "type_vocab_size",
        "layer_norm_eps",
        "pad_token_id",
        "is_decoder",
        "tie_word_embeddings",
        "layer_norm_position",
        "position_offset",
        "transformers_version",
        "architectures",
    }
)
REPORT_FILE = "conversion_report.json"

# Attention methods the converter offers: each registry entry's presets of PerformerConfig fields (per
# direction), under any explicit override.
METHODS: dict[str, dict[str, dict[str, Any]]] = {
    name: method.presets for name, method in ATTENTION_METHODS.items() if method.presets is not None
}
DEFAULT_METHOD = "hybrid"
# Decoders converted in place (Llama & co.): the sparse method, whose selected blocks find what lies beyond the
# window (benchmarks/results/long_context_retrieval.md: SmolLM2's pass keys as the source finds them, where the
# hybrid's window and far field find none beyond the window).
DEFAULT_IN_PLACE_METHOD = "sparse"


def _overridable_fields() -> list[str]:
    return sorted({f.name for f in dataclasses.fields(PerformerConfig)} - FIXED_BY_SOURCE)


SAVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _asked_dtype(asked) -> torch.dtype | None:
    """The ``dtype`` override (a ``torch.dtype`` or its name, with or without ``torch.``) as a dtype, None for the
    source's ("auto" or not given); refused unless the weights can be saved in it."""
    if asked is None or asked == "auto":
        return None
    dtype = getattr(torch, asked.removeprefix("torch."), None) if isinstance(asked, str) else asked
    if dtype not in SAVED_DTYPES:
        raise ConversionError(f"dtype={asked!r}: the weights are saved in float32, bfloat16 or float16.")
    return dtype


def _saved_dtype(asked, stored: torch.dtype) -> torch.dtype:
    """The dtype the converted weights are saved in: ``dtype`` where given (a ``torch.dtype`` or its name), else the
    source checkpoint's (the conversion computes in float32)."""
    return _asked_dtype(asked) or stored


def _method(method: str | None, overrides: dict[str, Any], default: str = DEFAULT_METHOD) -> str:
    """The attention method: ``method``, or by default ``default`` unless a kernel only FAVOR+ has is asked for."""
    kernel, named = overrides.get("attention_kernel"), overrides.get("attention_method")
    if named is not None and named != method:
        raise ConversionError(
            f"attention_method={named!r} is the method's own field: convert with method={named!r} (--method "
            f"{named}), which also takes its settings."
        )
    if method is None:
        default_kernels = ATTENTION_METHODS[default].kernels
        if kernel not in (None, "exact") and (default_kernels is None or kernel not in default_kernels):
            logger.info("attention_kernel=%r is a plain FAVOR+ kernel: converting with method 'favor'", kernel)
            return "favor"
        return default
    if method not in METHODS:
        raise ConversionError(f"unknown method {method!r}; choose one of {sorted(METHODS)}.")
    kernels = ATTENTION_METHODS[method].kernels
    if kernel not in (None, "exact") and (kernels is None or kernel not in kernels):
        raise ConversionError(
            f"attention_kernel={kernel!r} is not a kernel of the {method} method; choose one of "
            f"{sorted(kernels or ['exact'])}"
            + (", or convert with --method favor for plain FAVOR+." if method in ("hybrid", "sparse") else ".")
        )
    return method


def _attention_named(config: PerformerConfig) -> str:
    """How a message names ``config``'s attention: exact attention, or its method."""
    return "exact attention" if config.attention_kernel == "exact" else f"the {config.attention_method} method"


def is_causal(checkpoint: SourceCheckpoint) -> bool:
    """Whether the converted model attends causally (GPT-2, or a source configured as a decoder)."""
    head = checkpoint.family.heads[checkpoint.architecture]
    return head.target_class == "PerformerForCausalLM" or bool(
        checkpoint.family.map_config(checkpoint.config).get("is_decoder")
    )


def performer_config(
    checkpoint: SourceCheckpoint, overrides: dict[str, Any], method: str | None = None
) -> PerformerConfig:
    """The PerformerConfig for ``checkpoint``: the ``method``'s settings (see ``METHODS``; by default
    "hybrid", or "favor" when ``overrides`` name a FAVOR+-only kernel) under ``overrides``
    (PerformerConfig fields). ``attention_kernel="exact"`` takes no method settings.

    ``max_position_embeddings`` counts tokens: RoBERTa's table gets ``position_offset`` more rows.
    A causal model with a far field that takes a parameter (FAVOR++'s ``A``) and no ``far_field_parameter`` gets zeros
    as placeholders, to be calibrated (``convert`` does it).
    """
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(PerformerConfig)})
    if unknown:
        raise ConversionError(f"unknown PerformerConfig field(s) {unknown}; choose from {_overridable_fields()}.")
    fixed = sorted(set(overrides) & FIXED_BY_SOURCE)
    if fixed:
        raise ConversionError(f"{fixed} are fixed by the source weights and cannot be overridden.")
    fields = checkpoint.family.map_config(checkpoint.config)
    if checkpoint.architecture.endswith("ForSequenceClassification"):
        source = checkpoint.config
        fields.update(id2label=dict(source.id2label), label2id=dict(source.label2id), problem_type=source.problem_type)
    overrides = dict(overrides)
    if (dtype := _asked_dtype(overrides.pop("dtype", None))) is not None:  # the config takes its name
        overrides["dtype"] = str(dtype).removeprefix("torch.")
    if (tokens := overrides.get("max_position_embeddings")) is not None:
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise ConversionError(
                f"max_position_embeddings is a number of tokens, got {type(tokens).__name__} {tokens!r}."
            )
        overrides["max_position_embeddings"] = tokens + fields["position_offset"]
    method = _method(method, overrides)
    causal = is_causal(checkpoint)
    direction = "causal" if causal else "bidirectional"
    if direction not in METHODS[method]:
        raise ConversionError(f"the {method} method is causal only; convert this encoder with --method hybrid.")
    preset = preset_under(METHODS[method][direction], overrides)
    if overrides.get("attention_kernel") == "exact":  # exact attention ignores the method
        preset = {}
    merged = {**fields, **preset, "attention_method": method, **overrides}
    far_field = FAR_FIELDS.get(merged.get("attention_kernel"))
    if causal and far_field is not None and far_field.uses_parameter and merged.get("far_field_parameter") is None:
        merged["far_field_parameter"] = [[0.0] * fields["num_attention_heads"]] * fields["num_hidden_layers"]
    try:
        return PerformerConfig(**merged)
    except (ValueError, TypeError, AttributeError, StrictDataclassError) as error:  # strict validation wraps them
        raise ConversionError(f"invalid Performer settings: {one_line(error.__cause__ or error)}") from None


def build_model(target_class: str, config: PerformerConfig, pooler: bool) -> torch.nn.Module:
    """A fresh Performer of ``target_class``; a bare ``PerformerModel`` only gets a pooler if the source had one."""
    cls = getattr(modeling_performer, target_class)
    model = cls(config, add_pooling_layer=pooler) if target_class == "PerformerModel" else cls(config)
    return model.eval()


# Attention buffers that the source does not have: random features, fixed centres (calibrated).
NEW_BUFFERS = (".attention.projection", ".attention.query_center", ".attention.key_center")


def needs_calibration(config: PerformerConfig, causal: bool) -> bool:
    """Whether leak-free causal attention needs statistics fixed at conversion (centres, FAVOR++ A)."""
    if not causal or config.attention_method != "hybrid":
        return False
    return config.center_features or FAR_FIELDS[config.attention_kernel].uses_parameter


def calibrated_statistics(config: PerformerConfig, causal: bool, overrides: dict[str, Any]) -> list[str]:
    """What calibration fixes in a hybrid ``config``: the centres (causal attention with ``center_features``;
    bidirectional attention centres each sequence by its own means) and FAVOR++'s ``A`` (unless ``overrides`` set
    ``far_field_parameter``)."""
    fitted = ["centres"] if causal and config.center_features else []
    if FAR_FIELDS[config.attention_kernel].uses_parameter and "far_field_parameter" not in overrides:
        fitted.append("FAVOR++'s A")
    return fitted


def _nothing_to_calibrate(config: PerformerConfig, causal: bool) -> str:
    """Why --calibrate would change nothing in the hybrid ``config``, and what it fits, as one line."""
    if FAR_FIELDS[config.attention_kernel].uses_parameter:
        return "--calibrate fits FAVOR++'s A, which far_field_parameter already sets: leave out one of them."
    if causal:
        return (
            f"--calibrate fits the centres (center_features) and FAVOR++'s A (--attention-kernel softmax_opt); the "
            f"{config.attention_kernel} far field without centres has neither: leave it out."
        )
    return (
        "--calibrate changes nothing here: encoders centre each sequence by its own means; --calibrate fits only "
        "FAVOR++'s A (--attention-kernel softmax_opt)."
    )


def _fill_model(model: torch.nn.Module, mapping: MappingResult) -> list[str]:
    """Load the mapped tensors strictly; return the target names left to their fresh values (projections)."""
    expected = model.state_dict()
    source_of = {target: source for source, targets in mapping.used.items() for target in targets}
    unexpected = sorted(set(mapping.tensors) - set(expected))
    if unexpected:
        raise ConversionError(
            f"the weights have tensors the config does not describe ({', '.join(source_of[t] for t in unexpected[:5])}"
            f"): config.json does not match the weights (e.g. num_hidden_layers)."
        )
    for name, tensor in mapping.tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConversionError(
                f"{source_of[name]} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(expected[name].shape)} for {name}: the config does not match the weights."
            )
    filled_storage = {expected[name].data_ptr() for name in mapping.tensors}
    new = [name for name in expected if name not in mapping.tensors and name.endswith(NEW_BUFFERS)]
    missing = [
        name
        for name in expected
        if name not in mapping.tensors and name not in new and expected[name].data_ptr() not in filled_storage
    ]  # tied weights share storage with a filled tensor
    if missing:
        raise ConversionError(
            f"the checkpoint lacks tensors the converted model needs: {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + ". The weights are incomplete or do not match config.json."
        )
    model.load_state_dict(mapping.tensors, strict=False)
    return new


def _load_source_model(checkpoint: SourceCheckpoint) -> torch.nn.Module:
    """The source model as transformers itself loads it: the independent reference for the report."""
    import transformers
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # unused-weight notices (e.g. the NSP head) are in our own report
    try:
        cls = getattr(transformers, checkpoint.architecture)
        return cls.from_pretrained(checkpoint.folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    except Exception as error:  # any failure here means transformers itself cannot read the checkpoint
        raise ConversionError(f"transformers cannot load the source checkpoint ({one_line(error)}).") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def _load_tokenizer(folder: Path):
    if not tokenizer_files(folder):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # a broken tokenizer only costs the report its real text
        logger.warning("could not load the tokenizer of %s (%s); measuring on random token ids", folder, error)
        return None


def exact_twin(model: torch.nn.Module, target_class: str, pooler: bool) -> torch.nn.Module:
    """``model`` with ``attention_kernel="exact"`` and the same weights: the source's outputs."""
    exact_config = PerformerConfig.from_dict({**model.config.to_dict(), "attention_kernel": "exact"})
    exact = build_model(target_class, exact_config, pooler)
    exact.load_state_dict(model.state_dict())
    return exact


def fidelity_report(
    checkpoint: SourceCheckpoint,
    model: torch.nn.Module,
    target_class: str,
    pooler: bool,
    tokenizer,
    saved_dtype: torch.dtype = torch.float32,
) -> FidelityReport:
    """Measure the float32 ``model`` as it is saved, cast to ``saved_dtype`` (it is left so), against the source
    checkpoint and against its own exact-kernel twin; for a dtype narrower than float32 the mapping check (the exact
    twin against the source) is also made before the cast, where rounding does not hide a mapping mistake."""
    exact = exact_twin(model, target_class, pooler)
    source = _load_source_model(checkpoint)
    # the shorter of the two models' reaches: extended positions (--max-position-embeddings) are the converted one's
    source_reach = source.config.max_position_embeddings - model.config.position_offset
    batch = sample_batch(model.config, tokenizer, max_length=min(256, source_reach))
    text = "Python documentation text" if tokenizer is not None else "random token ids (no tokenizer in the source)"
    mapping = mapping_check(source, exact, batch) if saved_dtype != torch.float32 else {}
    model.to(saved_dtype)  # the random-feature projections stay float32 (PerformerAttention._apply)
    report = measure_fidelity(source, model, exact.to(saved_dtype), batch, text)
    report.mapping_max_abs_diff = mapping
    report.attention = attention_settings(model.config)
    return report


def attention_settings(config: PerformerConfig) -> dict[str, Any]:
    """The config fields that define the attention method (for the report and the card)."""
    names = ["attention_kernel"] if states_kernel(config) else []
    if config.attention_method != "exact":
        if config.attention_method == "favor" or uses_projection(config):
            names += ["nb_features", "feature_coupling", "feature_row_norms"]
        if config.attention_method == "hybrid":
            names += ["local_window", "num_global_tokens", "routed_blocks", "center_features"]
            if config.routed_blocks:
                names += ["route_block_size", "query_block_size", "route_group_size"]
        if config.attention_method == "sparse":
            names += ["local_window", "num_global_tokens", "select_block_size", "select_blocks", "select_budget"]
            names += ["select_ranking"]
        if config.exact_max_length:
            names.append("exact_max_length")
        if config.accelerator_exact_max_length is not None:
            names.append("accelerator_exact_max_length")
    return {name: getattr(config, name) for name in names}


# Keywords of earlier releases, still taken (with a FutureWarning): the transfer options, now one TransferSettings,
# and the source's revision, which the caller now resolves (``performer-hf convert --revision`` does it).
_TRANSFER_KEYWORDS = {"transfer_steps": "steps", "transfer_text": "text_file", "transfer_length": "length"}


def _deprecated_keywords(overrides: dict[str, Any], transfer: TransferSettings | None):
    """Take the earlier keywords out of ``overrides``: -> (transfer settings, revision)."""
    given = {key: overrides.pop(key) for key in (*_TRANSFER_KEYWORDS, "revision") if key in overrides}
    if not given:
        return transfer, None
    warnings.warn(
        f"convert({', '.join(f'{key}=' for key in given)}) is deprecated: pass transfer=TransferSettings(steps, "
        "text_file, length), and for a Hub revision resolve the source first (snapshot_download(repo_id, "
        "revision=...)) and pass its folder with base_model=repo_id.",
        FutureWarning,
        stacklevel=3,
    )
    old = {_TRANSFER_KEYWORDS[key]: value for key, value in given.items() if key in _TRANSFER_KEYWORDS}
    if old.get("steps", 0):
        transfer = TransferSettings(**old)
    elif old.get("text_file") is not None:
        raise ConversionError("a transfer text was given without transfer steps: set --transfer-steps too.")
    return transfer, given.get("revision")


def _card_base_model(base_model: str | None, folder: Path) -> str | None:
    """The Hub id the model card names as its base model; None for a local folder given none (logged)."""
    if base_model is None:
        logger.info(
            "the model card names the local folder %s, with no base_model: pass --base-model with the Hub id it "
            "came from to link it.",
            folder.name,
        )
    return base_model


def convert(
    source: str | Path,
    output_dir: str | Path,
    *,
    overwrite: bool = False,
    base_model: str | None = None,
    fidelity: bool = True,
    method: str | None = None,
    calibrate: bool = False,
    transfer: TransferSettings | None = None,
    **overrides: Any,
) -> Path:
    """Convert a pretrained BERT / RoBERTa / GPT-2 checkpoint into a Performer checkpoint, or a Llama / Mistral /
    Qwen2 / Qwen3 / Gemma3 one into the same class with Performer attention (``conversion/in_place.py``: the
    weights unchanged, the config naming ``attn_implementation`` and its settings; ``overrides`` may then
    only set attention fields).

    Args:
        source: a local checkpoint folder or a Hub id (fetched with ``huggingface_hub``, so
            ``HF_ENDPOINT``, ``HF_HUB_OFFLINE`` and the local cache apply). Supported architectures:
            see ``performer_hf.conversion.SUPPORTED_ARCHITECTURES``.
        output_dir: the folder to write: ``config.json``, ``model.safetensors``, the remote code, the
            tokenizer files, the source's sentence-transformers pipeline if it has one (``modules.json``
            and its module folders, see ``sentence_pipeline.py``), a ``README.md`` model card and
            ``conversion_report.json``. It is written beside its final place and renamed when complete
            (inside it for a mount point, a Docker volume: its entries moved up), so a failure leaves nothing
            behind.
        overwrite: replace a non-empty ``output_dir`` (only once the conversion has succeeded).
        base_model: the Hub id named in the model card (default: the Hub id of ``source``; a local folder is
            named in plain text, with no ``base_model`` metadata or Hub link: pass the Hub id it came from).
        fidelity: measure the fidelity report on sample text (see ``fidelity.py``) and put it in the card.
        method: the attention settings under ``overrides`` (``performer_hf.conversion.convert.METHODS``): ``"hybrid"``
            (exact local window, global token and, bidirectionally, routed key blocks, plus a centred ``poly2`` far
            field), ``"sparse"`` (causal only: exact window, first tokens and the earlier key blocks each query
            selects) or ``"favor"`` (plain FAVOR+). Default: ``"sparse"`` for the decoders converted in place,
            ``"hybrid"`` otherwise; ``"favor"`` when ``attention_kernel`` names a FAVOR+-only kernel (``relu``,
            ``elu``, ``softmax_trig``).
        calibrate: measure fixed per-layer statistics (centres, FAVOR++ ``A`` per head) on sample text
            with the source as teacher (see ``calibration.py``). Causal hybrid models that centre or use
            ``"softmax_opt"`` are always calibrated (they must not read later tokens). Encoders centre each
            sequence by its own means: there it fits only ``A``, and is refused where there is nothing to fit.
        transfer: models converted in place: train the attention's learnable parts (feature projection, centres,
            FAVOR++ ``A``, far-field gains) to match the source's attention on unlabelled text
            (:func:`performer_hf.transfer_attention`), as a :class:`TransferSettings`; None: no transfer.
        **overrides: ``PerformerConfig`` fields, e.g. ``attention_kernel="exact"``, ``nb_features=128``,
            ``local_window=33``, ``max_position_embeddings=4096`` (tokens; the pretrained position table
            is tiled to fill it).

    Returns:
        The output folder.

    Raises:
        ConversionError: with a one-line cause, for an unsupported architecture, missing or corrupt
            weights, a config that does not match the weights, an existing non-empty output folder, or an output
            folder that is (or holds) the source folder.
    """
    output_dir = Path(output_dir).expanduser().absolute()
    check_output_dir(output_dir, overwrite, Path(source).expanduser())
    overrides = dict(overrides)
    transfer, revision = _deprecated_keywords(overrides, transfer)
    folder, repo_id = resolve_source(source, revision)
    architecture = source_architecture(folder)
    if architecture in IN_PLACE_ARCHITECTURES:  # Llama & co. keep their class; only the attention changes
        method = _method(method, overrides, DEFAULT_IN_PLACE_METHOD)
        if transfer is not None and method == "sparse":
            raise ConversionError(
                "attention transfer trains the far field's parts, and the sparse method (the default for decoders) "
                "has none: convert with --method hybrid to transfer, or leave out --transfer-steps."
            )
        if calibrate:
            raise ConversionError(
                f"--calibrate is not available for {architecture} (converted in place): use --transfer-steps, "
                "which starts from calibrated centres."
            )
        return convert_in_place(
            folder,
            output_dir,
            architecture,
            method,
            overrides,
            fidelity,
            _card_base_model(base_model or repo_id, folder),
            transfer,
        )
    if transfer is not None:
        raise ConversionError(
            "attention transfer (--transfer-steps) is for the models converted in place "
            f"({', '.join(IN_PLACE_ARCHITECTURES)}); a {architecture} becomes a Performer model, whose hybrid "
            "attention's fixed statistics are calibrated at conversion (--calibrate fits FAVOR++'s A)."
        )
    checkpoint = read_source(folder, repo_id)
    head = checkpoint.family.heads[checkpoint.architecture]
    config = performer_config(checkpoint, overrides, method)
    if calibrate and config.attention_method != "hybrid":
        raise ConversionError(
            f"--calibrate measures the hybrid's centres on sample text; {_attention_named(config)} has none: leave "
            "it out, or convert with --method hybrid."
        )
    if calibrate and not calibrated_statistics(config, is_causal(checkpoint), overrides):
        raise ConversionError(_nothing_to_calibrate(config, is_causal(checkpoint)))

    stored = read_tensors(folder)
    saved_dtype = _saved_dtype(overrides.get("dtype"), stored_dtype(stored))
    weights = as_float32(stored)
    del stored
    mapping = map_weights(
        weights, checkpoint.family, checkpoint.architecture, config.hidden_size, config.tie_word_embeddings
    )
    pretrained_rows = mapping.tensors[POSITION_TABLE].shape[0] if POSITION_TABLE in mapping.tensors else 0
    if overrides.get("max_position_embeddings") is not None and pretrained_rows > 0:  # refused if it shrinks it
        mapping.tensors[POSITION_TABLE] = extend_positions(
            mapping.tensors[POSITION_TABLE], config.max_position_embeddings, config.position_offset
        )
    # only a table grown past the pretrained one raises the tokenizer's and sentence-transformers' lengths
    extended = pretrained_rows > 0 and config.max_position_embeddings > pretrained_rows
    pooler = head.pooler and "performer.pooler.dense.weight" in mapping.tensors
    model = build_model(head.target_class, config, pooler)
    if model.base_model is model:
        mapping.strip_target_prefix(model.base_model_prefix + ".")
    new = _fill_model(model, mapping)
    logger.info(
        "mapped %d source tensors to a %s, dropped %d (%s), %d new (random-feature projections)",
        len(mapping.used),
        head.target_class,
        len(mapping.dropped),
        ", ".join(sorted(set(mapping.dropped.values()))) or "none",
        len(new),
    )

    tokenizer = _load_tokenizer(folder)
    calibration = None
    if config.attention_method == "hybrid" and (calibrate or needs_calibration(config, is_causal(checkpoint))):
        exact = exact_twin(model, head.target_class, pooler)
        calibration = calibrate_model(
            model,
            exact,
            sample_batch(config, tokenizer),
            is_causal(checkpoint),
            parameter="far_field_parameter" not in overrides,
        )
        del exact
    report = fidelity_report(checkpoint, model, head.target_class, pooler, tokenizer, saved_dtype) if fidelity else None
    if report is not None:
        logger.info("%s", report.format_table())
        worst = max(report.mapping_check().values())
        if worst > 1e-3:
            logger.warning(
                "with exact attention the converted model differs from the source by up to %.2e: check the mapping",
                worst,
            )

    base_model = _card_base_model(base_model or repo_id, folder)
    model.to(saved_dtype)  # the random-feature projections stay float32 (PerformerAttention._apply)
    if model.can_generate() and (folder / GENERATION_CONFIG).is_file():  # the source's decoding defaults
        model.generation_config = GenerationConfig.from_pretrained(folder)
    staging = staging_folder(output_dir)
    try:
        model.save_pretrained(staging)
        positions = config.max_position_embeddings - config.position_offset
        copied = copy_tokenizer(folder, staging, positions if extended else None)
        sentence_pipeline = copy_sentence_pipeline(folder, staging, positions, extended)
        card_source = CardSource(
            base_model,
            source_license(folder),
            checkpoint.architecture,
            pretrained_rows - config.position_offset,
            folder.name,
        )
        card = build_model_card(
            card_source,
            head.target_class,
            config,
            mapping.dropped,
            report,
            sentence_pipeline=bool(sentence_pipeline),
            dtype=str(saved_dtype).removeprefix("torch."),
        )
        card.save(staging / "README.md")
        summary = {
            "source": str(source),
            "base_model": base_model,
            "source_architecture": checkpoint.architecture,
            "target_class": head.target_class,
            "dtype": str(saved_dtype).removeprefix("torch."),
            "used": mapping.used,
            "dropped": mapping.dropped,
            "new": new,
            "attention": attention_settings(config),
            "calibration": calibration,
            "tokenizer_files": copied,
            "sentence_transformers_files": sentence_pipeline,
            "positions": {"pretrained": pretrained_rows - config.position_offset, "converted": positions},
            "fidelity": report.to_dict() if report is not None else None,
        }
        (staging / REPORT_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        publish(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote %s", output_dir)
    return output_dir
