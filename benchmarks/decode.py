"""Per-token decode time against context length: Performer's constant-size cache vs GPT-2's KV cache.

Both models have 6 layers, hidden 384, 12 heads, the GPT-2 vocabulary, random weights, fp32, batch 1.
For every context length each model prefills the context once (Performer: the chunked causal kernel,
returning its FAVOR+ state; GPT-2: its KV cache, filled in chunks of ``--prefill-chunk`` tokens so
that no L x L attention matrix is formed), then decodes ``--steps`` greedy tokens one at a time; each
step is timed on its own. Every round decodes from a copy of the prefilled cache; contexts and
models are visited in interleaved rounds, and the reported figure is the median step over all
rounds, so the ratios compare like with like on a shared CPU.

Writes decode.{json,png,md} to --out-dir.

    python benchmarks/decode.py                                  # contexts 256 1024 4096 16384
    python benchmarks/decode.py --quick --out-dir /tmp/decode    # smoke test: contexts 256 2048, 2 x 16 steps
"""

from __future__ import annotations

import copy
import logging
import statistics
import time

import harness
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from performer_hf import PerformerConfig, PerformerForCausalLM
from performer_hf.modeling.modeling_performer import CACHE_FIELD

logger = logging.getLogger("benchmarks.decode")
LAYERS, HIDDEN, HEADS, VOCAB = 6, 384, 12, 50257


def build_models(max_positions: int, nb_features: int, kernel: str) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    performer = PerformerForCausalLM(
        PerformerConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=4 * HIDDEN,
            max_position_embeddings=max_positions,
            layer_norm_position="pre",
            hidden_act="gelu_new",
            layer_norm_eps=1e-5,
            type_vocab_size=0,
            attention_kernel=kernel,
            nb_features=nb_features,
        )
    ).eval()
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=max_positions)
    ).eval()
    return {f"performer ({kernel}, m={nb_features})": performer, "gpt2 (KV cache)": gpt2}


@torch.no_grad()
def prefill(model: torch.nn.Module, context: torch.Tensor, chunk: int):
    """Run the context through the model once; returns (cache, next token)."""
    if isinstance(model, PerformerForCausalLM):
        out = model(input_ids=context, use_cache=True, logits_to_keep=1)
        return getattr(out, CACHE_FIELD), out.logits[:, -1].argmax(-1, keepdim=True)
    cache = DynamicCache(config=model.config)
    for start in range(0, context.shape[1], chunk):
        piece = context[:, start : start + chunk]
        out = model(input_ids=piece, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def time_steps(model: torch.nn.Module, cache, token: torch.Tensor, steps: int) -> list[float]:
    """Greedy decode ``steps`` tokens; seconds per step."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
    return times


def measure(args) -> dict:
    """Prefill every context once, then time greedy decode steps in interleaved rounds."""
    models = build_models(
        max(args.contexts) + args.rounds * (args.steps + args.warmup) + 1, args.nb_features, args.kernel
    )
    generator = torch.Generator().manual_seed(0)
    prefilled, prefill_s = {}, {name: {} for name in models}
    for n in args.contexts:
        context = torch.randint(0, VOCAB, (1, n), generator=generator)
        for name, model in models.items():
            start = time.perf_counter()
            prefilled[name, n] = prefill(model, context, args.prefill_chunk)
            prefill_s[name][n] = time.perf_counter() - start
            logger.info("prefill L=%-6d %-28s %.1f s", n, name, prefill_s[name][n])

    steps: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.contexts} for name in models}
    for round_idx in range(args.rounds):
        for n in args.contexts:
            for name, model in models.items():
                cache, token = prefilled[name, n]
                cache = copy.deepcopy(cache)  # every round decodes from the same prefilled context
                time_steps(model, cache, token, args.warmup)
                steps[name][n].extend(time_steps(model, cache, token, args.steps))
                logger.info(
                    "round %d  L=%-6d %-28s step %.2f ms", round_idx, n, name, 1e3 * statistics.median(steps[name][n])
                )
                del cache
    lo, hi = min(args.contexts), max(args.contexts)
    results = {}
    for name in models:
        per_context = {
            n: {
                "step_ms_median": 1e3 * statistics.median(steps[name][n]),
                "step_ms_p10": 1e3 * statistics.quantiles(steps[name][n], n=10)[0],
                "step_ms_p90": 1e3 * statistics.quantiles(steps[name][n], n=10)[-1],
                "steps_timed": len(steps[name][n]),
                "prefill_s": prefill_s[name][n],
            }
            for n in args.contexts
        }
        results[name] = {
            "contexts": per_context,
            f"ratio_{hi}_over_{lo}": per_context[hi]["step_ms_median"] / per_context[lo]["step_ms_median"],
        }
    return {
        "benchmark": "decode step time vs context length",
        "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "vocab": VOCAB, "dtype": "float32", "batch": 1},
        "settings": vars(args),
        "floor": f"performer step at {hi} within 1.2x of the step at {lo}",
        "results": results,
    }


def markdown(payload: dict) -> str:
    """Median decode step per model and context, the long/short ratio, and the prefill times."""
    settings, results = payload["settings"], payload["results"]
    environment, contexts = harness.environment(payload), settings["contexts"]
    load, lo, hi = environment["load_average"], min(contexts), max(contexts)
    lines = [
        f"# Decode step time vs context ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, fp32, batch 1, "
        f"{environment['machine']['torch_threads']} CPU threads)",
        "",
        "Median of "
        + ", ".join(f"{r['contexts'][str(lo)]['steps_timed']}" for r in results.values())
        + f" timed steps per cell ({settings['rounds']} interleaved rounds of {settings['steps']}). Shared 2-core "
        f"CPU, 1-minute load average {load['before'][0]:.1f} at the start, {load['after'][0]:.1f} at the end.",
        "",
        "| model | " + " | ".join(f"L={n}" for n in contexts) + f" | step(L={hi}) / step(L={lo}) |",
        "|---|" + "---|" * (len(contexts) + 1),
    ]
    for name, r in results.items():
        cells = [f"{r['contexts'][str(n)]['step_ms_median']:.2f} ms" for n in contexts]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r[f'ratio_{hi}_over_{lo}']:.2f}x |")
    lines += ["", "Prefill (once per context, seconds):", ""]
    lines.append("| model | " + " | ".join(f"L={n}" for n in contexts) + " |")
    lines.append("|---|" + "---|" * len(contexts))
    for name, r in results.items():
        cells = [f"{r['contexts'][str(n)]['prefill_s']:.1f} s" for n in contexts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(payload: dict):
    """Decode step (median, p10-p90) vs context length per model."""
    contexts, results = payload["settings"]["contexts"], payload["results"]
    fig, ax = harness.pyplot().subplots(figsize=(6, 4))
    for name, r in results.items():
        cells = [r["contexts"][str(n)] for n in contexts]
        medians = [c["step_ms_median"] for c in cells]
        low = [m - c["step_ms_p10"] for m, c in zip(medians, cells, strict=True)]
        high = [c["step_ms_p90"] - m for m, c in zip(medians, cells, strict=True)]
        ax.errorbar(contexts, medians, yerr=[low, high], marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step (ms, median, p10-p90)")
    ax.set_ylim(bottom=0)
    ax.set_title("Per-token decode time, 6 x 384 x 12, fp32, CPU")
    ax.legend()
    return fig


def main(argv=None) -> dict:
    parser = harness.parser(
        __doc__,
        quick="contexts 256 2048, 2 rounds of 16 steps",
        quick_flags={"contexts": [256, 2048], "steps": 16, "rounds": 2},
        threads=0,
    )
    parser.add_argument("--contexts", type=harness.at_least(1), nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument(
        "--steps",
        type=harness.at_least(2),
        default=32,
        help="timed decode steps per context and round (at least 2: the p10-p90 band)",
    )
    parser.add_argument("--warmup", type=harness.at_least(0), default=4, help="untimed decode steps before timing")
    parser.add_argument("--rounds", type=harness.at_least(1), default=3, help="interleaved repetitions")
    parser.add_argument("--prefill-chunk", type=harness.at_least(1), default=1024, help="GPT-2 prefill chunk (tokens)")
    parser.add_argument("--nb-features", type=harness.at_least(1), default=256)
    parser.add_argument("--kernel", default="softmax")
    return harness.main("decode", parser, measure, markdown, plot, argv=argv)


if __name__ == "__main__":
    main()
