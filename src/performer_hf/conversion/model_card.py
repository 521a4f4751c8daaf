"""The README.md model card written next to a converted checkpoint."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..attention_card import (
    kernel_description,
    method_description,
    method_lines,
    states_kernel,
    transfer_summary,
    uses_projection,
)
from ..modeling.attention_methods import ATTENTION_METHODS
from ..modeling.attention_settings import ATTENTION_FIELDS
from .fidelity import FidelityReport

logger = logging.getLogger(__name__)


def source_license(folder: Path) -> str:
    """The ``license`` of the source model card's YAML metadata, or ``"unknown"``."""
    card = folder / "README.md"
    if card.is_file():
        try:
            license_name = ModelCard.load(card).data.license
        except Exception as error:  # a malformed card must not stop a conversion; say so and carry on
            logger.warning("could not read the source model card %s (%s); license set to 'unknown'", card, error)
            return "unknown"
        if license_name:
            return str(license_name)
    return "unknown"


@dataclass(frozen=True)
class CardSource:
    """What a conversion card says about the source: the Hub id it names (None for a local folder, named in plain
    text as ``folder``, with no Hub metadata or link), its license, its architecture and the positions it was
    pretrained with."""

    base_model: str | None
    license_name: str
    architecture: str
    pretrained_positions: int
    folder: str = ""

    def named(self) -> str:
        """The source as the card's text names it."""
        return self.base_model or f"the local checkpoint `{self.folder}`"


def build_model_card(
    source: CardSource,
    target_class: str,
    config,
    dropped: dict[str, str],
    report: FidelityReport | None,
    sentence_pipeline: bool = False,
    dtype: str = "float32",
) -> ModelCard:
    """A model card whose metadata names the base model, license, library and tags, and whose text
    states the FAVOR+ settings, the dtype of the weights and the fidelity measured at conversion;
    ``sentence_pipeline``: the folder carries the source's sentence-transformers pipeline (tagged, with its usage)."""
    base_model, license_name, source_architecture, pretrained_positions = (
        source.base_model,
        source.license_name,
        source.architecture,
        source.pretrained_positions,
    )
    data = ModelCardData(
        base_model=base_model,
        license=license_name,
        library_name="transformers",
        tags=["performer", "favor+", "linear-attention", "long-context", "performer-hf"]
        + (["sentence-transformers"] if sentence_pipeline else []),
    )
    positions = config.max_position_embeddings - config.position_offset
    redraw = (
        "fixed (never redrawn; evaluation is deterministic)"
        if config.feature_redraw_interval is None
        else f"redrawn every {config.feature_redraw_interval} optimizer steps during training by the training "
        "code (`model.redraw_projections(step)`); never inside `forward`, so evaluation is deterministic"
    )
    coupling = {"orthogonal": "orthogonal", "simplex": "simplex", "iid": "i.i.d."}[config.feature_coupling]
    hybrid = config.attention_method == "hybrid"
    lines = [
        f"# Performer conversion of {source.named()}",
        "",
        f"This checkpoint is {source.named() if base_model is None else _hub_link(base_model)} ({source_architecture}) "
        "converted "
        f"to a `{target_class}` by performer-hf: every pretrained "
        f"weight is kept and softmax attention is replaced by {method_description(config)}. "
        "It has **not** been finetuned after the swap.",
        "",
        "## Attention settings",
        "",
    ]
    if states_kernel(config):
        lines += [
            f"- attention kernel{' (far field)' if hybrid else ''}: `{config.attention_kernel}` "
            f"({kernel_description(config)})",
            f"- nb_features (random features per head): {config.nb_features}"
            + ("" if uses_projection(config) else " (unused by this deterministic kernel)"),
            f"- feature coupling: {coupling}, row norms `{config.feature_row_norms}`, seed {config.projection_seed}",
            f"- redraw policy: {redraw}",
        ]
    lines += method_lines(config)
    lines += [
        f"- causal: {'yes' if config.is_decoder or target_class == 'PerformerForCausalLM' else 'no'}",
        f"- positions: {positions} (pretrained: {pretrained_positions}"
        + (", extended by tiling the pretrained table)" if positions > pretrained_positions else ")"),
        f"- weights: `{dtype}`",
        "",
        "## Usage",
        "",
        "```python",
        "import performer_hf  # registers the Performer classes with the Auto* factories",
        "from transformers import AutoModel, AutoTokenizer",
        "",
        'model = AutoModel.from_pretrained("path/to/this/folder")',
        "# or, without performer-hf installed:",
        '# model = AutoModel.from_pretrained("path/to/this/folder", trust_remote_code=True)',
        "```",
    ]
    if sentence_pipeline:
        lines += [
            "",
            "The source's sentence-transformers pipeline (`modules.json`, pooling, normalisation ...) is carried over:",
            "",
            "```python",
            "import performer_hf",
            "from sentence_transformers import SentenceTransformer",
            "",
            'model = SentenceTransformer("path/to/this/folder")',
            "# or, without performer-hf installed:",
            '# model = SentenceTransformer("path/to/this/folder", trust_remote_code=True)',
            "```",
        ]
    lines += [
        "",
        "## Fidelity measured at conversion",
        "",
    ]
    if report is None:
        lines.append("Not measured (conversion ran with the fidelity report switched off).")
    else:
        note = report.exact_dispatch_note()
        lines += [
            f"Measured on the weights as saved (`{report.dtype}`), on {report.num_sequences} sequences "
            f"({report.num_tokens} tokens) of {report.text}, against {source.named()} (float32) and against the same "
            "weights with exact softmax attention"
            + (f" ({note}, where it computes what the source does)." if note else "."),
            "",
            "| layer | attention rel. error (same input) | attention rel. error (propagated) |",
            "| --- | --- | --- |",
        ]
        for i, (local, propagated) in enumerate(
            zip(report.attention_error_local, report.attention_error_propagated, strict=True)
        ):
            lines.append(f"| {i} | {local:.4f} | {propagated:.4f} |")
        lines += [
            "",
            f"- final hidden states vs the source: mean cosine {report.hidden_cosine:.4f}, relative error "
            f"{report.hidden_relative_error:.4f}",
        ]
        lines += [f"- {name} vs the source: {value:.4f}" for name, value in report.head.items()]
        exact = ", ".join(f"{name} {value:.1e}" for name, value in report.exact_max_abs_diff.items())
        lines.append(f'- same weights with `attention_kernel="exact"` vs the source, max abs difference: {exact}')
        if report.mapping_max_abs_diff:
            mapping = ", ".join(f"{name} {value:.1e}" for name, value in report.mapping_max_abs_diff.items())
            lines.append(f"- the same in float32, before the cast to `{report.dtype}` (the mapping check): {mapping}")
        lines += [
            "",
            "The converted attention approximates softmax attention; a pretrained model swapped to it without "
            "finetuning loses some accuracy (the Performer paper recovers it with a short finetune). Check the "
            "figures above, and finetune before relying on it.",
        ]
    if dropped:
        lines += ["", "## Source tensors not carried over", ""]
        by_reason: dict[str, list[str]] = {}
        for name, reason in sorted(dropped.items()):
            by_reason.setdefault(reason, []).append(f"`{name}`")
        lines += [f"- {reason}: {', '.join(names)}" for reason, names in by_reason.items()]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def _hub_link(repo_id: str) -> str:
    return f"[{repo_id}](https://huggingface.co/{repo_id})"


def _transfer_paragraph(transfer: dict | None) -> str:
    if transfer is None:
        return (
            "Converted zero-shot, without finetuning: expect lower quality than the source, most of all with plain "
            "FAVOR+."
        )
    return transfer_summary(transfer) + " No finetuning: expect lower quality than the source."


def _field_value(value) -> str:
    """An attention field for the card's table: per-layer-and-head lists (FAVOR++'s A, far-field gains) as their
    shape and range, anything else as it is."""
    if not isinstance(value, list):
        return f"`{value}`"
    numbers = sorted(number for row in value for number in row)
    return (
        f"per layer and head ({len(value)} x {len(value[0])}): median {statistics.median(numbers):.3g}, "
        f"from {numbers[0]:.3g} to {numbers[-1]:.3g}"
    )


def _fidelity_paragraph(fidelity: dict | None) -> str:
    """The in-place conversion's fidelity figures (``in_place.in_place_fidelity``) as a card paragraph."""
    if fidelity is None:
        return "Fidelity on real text: not measured (converted with `fidelity=False`)."
    errors = fidelity["attention_error_propagated"]
    return (
        f"Fidelity on {fidelity['text']}, against the source: next-token top-1 agreement "
        f"{fidelity['top1_agreement']:.4f}, mean KL divergence {fidelity['kl_mean']:.4f} nats, perplexity "
        f"{fidelity['perplexity']:.3f} against {fidelity['source_perplexity']:.3f}. Each layer's attention output "
        f"against the source's along the same forward pass (relative error, propagated): "
        + ", ".join(f"{error:.3f}" for error in errors)
        + " (first to last layer)."
    )


def build_in_place_card(
    *,
    base_model: str | None,
    source_folder: str,
    license_name: str,
    architecture: str,
    implementation: str,
    method,
    parity: float | None,
    transfer: dict | None = None,
    fidelity: dict | None = None,
) -> ModelCard:
    """The card of a model converted in place (``in_place.py``): the source class with Performer attention;
    ``method``: the ``PerformerConfig`` that carries its attention settings; ``transfer``: attention transfer's
    record in ``conversion_report.json``, if it ran; ``base_model``: the source's Hub id (None: a local checkpoint,
    named ``source_folder`` in plain text, with no Hub metadata)."""
    data = ModelCardData(
        base_model=base_model,
        license=license_name,
        library_name="transformers",
        tags=["performer", "favor+", "linear-attention", "long-context", "performer-hf"],
    )
    measured = "not measured" if parity is None else f"{parity:.1e} (largest logit difference on sample ids)"
    read = ("attention_method", *ATTENTION_METHODS[method.attention_method].fields)  # the fields its method reads
    rows = [f"| `{name}` | {_field_value(getattr(method, name))} |" for name in ATTENTION_FIELDS if name in read]
    fields = "\n".join(rows)
    decoding = "model.generate(**inputs)  # decodes from the method's own state, kept in generate()'s cache"
    named = f"The local checkpoint `{source_folder}`" if base_model is None else f"`{base_model}`"
    text = f"""# {base_model or source_folder} with Performer attention

{named} ({architecture}) with its softmax attention replaced by the `performer-hf` attention implementation
`{implementation}`: {method_description(method)}. Every weight is the source's, unchanged; the config names the
attention (`attn_implementation`, `performer_attention`).

```python
import performer_hf  # registers the Performer attention implementations
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("<this folder or repo>")
inputs = AutoTokenizer.from_pretrained("<this folder or repo>")("The pass key is", return_tensors="pt")
{decoding}
```

{_transfer_paragraph(transfer)}

Exact-attention parity of the conversion (`attention_kernel="exact"` through the same adapter): {measured}.

{_fidelity_paragraph(fidelity)}

| attention field | value |
| --- | --- |
{fields}
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}")
