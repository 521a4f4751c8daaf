"""The README.md model card written next to a converted checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from .fidelity import FidelityReport

logger = logging.getLogger(__name__)

_KERNEL_NAMES = {
    "softmax": "FAVOR+ positive random features (unbiased softmax kernel)",
    "softmax_hyperbolic": "FAVOR+ hyperbolic positive random features (softmax kernel)",
    "softmax_trig": "trigonometric random features (softmax kernel)",
    "softmax_opt": "FAVOR++ optimal positive random features (Likhosherstov et al., 2022)",
    "taylor2": "deterministic second-order Taylor kernel 1 + t + t^2/2",
    "poly2": "deterministic second-order polynomial kernel (1 + t/2)^2",
    "relu": "generalized attention with ReLU features",
    "elu": "elu + 1 features",
    "exact": "exact softmax attention (no approximation)",
}


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


def _hybrid_lines(config) -> list[str]:
    """The hybrid-attention settings as card bullet points."""
    routed = (
        f"{config.routed_blocks} blocks of {config.route_block_size} keys per block of {config.query_block_size} "
        "queries, chosen by the mean logit between the blocks (bidirectional only)"
        if config.routed_blocks
        else "none"
    )
    if isinstance(config.far_field_parameter, list):
        parameter = "calibrated per layer and head at conversion"
    elif config.far_field_parameter is not None:
        parameter = f"{config.far_field_parameter}"
    else:
        parameter = "closed-form optimum from each sequence's statistics"
    lines = [
        f"- exact local window: {config.local_window} tokens" if config.local_window else "- exact local window: none",
        f"- global tokens (exact for every query): {config.num_global_tokens}",
        f"- routed exact key blocks: {routed}",
        "- centred queries and keys before the far field: "
        + (
            "yes (per-sequence means bidirectionally; fixed per-layer centres, calibrated at conversion, when causal)"
            if config.center_features
            else "no"
        ),  # fmt: skip
    ]
    if config.attention_kernel == "softmax_opt":
        lines.append(f"- FAVOR++ parameter A: {parameter}")
    return lines


def build_model_card(
    *,
    base_model: str,
    license_name: str,
    source_architecture: str,
    target_class: str,
    config,
    pretrained_positions: int,
    dropped: dict[str, str],
    report: FidelityReport | None,
    sentence_pipeline: bool = False,
) -> ModelCard:
    """A model card whose metadata names the base model, license, library and tags, and whose text
    states the FAVOR+ settings and the fidelity measured at conversion; ``sentence_pipeline``: the
    folder carries the source's sentence-transformers pipeline (tagged, with its usage)."""
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
    hybrid = config.uses_hybrid_attention
    method = (
        "hybrid attention: exact softmax on a sparse support per query (local window, global tokens, routed key "
        "blocks) and a linear-time far-field kernel for every other key, sharing one normaliser"
        if hybrid
        else "FAVOR+ linear attention (Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021)"
    )
    lines = [
        f"# Performer conversion of {base_model}",
        "",
        f"This checkpoint is [{base_model}](https://huggingface.co/{base_model}) ({source_architecture}) converted "
        f"to a `{target_class}` by performer-hf: every pretrained "
        f"weight is kept and softmax attention is replaced by {method}. It has **not** been finetuned after the swap.",
        "",
        "## Attention settings",
        "",
        f"- attention kernel{' (far field)' if hybrid else ''}: `{config.attention_kernel}` "
        f"({_KERNEL_NAMES.get(config.attention_kernel, '')})",
        f"- nb_features (random features per head): {config.nb_features}"
        + (" (unused by this deterministic kernel)" if config.attention_kernel in ("taylor2", "poly2") else ""),
        f"- feature coupling: {coupling}, row norms `{config.feature_row_norms}`, seed {config.projection_seed}",
        f"- redraw policy: {redraw}",
    ]
    if hybrid:
        lines += _hybrid_lines(config)
    lines += [
        f"- causal: {'yes' if config.is_decoder or target_class == 'PerformerForCausalLM' else 'no'}",
        f"- positions: {positions} (pretrained: {pretrained_positions}"
        + (", extended by tiling the pretrained table)" if positions > pretrained_positions else ")"),
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
        lines += [
            f"Measured on {report.num_sequences} sequences ({report.num_tokens} tokens) of {report.text}, "
            f"against {base_model} and against the same weights with exact softmax attention.",
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
