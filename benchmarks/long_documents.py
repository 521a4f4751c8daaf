"""Long documents: converted Performer vs BigBird vs truncation vs exact attention, at equal budget (issue 16).

Task (real text, offline): each document is ``--length`` tokens of Python's documentation prose
(``pydoc_data.topics``, shipped with CPython) with one passage of ``--evidence-tokens`` tokens of real BBC News
articles of a single topic (Greene & Cunningham 2006, ``performer_hf.data_assets.bbc_news``; each article's
first ``ARTICLE_TOKENS`` tokens) placed at a random token offset; the label is the topic (5 classes, chance
20%). Only the passage says anything about the label, so a model reads it or guesses: accuracy by the passage's
offset shows what truncation loses. (With one 400-token article in 4,096 tokens, no arm learned within a CPU
budget: 160 steps left the default conversion at chance.) Training documents take their articles from the BBC
train split and their prose from the first half of the documentation; validation and test documents from the
validation / test splits and the second half. Training offsets are uniform; test offsets are stratified, the
same number of documents in each bin of ``BINS`` that fits.

Arms, all from the same pretrained weights (sentence-transformers/all-MiniLM-L6-v2), trained with the same
loop (``training/run_classification.py``: AdamW, linear schedule, the same documents in the same order,
the same steps, batch and learning rate), evaluated on the same test documents:

    softmax-512    exact softmax attention (``attention_kernel="exact"``, which reproduces HF BertModel),
                   inputs truncated to the pretrained 512 positions: what a user of MiniLM does
    softmax-full   exact softmax attention at full length, the position table tiled
                   (``max_position_embeddings``), SDPA: the quality ceiling, quadratic in time and memory
    bigbird        HF ``BigBirdForSequenceClassification`` (``block_sparse``, block 64, 3 random blocks)
                   warm-started from the same weights at full length, as the BigBird paper warm-starts
                   from RoBERTa (:func:`bigbird_from_minilm` lists what is mapped and what is new)
    performer      the converted Performer, the converter's default (hybrid) settings
    favor          the converted Performer, plain FAVOR+ (positive orthogonal random features, m = 256)

Reported per arm and seed: test accuracy and macro-F1 (overall, and on the documents whose passage starts
at or after token 512, beyond what truncation keeps), their standard errors (binomial for accuracy,
bootstrap for F1), accuracy by the passage's offset, training wall time. Apart, each arm's cost of one
training step (forward, backward, AdamW; batch 1) and one forward at each of ``--probe-lengths``, with the
peak extra resident memory, each in a fresh process (an earlier run's freed heap would hide in its
figures); a length that does not fit ``--memory-cap-gb`` is reported as such.

Writes long_documents.{json,md,png} to --out-dir.

    python benchmarks/long_documents.py                                  # 4,096 tokens; hours on 2 cores
    python benchmarks/long_documents.py --quick --out-dir /tmp/long      # smoke test, under a minute
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import harness
import torch
from compat_sentiment import convert_quietly, eval_curve, minilm_folder, plain_favor, run_classifier
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from performer_hf.conversion.mapping import extend_positions
from performer_hf.conversion.source import load_weights
from performer_hf.cpu_memory import retain_freed_memory
from performer_hf.data_assets import BBC_LABELS, bbc_news, write_jsonl

logger = logging.getLogger("benchmarks.long_documents")

ARTICLE_TOKENS = 400  # tokens of each article kept (its headline and opening: the topic is plain there)
BINS = (0, 512, 1024, 2048, 4096, 8192, 16384)  # article-offset bins of the test documents (clipped to the length)
TRUNCATED = 512

# No arm drops attention weights: the Performer's linear attention cannot, BigBird's block-sparse attention
# does not, and exact attention then runs SDPA's fused kernel (with dropout it materialises L x L per head).
EXACT = {"attention_kernel": "exact", "attention_probs_dropout_prob": 0.0}
# name -> (label, converter overrides; None: BigBird); the full-length arms add the length to the overrides
ARMS = {
    "softmax-512": ("softmax MiniLM, truncated to 512", EXACT),
    "softmax-full": ("softmax MiniLM, positions extended, full length", EXACT),
    "bigbird": ("BigBird (block_sparse) warm-started from MiniLM, full length", None),
    "performer": ("converted Performer, default conversion, full length", {}),
    "favor": ("converted Performer, plain FAVOR+ (m=256), full length", plain_favor()),
}


# ---- the documents ---------------------------------------------------------------------------------


def prose_ids(tokenizer, half: int) -> list[int]:
    """Token ids of one half (0 or 1) of Python's documentation prose, whitespace collapsed."""
    from pydoc_data.topics import topics

    text = re.sub(r"\s+", " ", " ".join(topics[name] for name in sorted(topics)))
    middle = len(text) // 2
    part = text[:middle] if half == 0 else text[middle:]
    return tokenizer(part, add_special_tokens=False, verbose=False)["input_ids"]


def _offsets(count: int, length: int, article: int, rng: random.Random, stratified: bool) -> list[int]:
    """Token offsets (after [CLS]) of the article in ``count`` documents: uniform, or the same number in each
    bin of ``BINS`` that fits (``article`` tokens long, in ``length - 2`` body tokens)."""
    last = length - 2 - article
    if not stratified:
        return [rng.randint(0, last) for _ in range(count)]
    bins = [(lo, min(hi, last + 1)) for lo, hi in zip(BINS, BINS[1:], strict=False) if lo <= last]
    return [rng.randrange(*bins[i % len(bins)]) for i in range(count)]


def documents(
    tokenizer,
    articles: list[dict],
    prose: list[int],
    count: int,
    length: int,
    evidence: int,
    seed: int,
    stratified: bool,
) -> list[dict]:
    """``count`` documents of ``length`` tokens: ``{"text", "label", "offset", "articles"}``.

    Each holds one passage of ``evidence`` tokens made of articles of one topic (the label, drawn uniformly; each
    article's first ``ARTICLE_TOKENS`` tokens, in a random order) at the token position ``offset`` of the
    tokenized document ([CLS] is position 0), the rest Python documentation prose."""
    rng = random.Random(seed)
    encoded = tokenizer([a["text"] for a in articles], add_special_tokens=False, verbose=False)["input_ids"]
    by_topic = defaultdict(list)  # label -> [(article id, its first ARTICLE_TOKENS token ids)]
    for article, ids in zip(articles, encoded, strict=True):
        by_topic[article["label"]].append((article["id"], ids[:ARTICLE_TOKENS]))
    records = []
    for offset in _offsets(count, length, evidence, rng, stratified):
        label = rng.randrange(len(BBC_LABELS))
        passage, used = [], []
        for article_id, ids in rng.sample(by_topic[label], len(by_topic[label])):
            if len(passage) >= evidence:
                break
            passage += ids
            used.append(article_id)
        passage = passage[:evidence]
        body = length - 2 - len(passage)  # prose tokens around the passage
        start = rng.randrange(len(prose) - body - 16)
        before, after = prose[start : start + offset], prose[start + offset : start + body + 16]  # a margin to cut
        prefix = tokenizer.decode(before)
        text = " ".join(part for part in (prefix, tokenizer.decode(passage), tokenizer.decode(after)) if part)
        real_offset = 1 + len(tokenizer(prefix, add_special_tokens=False, verbose=False)["input_ids"])
        records.append({"text": text, "label": label, "offset": real_offset, "articles": used})
    return records


# ---- BigBird warm start -------------------------------------------------------------------------------


def bigbird_from_minilm(source: Path, target: Path, length: int, num_labels: int, seed: int) -> dict:
    """A ``BigBirdForSequenceClassification`` of MiniLM's shape at ``length`` positions, MiniLM's weights in
    it, saved with MiniLM's tokenizer to ``target``; returns which weights were mapped and which are new.

    BigBird's encoder is BERT's (same embeddings, layers and names under ``bert.``); its position table is
    MiniLM's tiled (:func:`extend_positions`, as the converter and the BigBird paper do). Its classification
    head reads the [CLS] state through ``dense`` + tanh + ``out_proj``: BERT's pooler (``pooler.dense``)
    becomes ``classifier.dense``, so the head starts where BERT's pooler + classifier start; ``out_proj`` is
    new, as BERT's classifier is. BigBird's own ``bert.pooler`` (unused by this head) also takes it.
    """
    from transformers import BertConfig, BigBirdConfig, BigBirdForSequenceClassification

    bert = BertConfig.from_pretrained(source)
    config = BigBirdConfig(
        vocab_size=bert.vocab_size,
        hidden_size=bert.hidden_size,
        num_hidden_layers=bert.num_hidden_layers,
        num_attention_heads=bert.num_attention_heads,
        intermediate_size=bert.intermediate_size,
        hidden_act=bert.hidden_act,
        hidden_dropout_prob=bert.hidden_dropout_prob,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=length,
        type_vocab_size=bert.type_vocab_size,
        layer_norm_eps=bert.layer_norm_eps,
        pad_token_id=bert.pad_token_id,
        attention_type="block_sparse",
        block_size=64,
        num_random_blocks=3,
        num_labels=num_labels,
    )
    torch.manual_seed(seed)
    model = BigBirdForSequenceClassification(config)
    state = {}
    for name, tensor in load_weights(source).items():
        name = name.removeprefix("bert.")
        if name == "embeddings.position_embeddings.weight":
            tensor = extend_positions(tensor, length, offset=0)
        if name.startswith("pooler.dense."):
            state["classifier.dense." + name.rsplit(".", 1)[1]] = tensor
            state["bert.pooler." + name.rsplit(".", 1)[1]] = tensor
        elif not name.endswith(("position_ids", "token_type_ids")):
            state["bert." + name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise RuntimeError(f"MiniLM weights BigBird has no place for: {unexpected}")
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source, model_max_length=length).save_pretrained(target)
    return {"mapped": sorted(state), "new": sorted(missing)}


def build_arm(arm: str, source: Path, folder: Path, length: int, seed: int) -> dict:
    """The arm's model folder and what it is: ``{"folder", "max_length", "attention" or "warm_start"}``."""
    overrides = ARMS[arm][1]
    max_length = TRUNCATED if arm == "softmax-512" else length
    if overrides is None:
        warm_start = bigbird_from_minilm(source, folder, length, len(BBC_LABELS), seed)
        return {"folder": folder, "max_length": max_length, "warm_start": warm_start}
    if max_length > TRUNCATED:
        overrides = {**overrides, "max_position_embeddings": length}
    folder, attention, _ = convert_quietly(source, folder, overrides)
    return {"folder": folder, "max_length": max_length, "attention": attention}


# ---- evaluation -----------------------------------------------------------------------------------


@torch.no_grad()
def predict(folder: Path, records: list[dict], max_length: int) -> tuple[list[int], float]:
    """The classifier's predicted label of each record (one at a time: no padding) and the seconds it took."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    predictions = []
    start = time.perf_counter()
    for record in tqdm(records, desc=f"test {folder.name}", leave=False):
        batch = tokenizer(record["text"], truncation=True, max_length=max_length, return_tensors="pt")
        predictions.append(int(model(**batch).logits.argmax(-1)))
    return predictions, time.perf_counter() - start


def macro_f1(labels: list[int], predictions: list[int]) -> float:
    scores = []
    for c in range(len(BBC_LABELS)):
        tp = sum(p == c and y == c for y, p in zip(labels, predictions, strict=True))
        fp = sum(p == c and y != c for y, p in zip(labels, predictions, strict=True))
        fn = sum(p != c and y == c for y, p in zip(labels, predictions, strict=True))
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return sum(scores) / len(scores)


def scores(labels: list[int], predictions: list[int], seed: int = 0, draws: int = 500) -> dict:
    """Accuracy and macro-F1 with standard errors (accuracy: binomial; F1: bootstrap over documents)."""
    n = len(labels)
    if not n:
        return {"n": 0}
    accuracy = sum(y == p for y, p in zip(labels, predictions, strict=True)) / n
    rng = random.Random(seed)
    boot = []
    for _ in range(draws):
        picks = [rng.randrange(n) for _ in range(n)]
        boot.append(macro_f1([labels[i] for i in picks], [predictions[i] for i in picks]))
    return {
        "n": n,
        "accuracy": accuracy,
        "accuracy_se": math.sqrt(accuracy * (1 - accuracy) / n),
        "f1": macro_f1(labels, predictions),
        "f1_se": statistics.stdev(boot),
    }


def evaluation(records: list[dict], predictions: list[int], length: int) -> dict:
    """Scores overall, beyond the truncation (article from token 512 on) and per offset bin."""
    labels = [r["label"] for r in records]

    def subset(keep):
        chosen = [i for i, r in enumerate(records) if keep(r["offset"])]
        return scores([labels[i] for i in chosen], [predictions[i] for i in chosen])

    bins = [(lo, min(hi, length)) for lo, hi in zip(BINS, BINS[1:], strict=False) if lo < length]
    return {
        "all": scores(labels, predictions),
        "beyond_512": subset(lambda offset: offset >= TRUNCATED),
        "by_offset": [{"from": lo, "to": hi, **subset(lambda o, lo=lo, hi=hi: lo <= o < hi)} for lo, hi in bins],
    }


# ---- cost per step --------------------------------------------------------------------------------


def probe(folder: Path, length: int) -> dict:
    """One training step (forward, backward, AdamW) and one no-grad forward of the classifier in ``folder`` at
    ``length`` tokens (batch 1, random ids): seconds and peak extra resident memory, in this process."""
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    ids = torch.randint(1000, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    model.eval()
    with harness.PeakMemory() as forward_memory, torch.no_grad():
        start = time.perf_counter()
        model(**batch)
        forward_seconds = time.perf_counter() - start
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    times = []
    with harness.PeakMemory() as train_memory:
        for _ in range(2):  # the first step also creates the optimizer's state
            start = time.perf_counter()
            model(**batch, labels=torch.zeros(1, dtype=torch.long)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    return {
        "train_step_seconds": times[-1],
        "train_step_peak_bytes": train_memory.extra,
        "forward_seconds": forward_seconds,
        "forward_peak_bytes": forward_memory.extra,
    }


def probe_child(folder: str, length: int, threads: int) -> dict:
    """:func:`probe` in the fresh process that :func:`cost` starts, with freed memory retained as the training
    scripts retain it; a failed allocation is an answer."""
    torch.set_num_threads(threads)
    retain_freed_memory()
    try:
        return {"ok": True, **probe(Path(folder), length)}
    except (MemoryError, RuntimeError) as error:  # RuntimeError: torch's "can't allocate memory"
        if "alloc" not in str(error).lower() and not isinstance(error, MemoryError):
            raise
        return {"ok": False, "error": "out of memory"}


def cost(folder: Path, length: int, memory_cap_gb: float) -> dict:
    """:func:`probe` in a new Python process under an address-space cap."""
    return harness.in_fresh_process(
        __file__, memory_cap_gb=memory_cap_gb, folder=str(folder), length=length, threads=torch.get_num_threads()
    )


# ---- the study ------------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict:
    """Build the documents and every arm; probe the cost per step; train, test; per arm and seed."""
    source = minilm_folder()
    tokenizer = AutoTokenizer.from_pretrained(source)
    splits = bbc_news(seed=args.data_seed)
    prose = {half: prose_ids(tokenizer, half) for half in (0, 1)}
    plan = {
        "train": (0, args.train_docs, 1, False),
        "validation": (1, args.validation_docs, 2, True),
        "test": (1, args.test_docs, 3, True),
    }  # split -> (prose half, documents, seed, stratified offsets)
    data = {
        name: documents(
            tokenizer, splits[name], prose[half], count, args.length, args.evidence_tokens, seed, stratified
        )
        for name, (half, count, seed, stratified) in plan.items()
    }
    result = {
        "study": "long_documents",
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "length": args.length,
        "task": f"a passage of {args.evidence_tokens} tokens of BBC News articles of one topic (each article's first "
        f"{ARTICLE_TOKENS} tokens) at a random offset in {args.length} tokens of Python documentation prose; "
        "label: the topic (5 classes)",
        "data": {name: len(records) for name, records in data.items()},
        "test_offsets": [r["offset"] for r in data["test"]],
        "budget": {
            "steps": args.train_docs // args.batch_size,
            "batch_size": args.batch_size,
            "learning_rate": args.lr,
            "warmup_steps": args.warmup,
            "weight_decay": 0.01,
            "seeds": args.seeds,
        },
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "probe_lengths": args.probe_lengths,
        "memory_cap_gb": args.memory_cap_gb,
        "arms": {},
    }
    with tempfile.TemporaryDirectory(prefix="long_documents-") as scratch:
        work = Path(scratch)
        files = {name: write_jsonl(records, work / f"{name}.jsonl") for name, records in data.items()}
        for arm in tqdm(args.arms, desc="long_documents arms"):
            built = build_arm(arm, source, work / f"model-{arm}", max([args.length, *args.probe_lengths]), 0)
            entry = result["arms"][arm] = {
                "label": ARMS[arm][0],
                "max_length": min(built["max_length"], args.length),
                **{k: v for k, v in built.items() if k not in ("folder", "max_length")},
                "cost": {},
                "runs": [],
            }
            for length in args.probe_lengths:
                # a quick run probes its first arm alone: each probe is a fresh process (7 s, its imports mostly)
                if length > built["max_length"] or (args.quick and arm != args.arms[0]):
                    continue
                entry["cost"][str(length)] = cost(built["folder"], length, args.memory_cap_gb)
                logger.info("%s cost at %d: %s", arm, length, entry["cost"][str(length)])
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                argv = [
                    "--train_file",
                    str(files["train"]),
                    "--validation_file",
                    str(files["validation"]),
                    "--model_name_or_path",
                    str(built["folder"]),
                    "--max_seq_length",
                    str(entry["max_length"]),
                    "--per_device_train_batch_size",
                    str(args.batch_size),
                    "--per_device_eval_batch_size",
                    "1",
                    "--learning_rate",
                    str(args.lr),
                    "--weight_decay",
                    "0.01",
                    "--num_train_epochs",
                    "1",
                    "--num_warmup_steps",
                    str(args.warmup),
                    "--seed",
                    str(seed),
                    *(["--max_train_steps", "2"] if args.quick else []),
                ]
                output = work / f"run-{arm}-{seed}"
                metrics, log, seconds = run_classifier(argv, output)
                predictions, test_seconds = predict(output, data["test"], entry["max_length"])
                run = {
                    "seed": seed,
                    "train_seconds": seconds,
                    "train_steps": metrics["train_steps"],
                    "test_seconds": test_seconds,
                    "validation_curve": eval_curve(log),
                    "predictions": predictions,
                    **evaluation(data["test"], predictions, args.length),
                }
                entry["runs"].append(run)
                beyond = run["beyond_512"].get("accuracy", float("nan"))
                logger.info(
                    "%s seed %d: accuracy %.3f (beyond 512: %.3f), train %.0f s",
                    arm,
                    seed,
                    run["all"]["accuracy"],
                    beyond,
                    seconds,
                )
                shutil.rmtree(output)
    return merged(result, args.merge_with) if args.merge_with else result


# the settings two runs must share for their seeds to be pooled
POOLED = ("length", "task", "data", "test_offsets", "budget_steps", "batch_size", "learning_rate", "warmup_steps")


def _settings(result: dict) -> dict:
    budget = result["budget"]
    return {
        **{k: result[k] for k in ("length", "task", "data", "test_offsets")},
        "budget_steps": budget["steps"],
        **{k: budget[k] for k in ("batch_size", "learning_rate", "warmup_steps")},
    }


def merged(result: dict, earlier_file: Path) -> dict:
    """``result`` with the runs (seeds) of the earlier results in ``earlier_file`` added to each arm's, when both
    used the same documents and budget; arms or cost probes only the earlier run has are kept."""
    earlier = json.loads(earlier_file.read_text())
    mismatched = [k for k in POOLED if _settings(earlier)[k] != _settings(result)[k]]
    if mismatched:
        raise ValueError(f"{earlier_file} used other settings ({', '.join(mismatched)}); its seeds cannot be pooled.")
    for arm, old in earlier["arms"].items():
        entry = result["arms"].setdefault(arm, {**old, "runs": []})
        seeds = {run["seed"] for run in entry["runs"]}
        entry["runs"] = [run for run in old["runs"] if run["seed"] not in seeds] + entry["runs"]
        entry["cost"] = {**old.get("cost", {}), **entry.get("cost", {})}
    result["budget"]["seeds"] = max(len(entry["runs"]) for entry in result["arms"].values())
    return result


# ---- report ---------------------------------------------------------------------------------------


def _mean_se(runs: list[dict], part: str, metric: str) -> tuple[float, float]:
    """Mean over seeds and its standard error: the per-run standard error for one seed, else across seeds."""
    values = [r[part][metric] for r in runs if r[part].get("n")]
    if not values:
        return float("nan"), float("nan")
    if len(values) == 1:
        return values[0], runs[0][part][f"{metric}_se"]
    return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values))


def _cell(runs, part, metric) -> str:
    mean, se = _mean_se(runs, part, metric)
    return "-" if math.isnan(mean) else f"{100 * mean:.1f} ± {100 * se:.1f}"


def _cost_cell(record: dict | None, key: str) -> str:
    if record is None:
        return "-"
    if not record.get("ok", True):
        return record.get("error", "failed")
    return f"{record[key + '_seconds']:.2f} s / {record[key + '_peak_bytes'] / 2**20:.0f} MB"


def markdown(result: dict) -> str:
    environment = harness.environment(result)
    machine, load = environment["machine"], environment["load_average"]
    budget, arms = result["budget"], result["arms"]
    lines = [
        f"# Long documents: Performer vs BigBird vs truncation vs exact attention ({result['length']} tokens)",
        "",
        f"Task: {result['task']}. Documents: {result['data']['train']} train, {result['data']['validation']} "
        f"validation, {result['data']['test']} test (passage offsets stratified). Every arm starts from "
        f"{result['model']} and trains {budget['steps']} steps of batch {budget['batch_size']} (learning rate "
        f"{budget['learning_rate']}, {budget['warmup_steps']} warm-up steps, AdamW, linear schedule), "
        f"{budget['seeds']} seed(s). {machine.get('cpu', '?')}, {machine['torch_threads']} threads; torch "
        f"{machine['torch']}, transformers {machine.get('transformers', '?')}. Load average {load['before']} -> "
        f"{load['after']}." + (" **Quick run: the figures say nothing.**" if result["quick"] else ""),
        "",
        "## Test scores (%, ± standard error: across seeds when there are several, else binomial / bootstrap)",
        "",
        "| arm | reads | accuracy | macro-F1 | accuracy, passage beyond 512 | macro-F1, beyond 512 | train (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in arms.values():
        runs = entry["runs"]
        train = statistics.mean(r["train_seconds"] for r in runs) if runs else float("nan")
        cells = [_cell(runs, part, metric) for part in ("all", "beyond_512") for metric in ("accuracy", "f1")]
        lines.append(f"| {entry['label']} | {entry['max_length']} | " + " | ".join(cells) + f" | {train:.0f} |")
    first = next((entry for entry in arms.values() if entry["runs"]), None)
    if first is not None:
        bins = first["runs"][0]["by_offset"]
        lines += [
            "",
            "## Accuracy by the passage's offset (%)",
            "",
            "| arm | " + " | ".join(f"{b['from']}-{b['to']} (n={b['n']})" for b in bins) + " |",
            "|---|" + "---|" * len(bins),
        ]
        for entry in arms.values():
            cells = []
            for i in range(len(bins)):
                values = [r["by_offset"][i]["accuracy"] for r in entry["runs"] if r["by_offset"][i].get("n")]
                cells.append(f"{100 * statistics.mean(values):.1f}" if values else "-")
            lines.append(f"| {entry['label']} | " + " | ".join(cells) + " |")
    seeds = sorted({run["seed"] for entry in arms.values() for run in entry["runs"]})
    if len(seeds) > 1:
        header = "| arm | " + " | ".join(f"seed {seed}" for seed in seeds) + " |"
        lines += [
            "",
            "## Each seed: accuracy / accuracy with the passage beyond 512 (%)",
            "",
            header,
            "|---|" + "---|" * len(seeds),
        ]
        for entry in arms.values():
            by_seed = {run["seed"]: run for run in entry["runs"]}
            cells = [
                f"{100 * by_seed[seed]['all']['accuracy']:.1f} / {100 * by_seed[seed]['beyond_512']['accuracy']:.1f}"
                if seed in by_seed
                else "-"
                for seed in seeds
            ]
            lines.append(f"| {entry['label']} | " + " | ".join(cells) + " |")
    # the lengths probed, in this run or in the run its seeds were pooled with
    lengths = sorted({int(n) for entry in arms.values() for n in entry["cost"]})
    for key, title in (("train_step", "One training step (batch 1)"), ("forward", "One forward (batch 1)")):
        lines += [
            "",
            f"## {title}: seconds / peak extra resident memory",
            "",
            "| arm | " + " | ".join(str(n) for n in lengths) + " |",
            "|---|" + "---|" * len(lengths),
        ]
        for entry in arms.values():
            cells = [_cost_cell(entry["cost"].get(str(n)), key) for n in lengths]
            lines.append(f"| {entry['label']} | " + " | ".join(cells) + " |")
    bigbird = arms.get("bigbird", {}).get("warm_start")
    if bigbird:
        lines += [
            "",
            f"BigBird warm start: {len(bigbird['mapped'])} tensors mapped from MiniLM (position table tiled; "
            "BERT's pooler as the head's dense layer); new: " + ", ".join(bigbird["new"]) + ".",
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict):
    plt = harness.pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for entry in result["arms"].values():
        if entry["runs"]:
            bins = entry["runs"][0]["by_offset"]
            centres = [(b["from"] + b["to"]) / 2 for b in bins]
            values = [
                statistics.mean(r["by_offset"][i]["accuracy"] for r in entry["runs"])
                if bins[i].get("n")
                else float("nan")
                for i in range(len(bins))
            ]
            left.plot(centres, [100 * v for v in values], marker="o", label=entry["label"])
        points = [(int(n), c["train_step_seconds"]) for n, c in entry["cost"].items() if c.get("ok", True)]
        if points:
            right.plot(*zip(*sorted(points), strict=True), marker="o", label=entry["label"])
    left.axhline(100 / len(BBC_LABELS), color="grey", linestyle=":", label="chance")
    left.axvline(TRUNCATED, color="grey", linestyle="--")
    left.set(xlabel="passage offset (tokens)", ylabel="test accuracy (%)", title="accuracy by evidence position")
    right.set(xlabel="tokens", ylabel="seconds", xscale="log", yscale="log", title="one training step (batch 1)")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> dict:
    positive = harness.at_least(1)
    parser = harness.parser(
        __doc__,
        quick="1,024 tokens, 8 training documents, 2 steps per arm, 1 seed",
        quick_flags={
            "length": 1024,
            "evidence_tokens": 256,
            "train_docs": 8,
            "validation_docs": 2,
            "test_docs": 4,
            "probe_lengths": [1024],
            "seeds": 1,
        },
        threads=2,
    )
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--length", type=positive, default=4096, help="tokens per document")
    parser.add_argument("--evidence-tokens", type=positive, default=1024, help="tokens of the passage of news articles")
    parser.add_argument("--train-docs", type=positive, default=256)
    parser.add_argument("--validation-docs", type=positive, default=20)
    parser.add_argument("--test-docs", type=positive, default=240)
    parser.add_argument("--batch-size", type=positive, default=1)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--warmup", type=harness.at_least(0), default=16, help="warm-up optimizer steps")
    parser.add_argument("--seeds", type=positive, default=1, help="training seeds per arm (--first-seed, +1, ...)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--merge-with", type=Path, help="an earlier results JSON whose seeds to pool with these")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of BBC News' 80/10/10 split")
    parser.add_argument(
        "--probe-lengths",
        type=positive,
        nargs="*",
        default=[512, 1024, 2048, 4096, 8192],
        help="lengths whose step time and memory to probe (none: keep those of --merge-with)",
    )
    parser.add_argument("--memory-cap-gb", type=float, default=20.0, help="address-space cap of a cost probe")
    return harness.main("long_documents", parser, measure, markdown, plot, child=probe_child, argv=argv)


if __name__ == "__main__":
    main()
