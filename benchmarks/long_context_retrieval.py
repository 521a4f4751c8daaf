"""What a converted decoder can still read far from its window: pass-key retrieval with plain ``generate()``, the
decoding state's bytes, decode time per token, prefill time and perplexity, for SmolLM2-135M-Instruct (the real
Llama-architecture model of ``performer_hf.model_assets``) and its conversions.

Arms (each a folder written by ``performer_hf.convert`` and loaded back, then ``model.generate(**inputs)`` with no
cache argument, as a user would):

- ``source``: the model itself (SDPA, its key/value cache);
- ``window``: exact attention on the first 4 tokens and a window of 512 keys only (StreamingLLM's shape: the sparse
  method with ``select_blocks=0``);
- ``hybrid``: the in-place conversion's hybrid (window 64, first token, FAVOR++ far field), the default before the
  sparse method;
- ``sparse``: the sparse method's preset, the default (window 512, 4 global tokens, 8 selected blocks of 64 per query;
  16 blocks kept beyond the window, the ones the prompt's last queries attend to most: ``latest-16``);
- ``keep-all``: the same, every block kept (``select_budget=0``): cached decoding computes what a full forward does;
- ``bounded-N``: the sparse method keeping N blocks once they leave the window (``select_budget``), the ones that
  received the most attention in the window (causal);
- ``latest-N``: the same budget, the blocks that the prompt's last queries attend to most (``select_ranking=
  "latest"``, as SnapKV; decoding then reads only those).

Every arm runs ``generate()`` with no cache argument: the bounded arms (``window``, ``bounded-N``, ``latest-N``) and
the hybrid decode from the method's own cache layer, which takes the place of the key/value layer after the prompt
(the same logits as with ``PerformerCache`` passed, ``tests/integrations/test_attention_interface.py``).

Pass key: a five-digit key in BBC News articles (test split), behind one line that says a key is hidden, and the
question at the end; keys at evenly spaced depths from 0 to 100% of the prompt, one trial per depth and length.
A trial counts when the key appears in the first 8 generated tokens (greedy). Timing: a logits processor stamps each
generation step; prefill is the first step's time, decode the median gap between later steps. Bytes: every tensor
the cache holds after the prompt and the answer. Perplexity: mean loss over ``--ppl-windows`` windows of
``--ppl-length`` tokens of Python's documentation topics (text no arm was tuned on), exponentiated.

Writes long_context_retrieval.{json,md,png} to --out-dir.

    python benchmarks/long_context_retrieval.py                                     # about 80 minutes on 2 CPU cores
    python benchmarks/long_context_retrieval.py --lengths 4096 8192 --arms source sparse bounded-16
    python benchmarks/long_context_retrieval.py --quick --out-dir /tmp/retrieval    # smoke test: a minute or two
"""

from __future__ import annotations

import logging
import math
import statistics
import tempfile
import time
from pathlib import Path

import harness
import passkey
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LogitsProcessor, LogitsProcessorList

import performer_hf
from performer_hf.data_assets import bbc_news, python_docs
from performer_hf.integrations import CACHE_KEYWORD, held_bytes
from performer_hf.model_assets import smollm2_checkpoint
from performer_hf.modeling.attention_methods import ATTENTION_METHODS

logger = logging.getLogger("benchmarks.long_context_retrieval")
METHOD_FIELDS = {name: method.fields for name, method in ATTENTION_METHODS.items()}

# arm -> convert()'s method and overrides (None: the source itself)
ARMS = {
    "source": None,
    "window": ("sparse", {"select_blocks": 0, "select_budget": 0}),
    "hybrid": ("hybrid", {}),
    "sparse": ("sparse", {}),  # the default: 16 blocks kept, ranked by the prompt's last queries
    "keep-all": ("sparse", {"select_budget": 0}),
    "bounded-8": ("sparse", {"select_budget": 8, "select_ranking": "window"}),
    "bounded-16": ("sparse", {"select_budget": 16, "select_ranking": "window"}),
    "latest-8": ("sparse", {"select_budget": 8, "select_ranking": "latest"}),
    "latest-16": ("sparse", {"select_budget": 16, "select_ranking": "latest"}),
}


def _arguments():
    positive = harness.at_least(1)
    arguments = harness.parser(
        __doc__,
        quick="768 tokens, the key first, 3 arms, one perplexity window",
        # each path at the least work: prompts past the 512-token window, which the "window" arm reads alone
        quick_flags={
            "lengths": [768],
            "trials": 1,
            "arms": ["source", "window", "bounded-16"],
            "ppl_length": 768,
            "ppl_windows": 1,
            "decode_contexts": [256],
            "decode_rounds": 3,
        },
        threads=2,
    )
    arguments.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    arguments.add_argument(
        "--lengths",
        nargs="+",
        type=positive,
        default=[2048, 4096, 8184],
        help="prompt tokens (8184 + the 8 answer tokens fill SmolLM2's 8192 positions)",
    )
    arguments.add_argument("--trials", type=positive, default=8, help="depths per length, from 0 to 100%%")
    arguments.add_argument("--ppl-length", type=positive, default=8192)
    arguments.add_argument("--ppl-windows", type=positive, default=2)
    arguments.add_argument("--seed", type=int, default=0)
    arguments.add_argument("--decode-contexts", nargs="+", type=positive, default=[1024, 4096, 8184])
    arguments.add_argument("--decode-rounds", type=positive, default=9)
    arguments.add_argument(
        "--decode-arms", nargs="*", default=[], choices=list(ARMS), help="arms timed for decoding only (no pass key)"
    )
    return arguments


class _Stamps(LogitsProcessor):
    """Records the time of every generation step (called once per step, after the model's forward)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def _convert(arm: str, source: Path, workdir: Path) -> Path:
    if ARMS[arm] is None:
        return source
    method, overrides = ARMS[arm]
    return performer_hf.convert(source, workdir / arm, method=method, fidelity=False, **overrides)


def _trials(model, tokenizer, filler, length: int, settings: list[tuple[float, int]]) -> list[dict]:
    rows = []
    for depth, key in settings:
        inputs = tokenizer(passkey.prompt(tokenizer, filler, length, depth, key), return_tensors="pt")
        stamps = _Stamps()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=passkey.ANSWER_TOKENS,
                do_sample=False,
                logits_processor=LogitsProcessorList([stamps]),
                return_dict_in_generate=True,
            )
        answer = tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :])
        cache = out.get(CACHE_KEYWORD)  # the name the installed transformers gives it
        rows.append(
            {
                "depth": depth,
                "key": key,
                "found": str(key) in answer,
                "answer": answer,
                "prompt_tokens": int(inputs["input_ids"].shape[1]),
                "prefill_s": stamps.times[0] - start,
                "cache_bytes": held_bytes(cache.layers) if cache is not None else None,
                "cache_type": type(cache.layers[0]).__name__ if cache is not None else None,
            }
        )
        logger.info(
            "  %5d tokens, depth %.2f: %s (%r)", length, depth, "found" if rows[-1]["found"] else "missed", answer
        )
    return rows


@torch.no_grad()
def _decode_times(models: dict, contexts: list[int], rounds: int) -> dict:
    """Decode ms per token at each context, the arms interleaved: every arm's cache is filled with the same random
    prompt (as generate() would fill it), then ``rounds`` rounds of one step per arm, in alternating order; the
    median per arm. Also the cache's bytes after the prompt."""
    results = {arm: {} for arm in models}
    for context in contexts:
        ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(context))
        caches = {}
        for arm, model in models.items():
            cache = DynamicCache(config=model.config)  # what generate() builds
            model(ids, use_cache=True, **{CACHE_KEYWORD: cache})
            caches[arm] = cache
        steps = {arm: [] for arm in models}
        token = torch.tensor([[42]])
        for round_ in range(rounds):
            for arm in list(models)[:: 1 if round_ % 2 == 0 else -1]:
                start = time.perf_counter()
                models[arm](token, use_cache=True, **{CACHE_KEYWORD: caches[arm]})
                steps[arm].append(1000 * (time.perf_counter() - start))
        for arm in models:
            results[arm][context] = {
                "decode_ms": statistics.median(steps[arm]),
                "cache_bytes": held_bytes(caches[arm].layers),
            }
        logger.info(
            "decode at %d tokens: %s", context, {a: round(r[context]["decode_ms"], 1) for a, r in results.items()}
        )
    return results


@torch.no_grad()
def _perplexity(model, windows: list[torch.Tensor]) -> float | None:
    if not windows:
        return None
    losses = [float(model(window[None], labels=window[None]).loss) for window in windows]
    return math.exp(statistics.mean(losses))


def measure(args) -> dict:
    source = smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(source)
    filler = passkey.filler_tokens(tokenizer, bbc_news()["test"])
    keys = passkey.trials(args.lengths, args.trials, args.seed)  # the same keys for every arm
    docs = tokenizer("\n\n".join(python_docs()), return_tensors="pt")["input_ids"][0]
    windows = [docs[i * args.ppl_length : (i + 1) * args.ppl_length] for i in range(args.ppl_windows)]
    results, models = {}, {}
    with tempfile.TemporaryDirectory() as workdir:
        for arm in dict.fromkeys(args.arms + args.decode_arms):
            logger.info("arm %s", arm)
            folder = _convert(arm, source, Path(workdir))
            model = models[arm] = AutoModelForCausalLM.from_pretrained(folder).eval()
            measured = arm in args.arms  # else decode timing only
            by_length = {
                length: _trials(model, tokenizer, filler, length, keys[length]) for length in args.lengths if measured
            }
            settings = getattr(model.config, "performer_attention", None)
            if settings is not None:  # the method and the fields it reads
                settings = {
                    name: settings[name] for name in ("attention_method", *METHOD_FIELDS[settings["attention_method"]])
                }
            results[arm] = {
                "attn_implementation": model.config._attn_implementation,
                "settings": settings,
                "passkey": by_length,
                "perplexity": _perplexity(model, windows) if measured else None,
            }
        logger.info("decode timing (the arms interleaved): keep the machine otherwise idle")
        for arm, times in _decode_times(models, args.decode_contexts, args.decode_rounds).items():
            results[arm]["decode"] = times
    return {
        "model": "SmolLM2-135M-Instruct",
        "lengths": args.lengths,
        "trials": args.trials,
        "seed": args.seed,
        "ppl_length": args.ppl_length,
        "ppl_windows": args.ppl_windows,
        "arms": results,
    }


def markdown(payload: dict) -> str:
    arms = payload["arms"]
    source = arms.get("source")
    lines = [
        f"# Long-context retrieval: {payload['model']}, plain `generate()`",
        "",
        f"Pass key in BBC News prose, {payload['trials']} depths from 0 to 100% per length (greedy, 8 tokens). "
        "Prefill: median seconds to the first token (arms run one after another: indicative). Cache: bytes the "
        "cache holds after the prompt and the answer.",
        "",
        "| arm | prompt tokens | keys found | prefill s | cache MB | cache vs source |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for arm, result in arms.items():
        for length, rows in result["passkey"].items():
            cache = max(row["cache_bytes"] or 0 for row in rows) / 2**20
            base = max(row["cache_bytes"] or 0 for row in source["passkey"][length]) / 2**20 if source else 0
            lines.append(
                f"| {arm} | {length} | {sum(row['found'] for row in rows)}/{len(rows)} | "
                f"{statistics.median(row['prefill_s'] for row in rows):.1f} | {cache:.1f} | "
                f"{f'{cache / base:.1%}' if base else '-'} |"
            )
    lines += [
        "",
        "Decode: ms per token after a prompt of random tokens, the arms interleaved in one process (median of "
        "alternating rounds); the cache's bytes after that prompt.",
        "",
        "| arm | context | decode ms/token | vs source | cache MB | vs source |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for arm, result in arms.items():
        for context, row in result.get("decode", {}).items():
            base = source["decode"][context] if source else None
            speed = f"{row['decode_ms'] / base['decode_ms']:.2f}x" if base else "-"
            size = f"{row['cache_bytes'] / base['cache_bytes']:.1%}" if base else "-"
            lines.append(
                f"| {arm} | {context} | {row['decode_ms']:.1f} | {speed} | {row['cache_bytes'] / 2**20:.1f} | {size} |"
            )
    lines += [
        "",
        f"Perplexity over {payload['ppl_windows']} windows of {payload['ppl_length']} tokens of Python's "
        "documentation:",
        "",
        "| arm | perplexity | vs source |",
        "|---|---:|---:|",
    ]
    for arm, result in arms.items():
        if result["perplexity"] is not None:
            ratio = f"{result['perplexity'] / source['perplexity']:.3f}x" if source else "-"
            lines.append(f"| {arm} | {result['perplexity']:.3f} | {ratio} |")
    lines += ["", "Settings per arm:", ""]
    lines += [f"- {arm}: `{result['attn_implementation']}` {result['settings'] or ''}" for arm, result in arms.items()]
    return "\n".join(lines) + "\n"


def plot(payload: dict):
    plt = harness.pyplot()
    arms = {arm: result for arm, result in payload["arms"].items() if result["passkey"]}  # not the decode-only arms
    figure, axes = plt.subplots(1, len(arms), figsize=(2.6 * len(arms), 2.8), squeeze=False)
    for ax, (arm, result) in zip(axes[0], arms.items(), strict=True):
        lengths = list(result["passkey"])
        grid = [[float(row["found"]) for row in result["passkey"][length]] for length in lengths]
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        depths = [row["depth"] for row in result["passkey"][lengths[0]]]
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths], rotation=90, fontsize=7)
        ax.set_yticks(range(len(lengths)), lengths, fontsize=7)
        ax.set_title(arm, fontsize=9)
        ax.set_xlabel("key depth", fontsize=8)
    axes[0][0].set_ylabel("prompt tokens", fontsize=8)
    figure.suptitle("pass key found (green) by depth and length", fontsize=9)
    return figure


if __name__ == "__main__":
    harness.main("long_context_retrieval", _arguments(), measure, markdown, plot)
