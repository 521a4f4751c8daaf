"""Converting models that keep their own transformers class: Llama, Mistral, Qwen2, Qwen3, Gemma3.

These architectures (rotary positions, grouped-query attention) are not rewritten into the Performer family:
their weights stay exactly as they are, and the converted folder only changes the config, which names the
attention implementation (``"performer_hybrid"`` or ``"performer"``, see ``performer_hf.integrations``) and
its settings (``performer_attention``). ``AutoModelForCausalLM.from_pretrained(converted)`` then loads the
source class with Performer attention (``performer_hf`` imported).

:data:`IN_PLACE_ARCHITECTURES` has one row per architecture.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

from ..data_assets import python_docs, python_docstrings
from ..integrations.attention_transfer import text_batches, transfer_attention
from ..integrations.remote_code import ship_remote_code
from ..modeling.attention_settings import (
    ATTENTION_FIELDS,
    CONFIG_ATTRIBUTE,
    IMPLEMENTATION_OF_METHOD,
    METHOD_OF_IMPLEMENTATION,
    head_shape,
    method_config,
)
from .errors import ConversionError, one_line
from .model_card import build_in_place_card, source_license
from .output_folder import publish, staging_folder
from .tokenizer_files import tokenizer_files

logger = logging.getLogger(__name__)

# the converter's method names -> attn_implementation names
PARITY_TOLERANCE = 1e-4
GENERATION_FILES = ("generation_config.json",)  # copied with the tokenizer's files, where the model wrote none


@dataclass(frozen=True)
class InPlace:
    """A source architecture converted in place: its ``model_type`` and the ``Auto*`` class that loads it."""

    model_type: str
    auto_class: str = "AutoModelForCausalLM"


IN_PLACE_ARCHITECTURES: dict[str, InPlace] = {
    "LlamaForCausalLM": InPlace("llama"),
    "MistralForCausalLM": InPlace("mistral"),
    "Qwen2ForCausalLM": InPlace("qwen2"),
    "Qwen3ForCausalLM": InPlace("qwen3"),
    "Gemma3ForCausalLM": InPlace("gemma3_text"),
}


@dataclass(frozen=True)
class TransferSettings:
    """Attention transfer at conversion (:func:`performer_hf.transfer_attention`), for the models converted in
    place: ``steps`` windows of ``length`` tokens from ``text_file`` (UTF-8 text; None: the standard library's
    docstrings, which ship with Python). Checked on construction, so a bad request fails before any work.

    >>> performer_hf.convert(folder, out, transfer=TransferSettings(steps=50, length=2048))
    """

    steps: int
    text_file: str | Path | None = None
    length: int = 1024

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ConversionError(f"transfer steps must be a positive whole number, got {self.steps!r}.")
        if not isinstance(self.length, int) or self.length < 2:
            raise ConversionError(f"the transfer length must be a number of tokens of at least 2, got {self.length!r}.")
        if self.text_file is not None:
            text_file = Path(self.text_file).expanduser()
            if not text_file.is_file():
                raise ConversionError(f"the transfer text {str(text_file)!r} is not a file: pass a UTF-8 text file.")
            object.__setattr__(self, "text_file", text_file)

    @property
    def text_name(self) -> str:
        return "the Python standard library's docstrings" if self.text_file is None else self.text_file.name

    def texts(self) -> list[str]:
        if self.text_file is None:
            return python_docstrings()
        return [self.text_file.read_text(encoding="utf-8")]


def _auto_class(row: InPlace):
    import transformers

    return getattr(transformers, row.auto_class)


def _attention_settings(folder: Path, implementation: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The attention fields given for ``folder``'s model, checked with its head shapes (as its first call would check
    them) before any model is loaded; a folder converted already is refused. A field given as None is kept: it sets
    the field to None (``far_field_parameter=None``), as in the Performer family's conversions."""
    from transformers import AutoConfig

    unknown = sorted(set(overrides) - set(ATTENTION_FIELDS))
    if unknown:
        raise ConversionError(
            f"{', '.join(unknown)} cannot be set for a model converted in place (its architecture is kept); "
            f"the attention fields can: {', '.join(ATTENTION_FIELDS)}."
        )
    config = AutoConfig.from_pretrained(folder)
    if getattr(config, CONFIG_ATTRIBUTE, None) is not None:
        raise ConversionError(
            f"{folder} was converted already (its config.json holds {CONFIG_ATTRIBUTE}, attn_implementation="
            f"{getattr(config, '_attn_implementation', None)!r}): a conversion starts from the source's own softmax "
            "attention, which it measures against and which this folder no longer runs. Convert the original "
            "checkpoint (its card names it) with the method you want."
        )
    setattr(config, CONFIG_ATTRIBUTE, dict(overrides))
    try:
        method_config(config, implementation, True, *head_shape(config))
    except (ValueError, TypeError, StrictDataclassError) as error:  # strict validation wraps the ValueError
        reason = re.sub(  # the converter's method names the method
            r"load the model with attn_implementation='(\w+)'",
            lambda match: f"convert with method={METHOD_OF_IMPLEMENTATION.get(match[1])!r}",
            one_line(error.__cause__ or error),
        )
        raise ConversionError(f"invalid attention settings: {reason}") from None
    return overrides


def _load(folder: Path, row: InPlace, implementation: str, settings: dict[str, Any] | None, dtype="auto"):
    """The source model (``implementation`` None: its own attention) or its Performer-attention twin, in the
    checkpoint's own dtype unless ``dtype`` says otherwise."""
    from transformers import AutoConfig

    from .source import weight_files  # (source reads the in-place architectures)

    config = AutoConfig.from_pretrained(folder)
    if config.model_type != row.model_type:
        raise ConversionError(
            f"config.json has model_type={config.model_type!r}, but its architecture needs {row.model_type!r}."
        )
    kwargs = {"config": config, "dtype": dtype}
    if implementation is not None:
        setattr(config, CONFIG_ATTRIBUTE, settings)
        kwargs["attn_implementation"] = implementation
    weight_files(folder)  # a folder without its weights, or a shard index naming missing files, in one line
    try:  # tensors of other shapes are reported with the rest below
        model, loading = _auto_class(row).from_pretrained(
            folder, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
    except (OSError, RuntimeError, ValueError, SafetensorError) as error:  # unreadable or truncated files
        raise ConversionError(f"cannot load {folder}: {one_line(error)}") from None
    wrong = {
        "missing": sorted(loading["missing_keys"]),
        "unexpected": sorted(loading["unexpected_keys"]),
        "of other shapes": [  # (name, the checkpoint's shape, the config's)
            f"{name} {list(saved)} where config.json makes {list(expected)}"
            for name, saved, expected in sorted(loading["mismatched_keys"])
        ],
    }
    if any(wrong.values()):  # new weights drawn at random, or the checkpoint's own left out: not the source model
        found = "; ".join(f"tensors {kind}: {', '.join(names[:3])}" for kind, names in wrong.items() if names)
        raise ConversionError(
            f"the weights in {folder} do not match its config.json ({found}): convert a checkpoint whose weights and "
            "config were saved together (model.save_pretrained)."
        )
    return model.eval()


def _sample_ids(config, length: int = 64) -> torch.Tensor:
    """(2, length) token ids, fixed: the parity check's input."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, config.get_text_config().vocab_size, (2, length), generator=generator)


@torch.no_grad()
def exact_parity(folder: Path, row: InPlace, implementation: str) -> float:
    """Largest |logit difference| between the source and its conversion with ``attention_kernel="exact"``:
    the adapter (masks, positions, grouped heads, scaling) checked against the source's own attention."""
    source = _load(folder, row, None, None, dtype=torch.float32)
    exact = _load(folder, row, implementation, {"attention_kernel": "exact"}, dtype=torch.float32)
    ids = _sample_ids(source.config)
    return float((source(ids).logits - exact(ids).logits).abs().max())


FIDELITY_TOKENS = 2048  # beyond the sparse preset's exact reach (1,088 tokens) and the hybrid's window


def _fidelity_ids(folder: Path, config, length: int) -> tuple[torch.Tensor, str]:
    """(1, L) token ids of Python's documentation (text no conversion step reads), tokenized with the folder's
    tokenizer, and what they are; random ids where the folder has no tokenizer."""
    from transformers import AutoTokenizer

    length = min(length, getattr(config.get_text_config(), "max_position_embeddings", length))
    if _has_tokenizer(folder):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer("\n\n".join(python_docs()), return_tensors="pt").input_ids[:, :length]
        if ids.shape[1] > 1:
            return ids, f"{ids.shape[1]} tokens of Python's documentation (pydoc topics)"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.get_text_config().vocab_size, (1, length), generator=generator)
    return ids, f"{length} random token ids (the source folder has no usable tokenizer)"


def _attention_modules(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


@torch.no_grad()
def in_place_fidelity(folder: Path, row: InPlace, model) -> dict:
    """How far the converted ``model`` is from the source on real text, past the exact reach of the presets: each
    layer's attention output against the source's along the same forward pass (relative error, propagated: what
    the earlier layers changed counts too), next-token top-1 agreement, the mean KL divergence of the converted
    model's next-token distribution from the source's, and both perplexities."""
    source = _load(folder, row, None, None, dtype=model.dtype)
    ids, text = _fidelity_ids(folder, model.config, FIDELITY_TOKENS)
    outputs = {"source": [], "converted": []}
    hooks = [
        module.register_forward_hook(lambda _m, _a, out, name=name: outputs[name].append(out[0].float()))
        for name, which in (("source", source), ("converted", model))
        for module in _attention_modules(which)
    ]
    try:
        reference, candidate = (m(ids, labels=ids, use_cache=False) for m in (source, model))
    finally:
        for hook in hooks:
            hook.remove()
    errors = [
        float((ours - theirs).norm() / theirs.norm().clamp_min(1e-12))
        for ours, theirs in zip(outputs["converted"], outputs["source"], strict=True)
    ]
    source_logp = reference.logits[0, :-1].float().log_softmax(-1)  # (L - 1, V): next-token distributions
    converted_logp = candidate.logits[0, :-1].float().log_softmax(-1)
    return {
        "text": text,
        "attention_error_propagated": errors,
        "top1_agreement": float((source_logp.argmax(-1) == converted_logp.argmax(-1)).double().mean()),
        "kl_mean": float((source_logp.exp() * (source_logp - converted_logp)).sum(-1).mean()),
        "perplexity": float(candidate.loss.float().exp()),
        "source_perplexity": float(reference.loss.float().exp()),
    }


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _transfer(model, folder: Path, transfer: TransferSettings) -> dict:
    """Run attention transfer on ``model`` (see :class:`TransferSettings`); returns its record for the report."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ConversionError(f"attention transfer needs the source's tokenizer: {one_line(error)}") from None
    try:
        batches = text_batches(tokenizer, transfer.texts(), transfer.length, transfer.steps)
        report = transfer_attention(model, batches, transfer.steps)
    except ValueError as error:  # too little text, or windows the exact support covers
        raise ConversionError(f"attention transfer: {error}") from None
    return {"text": transfer.text_name, **report.to_dict()}


def convert_in_place(
    folder: Path,
    output_dir: Path,
    architecture: str,
    method: str,
    overrides: dict[str, Any],
    fidelity: bool,
    base_model: str | None,
    transfer: TransferSettings | None = None,
) -> Path:
    """Write ``folder``'s model with Performer attention to ``output_dir`` (already checked): the same weights,
    the config naming the attention implementation and its settings, the tokenizer, a model card
    (``README.md``, naming ``base_model``, or the folder for a local source without one) and
    ``conversion_report.json``. With ``transfer``, the attention's
    learnable parts are first trained to match the source's attention (the weights stay the source's)."""
    row = IN_PLACE_ARCHITECTURES[architecture]
    implementation = IMPLEMENTATION_OF_METHOD[method]
    settings = _attention_settings(folder, implementation, overrides)
    if transfer is not None and not _has_tokenizer(folder):
        raise ConversionError(
            f"attention transfer tokenizes its text with the source's tokenizer, and {folder} has none: add its "
            "tokenizer files, or leave out --transfer-steps."
        )
    parity = exact_parity(folder, row, implementation) if fidelity else None
    if parity is not None and parity > PARITY_TOLERANCE:
        raise ConversionError(
            f"with exact attention the converted {architecture} differs from the source by {parity:.2e} (more than "
            f"{PARITY_TOLERANCE:.0e}): the attention adapter does not reproduce this model; please report it."
        )
    model = _load(folder, row, implementation, settings)
    with torch.no_grad():
        model(_sample_ids(model.config, 8))  # resolves and records the settings in the config
    transferred = _transfer(model, folder, transfer) if transfer is not None else None
    measured = in_place_fidelity(folder, row, model) if fidelity else None
    staging = staging_folder(output_dir)
    try:
        ship_remote_code(model).save_pretrained(staging)  # with the code that loads it without performer_hf
        copied = tokenizer_files(folder) + [name for name in GENERATION_FILES if (folder / name).is_file()]
        for name in copied:
            if not (staging / name).exists():
                shutil.copy2(folder / name, staging / name)
        report = {
            "source": str(folder),
            "source_architecture": architecture,
            "target_class": architecture,
            "attn_implementation": implementation,
            "attention": getattr(model.config, CONFIG_ATTRIBUTE),
            "exact_parity_max_abs_diff": parity,
            "fidelity": measured,
            "copied_files": sorted(copied),
            "attention_transfer": transferred,
        }
        (staging / "conversion_report.json").write_text(json.dumps(report, indent=2) + "\n")
        text_config = model.config.get_text_config()
        card = build_in_place_card(
            base_model=base_model,
            source_folder=folder.name,
            license_name=source_license(folder),
            architecture=architecture,
            implementation=implementation,
            parity=parity,
            method=method_config(text_config, implementation, True, *head_shape(text_config)),
            transfer=None if transferred is None or transferred["restored"] else transferred,  # (undone: zero-shot)
            fidelity=measured,
        )
        card.save(staging / "README.md")
        publish(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(
        "wrote %s: %s with attn_implementation=%r (exact parity %s)",
        output_dir,
        architecture,
        implementation,
        "not measured" if parity is None else f"{parity:.1e}",
    )
    if measured is not None:
        logger.info(
            "fidelity on %s: top-1 agreement %.4f, mean KL %.4f nats, perplexity %.3f (source %.3f), attention "
            "error per layer %.3f-%.3f",
            measured["text"],
            measured["top1_agreement"],
            measured["kl_mean"],
            measured["perplexity"],
            measured["source_perplexity"],
            min(measured["attention_error_propagated"]),
            max(measured["attention_error_propagated"]),
        )
    return output_dir
