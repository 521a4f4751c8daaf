"""Checkpoints saved by earlier releases keep loading and giving the same outputs.

``fixtures/checkpoints_v0`` holds tiny checkpoints (exact, FAVOR+ and hybrid; masked and causal LM)
saved by performer_hf before the attention-method registry (commit e6d3164), each with
``expected.safetensors``: its inputs and the logits it gave then. ``fixtures/remote_code_v0`` holds the
remote code those checkpoints were saved with (the same files for every one of them), stored once: the
remote-code test puts it beside a checkpoint, as ``save_pretrained`` did.
"""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import performer_hf  # noqa: F401  (registers the Auto classes)

from ..remote_code import BLOCK_PERFORMER_HF

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints_v0"
REMOTE_CODE = Path(__file__).parent / "fixtures" / "remote_code_v0"
CASES = sorted(path.name for path in FIXTURES.iterdir())
AUTO = {"mlm": AutoModelForMaskedLM, "clm": AutoModelForCausalLM}


def test_every_method_has_a_fixture():
    assert CASES == ["exact-mlm", "favor-clm", "favor-mlm", "hybrid-clm", "hybrid-mlm"]


@pytest.mark.parametrize("case", CASES)
def test_an_old_checkpoint_gives_its_old_outputs(case):
    expected = load_file(FIXTURES / case / "expected.safetensors")
    model = AUTO[case.split("-")[1]].from_pretrained(FIXTURES / case).eval()
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-6)


_REMOTE = BLOCK_PERFORMER_HF + textwrap.dedent(
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    folder, head = sys.argv[1], sys.argv[2]
    auto = AutoModelForMaskedLM if head == "mlm" else AutoModelForCausalLM
    model = auto.from_pretrained(folder, trust_remote_code=True).eval()
    expected = load_file(f"{folder}/expected.safetensors")
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).logits
    print("MAXDIFF", float((logits - expected["logits"]).abs().max()), type(model).__module__)
    """
)


@pytest.mark.parametrize("case", ["favor-clm", "hybrid-mlm"])
def test_an_old_checkpoint_loads_with_its_own_remote_code(case, tmp_path):
    """Without performer_hf importable, the checkpoint's own (old) code reproduces its outputs."""
    folder = shutil.copytree(FIXTURES / case, tmp_path / case)
    for source in REMOTE_CODE.glob("*.py"):
        shutil.copy(source, folder)
    argv = [sys.executable, "-c", _REMOTE, str(folder), case.split("-")[1]]
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    diff, module = result.stdout.split("MAXDIFF", 1)[1].split()
    assert module.startswith("transformers_modules.") and float(diff) <= 1e-6
