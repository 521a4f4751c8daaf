"""The model card (README.md) written next to a trained model."""

from __future__ import annotations

import json
import os

from huggingface_hub import ModelCard, ModelCardData

TASK_PIPELINES = {"mlm": "fill-mask", "clm": "text-generation", "classification": "text-classification"}
TASK_NAMES = {"mlm": "masked language modeling", "clm": "causal language modeling", "classification": "classification"}

FAVOR_FIELDS = ("attention_kernel", "nb_features", "feature_coupling", "feature_row_norms", "feature_redraw_interval")


def build_model_card(task: str, config, base_model: str | None, data_source: str, metrics: dict, args: dict) -> str:
    """Markdown with YAML metadata: base model, FAVOR+ settings, training setup, final metrics."""
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag=TASK_PIPELINES[task],
        tags=["performer", "favor+", "linear-attention"],
        base_model=base_model if base_model and not os.path.isdir(base_model) else None,
    )
    favor = {field: getattr(config, field, None) for field in FAVOR_FIELDS}
    architecture = {
        "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
        "heads": config.num_attention_heads, "max_position_embeddings": config.max_position_embeddings,
    }  # fmt: skip
    setup = {key: args.get(key) for key in ("max_seq_length", "learning_rate", "per_device_train_batch_size",
                                           "gradient_accumulation_steps", "max_train_steps", "max_grad_norm",
                                           "seed")}  # fmt: skip
    lines = [
        "---",
        card_data.to_yaml(),
        "---",
        "",
        f"# Performer for {TASK_NAMES[task]}",
        "",
        "A Performer (FAVOR+ linear attention, Choromanski et al., 2021) trained with "
        f"`training/run_{task}.py` of performer-hf.",
        "",
        f"- Started from: {base_model or 'random initialisation'}",
        f"- Data: {data_source}",
        "",
        "## FAVOR+ settings",
        "",
        "```json",
        json.dumps(favor, indent=2),
        "```",
        "",
        "## Architecture",
        "",
        "```json",
        json.dumps(architecture, indent=2),
        "```",
        "",
        "## Training",
        "",
        "```json",
        json.dumps(setup, indent=2, default=str),
        "```",
        "",
        "## Evaluation (validation set, end of training)",
        "",
        "| metric | value |",
        "|---|---|",
        *(f"| {name} | {value:.4g} |" if isinstance(value, float) else f"| {name} | {value} |"
          for name, value in metrics.items()),
        "",
        "Load it with `import performer_hf` and the matching `AutoModelFor...` class.",
        "",
    ]  # fmt: skip
    return ModelCard("\n".join(lines)).content


def write_model_card(output_dir: str, content: str) -> str:
    path = os.path.join(output_dir, "README.md")
    with open(path, "w") as handle:
        handle.write(content)
    return path
