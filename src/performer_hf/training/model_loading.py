"""Tokenizer and model for the training scripts.

A model comes from one of three places: a Performer checkpoint (``--model_name_or_path``), a
Performer config trained from scratch (``--config_name`` / ``--config_overrides``), or a BERT /
RoBERTa / GPT-2 checkpoint converted on the fly (``--convert_from``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..conversion.errors import ConversionError, one_line
from ..integrations.remote_code import ship_remote_code
from ..modeling.attention_settings import IMPLEMENTATIONS
from ..modeling.configuration_performer import PerformerConfig
from ..modeling.modeling_in_place import IN_PLACE_CLASSES
from .arguments import TrainingInputError
from .lora import apply_lora

logger = logging.getLogger(__name__)

CONVERTED_SUBDIR = "converted"


def _parse_value(text: str):
    """'none' -> None, 'true'/'false' -> bool, then int, float, else the string itself."""
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_config_overrides(text: str | None) -> dict:
    """Parse ``--config_overrides`` ('key=value,key=value') into config keyword arguments.

    Keys must be attributes of :class:`PerformerConfig`; values are typed from their spelling.
    """
    if not text:
        return {}
    reference = PerformerConfig()
    overrides = {}
    for item in text.split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise TrainingInputError(f"--config_overrides entry {item!r} is not of the form key=value.")
        key, value = (part.strip() for part in item.split("=", 1))
        if not hasattr(reference, key):
            raise TrainingInputError(f"--config_overrides: {key!r} is not a PerformerConfig field.")
        overrides[key] = _parse_value(value)
    return overrides


def load_tokenizer(args: argparse.Namespace) -> PreTrainedTokenizerBase:
    """The tokenizer named by ``--tokenizer_name``, else the model's (or the converted source's)."""
    source = args.tokenizer_name or args.model_name_or_path or args.convert_from
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as error:
        raise TrainingInputError(f"Could not load a tokenizer from {source!r}: {error}") from error


def _convert_source(args: argparse.Namespace, accelerator, overrides: dict) -> str:
    """Convert ``--convert_from`` into ``<output_dir>/converted`` (main process) and return the folder.

    ``--config_overrides`` go to the converter (e.g. ``max_position_embeddings=4096`` tiles the
    pretrained position table). The converter's fidelity report is skipped: the run's own
    evaluation measures the model.
    """
    try:
        from performer_hf.conversion import convert  # lazily: only this path needs it
    except ImportError as error:
        raise TrainingInputError(
            "--convert_from needs performer_hf.conversion, which this installation does not provide; convert "
            "with `performer-hf convert` first and pass the result as --model_name_or_path."
        ) from error
    if args.feature_redraw_interval and (architecture := _converted_in_place(args.convert_from)):
        raise TrainingInputError(
            f"--feature_redraw_interval redraws the random features of a Performer-family model; --convert_from "
            f"converts this {architecture} in place, and it keeps its class, with no features to redraw (with "
            "Performer attention, its features are fixed by projection_seed). Drop the argument."
        )
    if "attention_method" in overrides and overrides["attention_method"] != args.convert_method:
        raise TrainingInputError(
            f"--config_overrides attention_method={overrides['attention_method']} with --convert_from: the converter "
            f"takes the method as --convert_method {overrides['attention_method']} (its settings stay in "
            "--config_overrides)."
        )
    overrides = {key: value for key, value in overrides.items() if key != "attention_method"}
    destination = os.path.join(args.output_dir, CONVERTED_SUBDIR)
    if accelerator.is_main_process:
        logger.info("Converting %s to a Performer in %s", args.convert_from, destination)
        try:
            convert(
                args.convert_from, destination, overwrite=True, fidelity=False, method=args.convert_method, **overrides
            )
        except ConversionError as error:
            raise TrainingInputError(f"--convert_from {args.convert_from!r}: {error}") from error
    accelerator.wait_for_everyone()
    return destination


def _converted_in_place(source: str) -> str | None:
    """The architecture of ``source`` where the converter keeps its class (Llama & co.), else None (None too where
    the source cannot be read: the conversion then says why)."""
    from performer_hf.conversion.in_place import IN_PLACE_ARCHITECTURES
    from performer_hf.conversion.source import resolve_source, source_architecture

    try:
        architecture = source_architecture(resolve_source(source)[0])
    except ConversionError:
        return None
    return architecture if architecture in IN_PLACE_ARCHITECTURES else None


@contextlib.contextmanager
def removing_a_refused_conversion(args: argparse.Namespace, accelerator):
    """Remove ``<output_dir>/converted`` when the run is refused (:class:`TrainingInputError`) after converting
    into it, so that the corrected rerun finds the ``--output_dir`` as it was; a folder that was there before the run
    is left alone."""
    destination = os.path.join(args.output_dir, CONVERTED_SUBDIR)
    made_here = args.convert_from is not None and not os.path.lexists(destination)
    try:
        yield
    except TrainingInputError:
        if made_here and accelerator.is_main_process:
            shutil.rmtree(destination, ignore_errors=True)
        raise


def load_model(
    args: argparse.Namespace,
    auto_class,
    tokenizer: PreTrainedTokenizerBase,
    accelerator,
    new_head: bool = False,
    redraw_head: bool = False,
    task: str | None = None,
    **config_kwargs,
) -> PreTrainedModel:
    """Build the model for ``auto_class`` (e.g. ``AutoModelForMaskedLM``), wrapped with LoRA adapters for
    ``task`` (``"mlm"``, ``"clm"``, ``"classification"``) when ``--lora_r`` is set.

    ``config_kwargs`` (e.g. ``num_labels``) are set on the config whatever the source; a model trained
    from scratch also takes its vocabulary size and padding id from the tokenizer unless
    ``--config_overrides`` sets them. ``new_head=True`` lets a loaded checkpoint's task head be
    re-initialised when its shape differs (a classifier with another number of labels); ``redraw_head=True``
    re-initialises it even when it fits (a classifier trained on other labels of the same count).
    """
    overrides = parse_config_overrides(args.config_overrides)
    load_options = {"ignore_mismatched_sizes": True} if new_head else {}
    loading: dict = {}
    if args.convert_from is not None:
        source = _convert_source(args, accelerator, overrides)
        model, loading = auto_class.from_pretrained(source, output_loading_info=True, **config_kwargs, **load_options)
    elif args.model_name_or_path is not None:
        try:
            model, loading = auto_class.from_pretrained(
                args.model_name_or_path,
                trust_remote_code=args.trust_remote_code,
                output_loading_info=True,
                **{**overrides, **config_kwargs},
                **load_options,
            )
            _check_only_the_head_is_new(model, loading)
            if redraw_head:
                loading = {**loading, "missing_keys": set(loading.get("missing_keys") or ()) | _redraw_head(model)}
        except OSError as error:
            raise TrainingInputError(f"Could not load a model from {args.model_name_or_path!r}: {error}") from error
        except (ValueError, TypeError, RuntimeError, StrictDataclassError) as error:  # what the overrides ask for
            cause = error.__cause__ if isinstance(error, StrictDataclassError) and error.__cause__ else error
            problem = one_line(cause)
            if not args.config_overrides:
                message = f"Could not load a model from {args.model_name_or_path!r}: {problem}"
                raise TrainingInputError(message) from error
            raise TrainingInputError(
                f"Could not load {args.model_name_or_path!r} with --config_overrides {args.config_overrides!r} "
                f"({problem}). A model converted in place (Llama & co.) takes its attention settings in "
                "config.performer_attention, not as config fields; a Performer cannot change a field its weights fix "
                "(nb_features: the saved projections)."
            ) from error
    else:
        config = PerformerConfig.from_pretrained(args.config_name) if args.config_name else PerformerConfig()
        values = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
        values.update(overrides)
        values.update(config_kwargs)
        config.update(values)
        try:
            config.validate()
        except StrictDataclassError as error:
            raise TrainingInputError(f"Invalid Performer config: {error.__cause__ or error}") from error
        logger.info("Training a new Performer from scratch")
        model = auto_class.from_config(config)

    if type(model).__name__ in IN_PLACE_CLASSES and model.config._attn_implementation in IMPLEMENTATIONS:
        ship_remote_code(model)  # converted in place: the trained folder loads without performer_hf as well
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        logger.warning(
            "The tokenizer has %d tokens but the model only %d embeddings; resizing the embeddings.",
            len(tokenizer),
            model.get_input_embeddings().num_embeddings,
        )
        model.resize_token_embeddings(len(tokenizer))
    if args.lora_r is not None:
        model = apply_lora(model, args, task, new_weights(loading))
    return model


def new_weights(loading: dict) -> set[str]:
    """The weights a ``from_pretrained`` load drew anew (``output_loading_info``): those the checkpoint lacks (a
    task head it does not have) and those whose shape it does not fit (a classifier with another number of
    labels)."""
    mismatched = {entry[0] if isinstance(entry, tuple) else entry for entry in loading.get("mismatched_keys") or ()}
    return set(loading.get("missing_keys") or ()) | mismatched


def _check_only_the_head_is_new(model: PreTrainedModel, loading: dict) -> None:
    """Refuse a checkpoint whose pretrained weights (not only the task head's) changed shape and would be drawn
    anew: ``ignore_mismatched_sizes`` serves a classifier with another number of labels, and applied to the whole
    model it replaced the position table or the projections that ``--config_overrides`` resized."""
    head = _head_prefixes(model)
    mismatched = [entry[0] if isinstance(entry, tuple) else entry for entry in loading.get("mismatched_keys") or ()]
    body = sorted(key for key in mismatched if not key.startswith(head))
    if body:
        raise ValueError(
            f"the checkpoint's {', '.join(body[:3])}{' ...' if len(body) > 3 else ''} do not fit the model's shapes, "
            "and only the task head may be drawn anew"
        )


def _redraw_head(model: PreTrainedModel) -> set[str]:
    """Draw the task head's weights anew, as the model initialises a head its checkpoint lacks; returns their
    names."""
    head = _head_prefixes(model)
    for name, module in model.named_modules():
        if f"{name}.".startswith(head):
            for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                tensor._is_hf_initialized = False  # loaded: transformers' initialisers would leave it alone
            model._init_weights(module)
    return {name for name, _ in model.named_parameters() if name.startswith(head)}


def _head_prefixes(model: PreTrainedModel) -> tuple[str, ...]:
    """The names of the task head's modules (what a classifier's new head replaces): the top-level children
    other than the base model."""
    base = getattr(model, "base_model_prefix", "")
    return tuple(f"{name}." for name, _ in model.named_children() if name != base)


def usable_positions(config) -> int:
    """Longest sequence the position embeddings cover (RoBERTa-style Performers reserve ``position_offset``;
    other transformers models, e.g. a BigBird baseline, count from 0)."""
    return config.max_position_embeddings - getattr(config, "position_offset", 0)


def resolve_sequence_length(requested: int | None, config) -> int:
    """``--max_seq_length`` checked against the model's positions (default: all of them)."""
    available = usable_positions(config)
    if requested is None:
        return available
    if requested > available:
        offset = config.max_position_embeddings - available
        raise TrainingInputError(
            f"--max_seq_length {requested} exceeds the model's {available} positions "
            f"(max_position_embeddings={config.max_position_embeddings}, position_offset={offset}). "
            "Lower --max_seq_length, or use a model with more positions (from scratch: --config_overrides "
            f"max_position_embeddings={requested + offset})."
        )
    return requested
