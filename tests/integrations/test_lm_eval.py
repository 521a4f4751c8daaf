"""lm-evaluation-harness on a folder converted in place, both ways the README gives: the ``lm_eval`` command with
``trust_remote_code=True`` in a process where performer_hf cannot be imported, and ``lm_eval.simple_evaluate`` after
``import performer_hf``; on the local task ``python_docs_perplexity`` (``benchmarks/lm_eval_tasks/``), with a tiny
random Llama that uses SmolLM2's tokenizer."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import performer_hf
from performer_hf.model_assets import smollm2_checkpoint

from ..remote_code import BLOCK_PERFORMER_HF

lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is in the test extra: pip install -e '.[test]'")

TASKS = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_eval_tasks"
TASK = "python_docs_perplexity"
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A tiny Llama (SmolLM2's vocabulary and tokenizer) converted with the default: the sparse method with a window of
    64 keys, so that the task's pages (about 2,000 tokens and more) reach past it."""
    root = tmp_path_factory.mktemp("lm_eval")
    tokenizer_files = smollm2_checkpoint()
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "source")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_files / name, root / "source" / name)
    settings = {"local_window": 64, "select_block_size": 16, "select_blocks": 2}
    return performer_hf.convert(root / "source", root / "converted", fidelity=False, **settings)


def _scores(results: dict) -> dict[str, float]:
    task = results["results"][TASK]
    return {metric: task[f"{metric},none"] for metric in METRICS}


def test_the_command_evaluates_a_converted_folder_without_performer_hf(converted, tmp_path):
    script = BLOCK_PERFORMER_HF + "from lm_eval.__main__ import cli_evaluate\ncli_evaluate()\n"
    model_args = f"pretrained={converted},trust_remote_code=True,dtype=float32"
    argv = [sys.executable, "-c", script, "--model", "hf", "--model_args", model_args, "--tasks", TASK]
    argv += ["--device", "cpu", "--include_path", str(TASKS), "--limit", "2"]
    argv += ["--output_path", str(tmp_path / "results")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    (written,) = (tmp_path / "results").rglob("results_*.json")
    from_command = _scores(json.loads(written.read_text()))

    # the Python API with the package imported (no flag): the same scores
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(1)
    results = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(converted), "dtype": "float32"},
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        limit=2,
        device="cpu",
    )
    from_api = _scores(results)
    assert all(1 < from_api[m] < float("inf") for m in ("word_perplexity", "byte_perplexity"))
    for metric in METRICS:
        assert from_command[metric] == pytest.approx(from_api[metric], rel=1e-5)
