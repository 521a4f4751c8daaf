"""The model card (README.md) written next to a trained model.

A model trained from a converted checkpoint keeps the ``base_model`` and ``license`` that the
converter's card (``performer_hf.conversion.model_card``) recorded, so the lineage survives
finetuning; the text describes the training run and its final evaluation.
"""

from __future__ import annotations

import json
import logging
import math
import os

from huggingface_hub import ModelCard, ModelCardData

from ..attention_card import method_description, method_lines, states_kernel, uses_projection
from ..conversion.in_place import IN_PLACE_ARCHITECTURES
from ..modeling.attention_settings import IMPLEMENTATIONS, head_shape, method_config
from ..modeling.configuration_performer import PerformerConfig

logger = logging.getLogger(__name__)

TASK_PIPELINES = {"mlm": "fill-mask", "clm": "text-generation", "classification": "text-classification"}
TASK_AUTO_CLASSES = {
    "mlm": "AutoModelForMaskedLM",
    "clm": "AutoModelForCausalLM",
    "classification": "AutoModelForSequenceClassification",
}
TASK_NAMES = {"mlm": "masked language modeling", "clm": "causal language modeling", "classification": "classification"}

# the random projection's settings: stated only for a kernel that reads it (attention_card.uses_projection)
PROJECTION_FIELDS = ("nb_features", "feature_coupling", "feature_row_norms", "feature_redraw_interval")
SETUP_FIELDS = (
    "max_seq_length",
    "learning_rate",
    "lr_scheduler_type",
    "num_warmup_steps",
    "per_device_train_batch_size",
    "num_processes",
    "gradient_accumulation_steps",
    "max_grad_norm",
    "weight_decay",
    "seed",
)


def starting_card_metadata(folder: str | None) -> dict:
    """``base_model`` and ``license`` from the README.md card of the checkpoint training started from."""
    card_path = os.path.join(folder, "README.md") if folder else None
    if not card_path or not os.path.isfile(card_path):
        return {}
    try:
        data = ModelCard.load(card_path).data
    except Exception as error:  # a malformed card of the starting point must not fail a finished run
        logger.warning("Could not read the model card %s (%s); not inheriting its metadata.", card_path, error)
        return {}
    return {key: getattr(data, key, None) for key in ("base_model", "license") if getattr(data, key, None)}


def _redraw_sentence(interval: int | None) -> str:
    """What happened to the random features during training (the checkpoint keeps them fixed)."""
    done = (
        "The random features were never redrawn during training"
        if not interval
        else f"The random features were redrawn every {interval} optimizer steps during training (seeded from the step)"
    )
    return f"{done}; they are fixed in this checkpoint, so inference is deterministic."


def _attention_section(config: PerformerConfig) -> list[str]:
    """The card's "Attention settings" lines of a Performer: the method, its kernel where it reads one (as the
    conversion card, not for the sparse method) and the random features and their redraws where the kernel uses
    them (not a deterministic kernel, nor exact or sparse attention)."""
    settings = {"attention_method": config.attention_method}
    if states_kernel(config):
        settings["attention_kernel"] = config.attention_kernel
    projection = uses_projection(config)
    if projection:
        settings.update({field: getattr(config, field, None) for field in PROJECTION_FIELDS})
    return [
        "## Attention settings",
        "",
        "```json",
        json.dumps(settings, indent=2),
        "```",
        "",
        *(lines + [""] if (lines := method_lines(config)) else []),
        *([_redraw_sentence(config.feature_redraw_interval), ""] if projection else []),
    ]


def _in_place_method(config, task: str) -> PerformerConfig | None:
    """The attention settings of a transformers model loaded with a Performer ``attn_implementation`` (a decoder
    converted in place, causal whatever its head; or an encoder), as a ``PerformerConfig``; None for a model with its
    own attention."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in IMPLEMENTATIONS:
        return None
    text_config = config.get_text_config()
    decoders = {row.model_type for row in IN_PLACE_ARCHITECTURES.values()}
    causal = task == "clm" or text_config.model_type in decoders
    return method_config(text_config, implementation, causal, *head_shape(text_config))


def _merge_lines(task: str, config, method) -> list[str]:
    """The Usage block's (commented) lines that save the adapted model as one model without peft. A decoder converted
    in place (its source's causal-LM class with a Performer ``attn_implementation``: ``method``) is passed to
    ``performer_hf.ship_remote_code`` first, without which the saved copy reloads with softmax attention (transformers
    does not save the implementation a model was loaded with); a Performer-family model records its attention and
    ships its code by itself."""
    decoders = {row.model_type for row in IN_PLACE_ARCHITECTURES.values()}
    if (
        method is not None
        and not isinstance(config, PerformerConfig)
        and task == "clm"
        and config.model_type in decoders
    ):
        return [
            "# one model without peft (ship_remote_code keeps its Performer attention in the saved copy):",
            "# merged = model.merge_and_unload(); performer_hf.ship_remote_code(merged); "
            'merged.save_pretrained("path/to/merged")',
        ]
    return ["# one model without peft:", '# model.merge_and_unload().save_pretrained("path/to/merged")']


def _adapter_section(task: str, config, adapter: dict, method) -> list[str]:
    """The card's "LoRA adapter" and "Usage" lines: the adapter's settings, the base it goes on, and the snippet that
    restores the trained model (the folder holds the adapter, not a model that loads alone) and merges it."""
    auto = TASK_AUTO_CLASSES[task]
    labels = f", num_labels={config.num_labels}" if task == "classification" else ""
    settings = {
        key: adapter.get(key) for key in ("r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save")
    }
    return [
        "## LoRA adapter",
        "",
        f"This folder holds a LoRA adapter (peft), not a whole model: it goes on the base model `{adapter['base']}`, "
        "which was frozen during training"
        + (
            ", but for the modules under `modules_to_save`, trained and saved here."
            if adapter.get("modules_to_save")
            else "."
        ),
        "",
        "```json",
        json.dumps(settings, indent=2, default=sorted),
        "```",
        "",
        "## Usage",
        "",
        "```python",
        *(["import performer_hf  # registers the Performer classes and attention with transformers"] if method else []),
        "from peft import PeftModel",
        f"from transformers import {auto}",
        "",
        f'base = {auto}.from_pretrained("{adapter["base"]}"{labels})',
        'model = PeftModel.from_pretrained(base, "path/to/this/folder")',
        *_merge_lines(task, config, method),
        "```",
        "",
    ]


def _usage_section(task: str, method) -> list[str]:
    """The card's "Usage" lines of a whole model, loaded with the task's Auto class (AutoModel would drop the trained
    head)."""
    auto = TASK_AUTO_CLASSES[task]
    return [
        "## Usage",
        "",
        "```python",
        *(["import performer_hf  # registers the Performer classes and attention with transformers"] if method else []),
        f"from transformers import {auto}",
        "",
        f'model = {auto}.from_pretrained("path/to/this/folder")',
        *(
            [f'# without performer-hf: {auto}.from_pretrained("path/to/this/folder", trust_remote_code=True)']
            if method
            else []
        ),
        "```",
        "",
    ]


def build_model_card(
    task: str,
    config,
    started_from: str | None,
    data_source: str,
    metrics: dict,
    args: dict,
    starting_folder: str | None = None,
    adapter: dict | None = None,
) -> str:
    """Markdown with YAML metadata: lineage, FAVOR+ settings, architecture, training setup, final metrics. A model
    that is not a Performer (a baseline the scripts also train, e.g. BigBird) gets the same card without the
    attention settings.

    ``started_from`` names the checkpoint (or source converted) training began with (None: from
    scratch); ``starting_folder`` is where it was loaded from, whose card metadata is inherited. ``adapter`` (a LoRA
    run: its ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ``modules_to_save`` and ``base``, the
    folder or Hub id of the base it goes on) makes it the card of an adapter (peft).
    """
    performer = isinstance(config, PerformerConfig)
    method = config if performer else _in_place_method(config, task)  # its attention settings
    inherited = starting_card_metadata(starting_folder)
    hub_id = started_from if started_from and not os.path.isdir(started_from) else None
    card_data = ModelCardData(
        library_name="peft" if adapter else "transformers",
        pipeline_tag=TASK_PIPELINES[task],
        tags=["performer", "favor+", "linear-attention", "performer-hf"] if method else ["performer-hf"],
        base_model=inherited.get("base_model") or hub_id,
        license=inherited.get("license"),
    )
    architecture = {
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "max_position_embeddings": config.max_position_embeddings,
    }
    if performer:
        architecture["layer_norm_position"] = config.layer_norm_position
    setup = {key: args.get(key) for key in SETUP_FIELDS}
    factors = [setup[key] for key in ("per_device_train_batch_size", "num_processes", "gradient_accumulation_steps")]
    if all(isinstance(factor, int) for factor in factors):  # what one optimizer step trains on
        setup["total_train_batch_size"] = math.prod(factors)
    setup["optimizer_steps"] = metrics.get("train_steps")
    rows = [
        f"| {name} | {value:.4g} |" if isinstance(value, float) else f"| {name} | {value} |"
        for name, value in metrics.items()
        if name.startswith("eval_")
    ]
    lines = [
        "---",
        card_data.to_yaml(),
        "---",
        "",
        f"# {'Performer' if performer else type(config).__name__.removesuffix('Config')} for {TASK_NAMES[task]}",
        "",
        (
            f"A Performer with {method_description(config)}"
            if performer
            else f"A transformers `{config.model_type}` model with Performer attention "
            f"(`attn_implementation={config._attn_implementation!r}`): {method_description(method)}"
            if method
            else f"A transformers `{config.model_type}` model (its own attention; no Performer attention)"
        )
        + f", trained with `training/run_{task}.py` of performer-hf"
        + (" as a LoRA adapter." if adapter else "."),
        "",
        f"- started from: {started_from or 'random initialisation (trained from scratch)'}",
        f"- training data: {data_source}",
        "",
        *(_attention_section(method) if method else []),
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
        *rows,
        "",
        *(_adapter_section(task, config, adapter, method) if adapter else _usage_section(task, method)),
    ]
    return ModelCard("\n".join(lines)).content


def write_model_card(output_dir: str, content: str) -> str:
    path = os.path.join(output_dir, "README.md")
    with open(path, "w") as handle:
        handle.write(content)
    return path
