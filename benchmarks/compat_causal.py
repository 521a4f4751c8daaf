"""The paper's Fig. 5 on this CPU: pretrain a small GPT-2 with softmax attention, convert it, finetune briefly.

1. Text: English prose from Python's documentation (``performer_hf.data_assets.python_docs``: the
   ``pydoc_data.topics`` pages and the standard library's long docstrings), split 90/10 by document
   (seeded); a byte-level BPE tokenizer is trained on the training documents. Documents are joined
   with ``<|endoftext|>`` and cut into blocks of ``--context`` tokens.
2. Pretraining: an HF ``GPT2LMHeadModel`` (default 4 layers, hidden 128, 4 heads of 32, context 256,
   vocabulary 4096: sized so that 1,500 steps of batch 4 fit in about 10 minutes on one CPU thread)
   with softmax attention, ``--pretrain-steps`` optimizer steps of AdamW.
3. Conversion: ``performer_hf.convert`` to a ``PerformerForCausalLM`` with plain FAVOR+ (m = 256
   orthogonal features, no hybrid fields, pinned explicitly), once with positive random features
   (``attention_kernel="softmax"``) and once with trigonometric ones (``"softmax_trig"``). The
   exact-kernel conversion is also evaluated: it must reproduce the GPT-2's figures.
4. Finetuning: each converted model trains for ``--finetune-fraction`` (10%) of the pretraining steps
   on the same training text, with its features fixed or redrawn every ``--redraw-interval`` steps
   (``model.redraw_projections(step)`` through ``performer_hf.training.redraw``). For reference the
   softmax GPT-2 itself continues for the same steps. Every arm sees the same batches.

Next-token accuracy and perplexity on the held-out blocks are measured right after conversion
(step 0) and every ``--eval-every`` finetuning steps, against the softmax model's level. The floor
(issue 7): a converted model within 5% of the softmax model's perplexity within 10% of the
pretraining steps. Training is a compact torch loop (``train``): the library's Accelerate trainer
takes only Performer models and does not evaluate before the first step, which this study needs.

Writes compat_causal.{json,md,png} to --out-dir.

    python benchmarks/compat_causal.py                       # full study (~20 min, 1 thread)
    python benchmarks/compat_causal.py --quick --out-dir /tmp/compat   # smoke test
"""

from __future__ import annotations

import argparse
import logging
import math
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import harness
import torch
from compat_sentiment import plain_favor
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, get_scheduler

from performer_hf import PerformerForCausalLM, convert
from performer_hf.data_assets import python_docs, seeded_split
from performer_hf.training.metrics import language_modeling_metrics, token_statistics
from performer_hf.training.redraw import redraw_due, redraw_features

logger = logging.getLogger("benchmarks.compat_causal")
END_OF_TEXT = "<|endoftext|>"
# arm -> (attention_kernel of the conversion, redraw the features during finetuning)
ARMS = {
    "positive, redraw": ("softmax", True),
    "positive, fixed": ("softmax", False),
    "trig, redraw": ("softmax_trig", True),
    "trig, fixed": ("softmax_trig", False),
}


def train_tokenizer(documents: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) trained on ``documents``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(documents, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, unk_token=END_OF_TEXT
    )


def make_blocks(tokenizer, documents: list[str], context: int) -> torch.Tensor:
    """Documents joined by ``<|endoftext|>``, tokenized and cut into (N, context) blocks (the remainder dropped)."""
    ids: list[int] = []
    for encoded in tokenizer(documents)["input_ids"]:
        ids += encoded + [tokenizer.eos_token_id]
    count = len(ids) // context
    return torch.tensor(ids[: count * context]).view(count, context)  # (N, context)


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, batch_size: int) -> dict:
    """Token-weighted loss, perplexity and next-token accuracy on ``blocks`` (features left as they are)."""
    was_training = model.training
    model.eval()
    parts: dict[str, list[torch.Tensor]] = {}
    for begin in range(0, len(blocks), batch_size):
        batch = blocks[begin : begin + batch_size]  # (b, context)
        statistics = token_statistics(model(input_ids=batch).logits, batch, shift=True)
        for name, values in statistics.items():
            parts.setdefault(name, []).append(values)
    model.train(was_training)
    return language_modeling_metrics(**{name: torch.cat(values) for name, values in parts.items()})


def batch_order(num_blocks: int, steps: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Block indices of every step: seeded permutations, one per pass over the data."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.cat(
        [torch.randperm(num_blocks, generator=generator) for _ in range(math.ceil(steps * batch_size / num_blocks))]
    )
    return [indices[i * batch_size : (i + 1) * batch_size] for i in range(steps)]


def train(
    model,
    blocks: torch.Tensor,
    order: list[torch.Tensor],
    learning_rate: float,
    warmup: int,
    evaluate_at: Callable[[int], dict | None],
    redraw_interval: int | None = None,
    description: str = "train",
) -> tuple[list[dict], float]:
    """AdamW (weight decay 0.01), linear warm-up then cosine decay, clipping 1.0, one step per entry of
    ``order``; redraws the FAVOR+ features after every ``redraw_interval``-th step. ``evaluate_at(step)``
    is called at step 0 and after every step (it returns a record or None). Returns the records and
    the training seconds (evaluations excluded)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=learning_rate
    )
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=warmup, num_training_steps=len(order))
    records = [record for record in [evaluate_at(0)] if record is not None]
    seconds = 0.0
    model.train()
    for step, indices in enumerate(tqdm(order, desc=description, leave=False), start=1):
        tick = time.perf_counter()
        batch = blocks[indices]  # (B, context)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if redraw_due(step, redraw_interval):
            redraw_features(model, step)
        seconds += time.perf_counter() - tick
        record = evaluate_at(step)
        if record is not None:
            records.append({**record, "train_loss": float(loss)})
    return records, seconds


def evaluator(blocks: torch.Tensor, every: int, last: int, batch_size: int, model) -> Callable[[int], dict | None]:
    def evaluate_at(step: int) -> dict | None:
        if step % every and step != last:
            return None
        return {"step": step, **evaluate(model, blocks, batch_size)}

    return evaluate_at


def first_within(curve: list[dict], reference: float, tolerance: float = 0.05) -> int | None:
    """First evaluated step whose perplexity is within ``tolerance`` of ``reference`` (None if never)."""
    return next((r["step"] for r in curve if r["perplexity"] <= (1 + tolerance) * reference), None)


def measure(args: argparse.Namespace) -> dict:
    """Pretrain the softmax GPT-2, convert it, finetune every arm; curves, levels and the floor."""
    torch.manual_seed(args.seed)
    documents = python_docs(include_docstrings=True)
    split = seeded_split(documents, args.data_seed, {"train": 0.9, "validation": 0.1})
    tokenizer = train_tokenizer(split["train"], args.vocab_size)
    train_blocks = make_blocks(tokenizer, split["train"], args.context)
    eval_blocks = make_blocks(tokenizer, split["validation"], args.context)[: args.eval_blocks]
    pretrain_steps = args.pretrain_steps
    finetune_steps = max(1, round(args.finetune_fraction * pretrain_steps))
    result = {
        "study": "compat_causal",
        "data": {
            "name": "Python documentation: pydoc_data.topics + stdlib docstrings >= 200 chars",
            "python": platform.python_version(),
            "documents": {k: len(v) for k, v in split.items()},
            "characters": sum(map(len, documents)),
            "tokenizer": f"byte-level BPE, vocab {len(tokenizer)}",
            "train_tokens": train_blocks.numel(),
            "eval_tokens": eval_blocks.numel(),
        },
        "model": {
            "class": "GPT2LMHeadModel",
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "context": args.context,
            "dropout": 0.0,
        },
        "budget": {
            "pretrain_steps": pretrain_steps,
            "finetune_steps": finetune_steps,
            "batch_size": args.batch_size,
            "pretrain_lr": args.lr,
            "finetune_lr": args.finetune_lr,
            "warmup_steps": args.warmup,
            "finetune_warmup_steps": args.finetune_warmup,
            "redraw_interval": args.redraw_interval,
            "nb_features": args.nb_features,
            "seed": args.seed,
            "pretrain_tokens": pretrain_steps * args.batch_size * args.context,
        },
        "quick": args.quick,
        "threads": torch.get_num_threads(),
    }

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.context,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    gpt2 = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    every = max(1, pretrain_steps // 10)
    curve, seconds = train(
        gpt2,
        train_blocks,
        batch_order(len(train_blocks), pretrain_steps, args.batch_size, args.seed),
        args.lr,
        args.warmup,
        evaluator(eval_blocks, every, pretrain_steps, args.batch_size, gpt2),
        description="pretraining GPT-2",
    )
    softmax = curve[-1]
    result["pretraining"] = {"curve": curve, "seconds": seconds, "steps_per_second": pretrain_steps / seconds}
    result["softmax_level"] = {"perplexity": softmax["perplexity"], "accuracy": softmax["accuracy"]}
    logger.info(
        "pretrained GPT-2: perplexity %.2f, accuracy %.4f, %.0f s", softmax["perplexity"], softmax["accuracy"], seconds
    )

    finetune_order = batch_order(len(train_blocks), finetune_steps, args.batch_size, args.seed + 1)
    arms: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="compat_causal-") as scratch:
        source = Path(scratch) / "gpt2"
        gpt2.save_pretrained(source)
        tokenizer.save_pretrained(source)
        exact = PerformerForCausalLM.from_pretrained(
            convert(source, Path(scratch) / "exact", fidelity=False, attention_kernel="exact")
        )
        result["exact_conversion"] = evaluate(exact, eval_blocks, args.batch_size)
        del exact
        converted = {}
        for kernel in dict.fromkeys(kernel for kernel, _ in ARMS.values()):
            converted[kernel] = convert(
                source, Path(scratch) / kernel, fidelity=False, **plain_favor(kernel, args.nb_features)
            )

        def finetune(name: str, model, redraw: bool) -> None:
            torch.manual_seed(args.seed)
            records, seconds = train(
                model,
                train_blocks,
                finetune_order,
                args.finetune_lr,
                args.finetune_warmup,
                evaluator(eval_blocks, args.eval_every, finetune_steps, args.batch_size, model),
                redraw_interval=args.redraw_interval if redraw else None,
                description=f"finetuning {name}",
            )
            arms[name] = {
                "curve": records,
                "seconds": seconds,
                "steps_per_second": finetune_steps / seconds,
                "redraw_interval": args.redraw_interval if redraw else None,
                "steps_to_within_5_percent": first_within(records, softmax["perplexity"]),
            }
            logger.info(
                "%s: step 0 perplexity %.2f -> %.2f after %d steps",
                name,
                records[0]["perplexity"],
                records[-1]["perplexity"],
                finetune_steps,
            )

        for name in tqdm(args.arms, desc="compat_causal arms"):
            kernel, redraw = ARMS[name]
            finetune(name, PerformerForCausalLM.from_pretrained(converted[kernel]), redraw)
            arms[name]["attention_kernel"] = kernel
        if not args.no_softmax_reference:
            finetune(
                "softmax GPT-2, continued",
                GPT2LMHeadModel.from_pretrained(source, attn_implementation="sdpa"),
                redraw=False,
            )
            arms["softmax GPT-2, continued"]["attention_kernel"] = "exact (GPT-2)"
    result["arms"] = arms
    performers = [record["steps_to_within_5_percent"] for name, record in arms.items() if name in ARMS]
    reached = [steps for steps in performers if steps is not None]
    result["floor"] = {
        "limit_steps": finetune_steps,
        "best_steps_to_within_5_percent": min(reached) if reached else None,
        "met": bool(reached) and min(reached) <= finetune_steps,
    }
    return result


def markdown(result: dict) -> str:
    """The setting, each arm at step 0 and at the end, and the issue-7 floor."""
    data, model, budget = result["data"], result["model"], result["budget"]
    level = result["softmax_level"]
    lines = [
        "# Causal backward compatibility (the paper's Fig. 5): GPT-2 pretrained with softmax, converted to FAVOR+",
        "",
        f"{data['name']} (Python {data['python']}): {data['train_tokens']} training tokens, {data['eval_tokens']} "
        f"held-out tokens, {data['tokenizer']}. GPT2LMHeadModel with {model['layers']} layers, hidden "
        f"{model['hidden']}, {model['heads']} heads, context {model['context']}, no dropout. Pretraining: "
        f"{budget['pretrain_steps']} steps x batch {budget['batch_size']} ({budget['pretrain_tokens']} tokens), AdamW "
        f"lr {budget['pretrain_lr']}, cosine, {result['pretraining']['seconds']:.0f} s. Finetuning after conversion: "
        f"{budget['finetune_steps']} steps (10%), lr {budget['finetune_lr']}, same batches for every arm; FAVOR+ with "
        f"m = {budget['nb_features']} orthogonal features, redraw every {budget['redraw_interval']} steps where "
        f"named; {result['threads']} CPU threads"
        + (" (QUICK smoke run: figures mean nothing)" if result["quick"] else "")
        + ".",
        "",
        f"Softmax GPT-2 after pretraining: perplexity {level['perplexity']:.2f}, next-token accuracy "
        f"{100 * level['accuracy']:.2f}%. Exact-kernel conversion: perplexity "
        f"{result['exact_conversion']['perplexity']:.2f} (must match).",
        "",
        "| arm | ppl at step 0 | acc at step 0 | ppl at end | acc at end | steps to within 5% of softmax ppl |"
        " finetune steps/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, record in result["arms"].items():
        first, last = record["curve"][0], record["curve"][-1]
        within = record["steps_to_within_5_percent"]
        lines.append(
            f"| {name} | {first['perplexity']:.2f} | {100 * first['accuracy']:.2f} | {last['perplexity']:.2f} | "
            f"{100 * last['accuracy']:.2f} | {within if within is not None else 'not reached'} | "
            f"{record['steps_per_second']:.2f} |"
        )
    floor = result["floor"]
    lines += [
        "",
        f"Floor (issue 7): a converted model within 5% of the softmax perplexity in at most "
        f"{floor['limit_steps']} steps (10% of pretraining): "
        f"{'met' if floor['met'] else 'NOT met'} (best: {floor['best_steps_to_within_5_percent']}).",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict):
    """Pretraining perplexity, then each arm's perplexity and accuracy over the finetuning steps."""
    figure, axes = harness.pyplot().subplots(1, 3, figsize=(15, 4.2))
    pretraining = result["pretraining"]["curve"]
    axes[0].plot([r["step"] for r in pretraining[1:]], [r["perplexity"] for r in pretraining[1:]], marker="o")
    axes[0].set_yscale("log")
    axes[0].set_title("GPT-2 pretraining (softmax)")
    axes[0].set_xlabel("pretraining step")
    axes[0].set_ylabel("held-out perplexity")
    level = result["softmax_level"]
    for index, (name, record) in enumerate(result["arms"].items()):
        style = {
            "color": "black" if name not in ARMS else f"C{index}",
            "linestyle": "--" if "fixed" in name else "-",
            "marker": "o",
            "markersize": 3,
        }
        steps = [r["step"] for r in record["curve"]]
        axes[1].plot(steps, [r["perplexity"] for r in record["curve"]], label=name, **style)
        axes[2].plot(steps, [100 * r["accuracy"] for r in record["curve"]], label=name, **style)
    axes[1].axhline(level["perplexity"], color="gray", linewidth=1, label="softmax level")
    axes[1].axhline(1.05 * level["perplexity"], color="gray", linewidth=1, linestyle=":", label="softmax + 5%")
    axes[1].set_yscale("log")
    axes[1].set_title("after conversion: held-out perplexity")
    axes[2].axhline(100 * level["accuracy"], color="gray", linewidth=1, label="softmax level")
    axes[2].set_title("after conversion: next-token accuracy (%)")
    for axis in axes[1:]:
        axis.set_xlabel("finetuning step (10% of pretraining = right edge)")
        axis.legend(fontsize=7)
    for axis in axes:
        axis.grid(alpha=0.3)
    figure.suptitle(
        "Fig. 5 replication: softmax GPT-2 -> FAVOR+ (positive vs trigonometric, redraw vs fixed)"
        + (" [quick]" if result["quick"] else ""),
        fontsize=10,
    )
    return figure


def main(argv: list[str] | None = None) -> dict:
    positive, non_negative = harness.at_least(1), harness.at_least(0)
    parser = harness.parser(
        __doc__,
        quick="a tiny model, 40 + 4 steps",
        quick_flags={
            "layers": 2,
            "hidden": 64,
            "heads": 2,
            "context": 64,
            "vocab_size": 512,
            "pretrain_steps": 40,
            "eval_every": 2,
            "eval_blocks": 8,
            "warmup": 4,
            "batch_size": 8,
            "redraw_interval": 2,
            "nb_features": 32,
        },
        threads=1,
    )
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--no-softmax-reference", action="store_true", help="skip the continued softmax GPT-2")
    parser.add_argument("--layers", type=positive, default=4)
    parser.add_argument("--hidden", type=positive, default=128)
    parser.add_argument("--heads", type=positive, default=4)
    parser.add_argument("--context", type=positive, default=256)
    parser.add_argument("--vocab-size", type=positive, default=4096)
    parser.add_argument("--batch-size", type=positive, default=4)
    parser.add_argument("--pretrain-steps", type=positive, default=1500)
    parser.add_argument("--finetune-fraction", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-3, help="pretraining learning rate")
    parser.add_argument("--finetune-lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=non_negative, default=100)
    parser.add_argument("--finetune-warmup", type=non_negative, default=10)
    parser.add_argument("--redraw-interval", type=non_negative, default=15, help="0: never")
    parser.add_argument("--nb-features", type=positive, default=256)
    parser.add_argument("--eval-every", type=positive, default=15, help="finetuning steps between evaluations")
    parser.add_argument("--eval-blocks", type=positive, default=48, help="held-out blocks evaluated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-seed", type=int, default=0)
    return harness.main("compat_causal", parser, measure, markdown, plot, argv=argv)


if __name__ == "__main__":
    main()
