"""Loading saved checkpoints through Hub remote code (trust_remote_code) in a fresh Python process in which
performer_hf cannot be imported, as a user without the package would."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

# The start of every script these tests run by `python -c`: performer_hf cannot be imported in that process.
BLOCK_PERFORMER_HF = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class BlockPerformerHF(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "performer_hf":
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")

    sys.meta_path.insert(0, BlockPerformerHF())
    """
)

# argv = causal folder, masked-LM folder, JSON ids; prints REPORT{json}
_SCRIPT = BLOCK_PERFORMER_HF + textwrap.dedent(
    """
    try:
        import performer_hf  # noqa: F401
        raise SystemExit("performer_hf is still importable")
    except ModuleNotFoundError:
        pass

    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    causal_dir, mlm_dir, ids = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
    report = {"config": type(AutoConfig.from_pretrained(causal_dir, trust_remote_code=True)).__module__}
    causal = AutoModelForCausalLM.from_pretrained(causal_dir, trust_remote_code=True).eval()
    mlm = AutoModelForMaskedLM.from_pretrained(mlm_dir, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(mlm_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        report["causal_logits"] = causal(input_ids=ids).logits.tolist()
        report["mlm_logits"] = mlm(input_ids=ids).logits.tolist()
        report["base_hidden"] = base(input_ids=ids).last_hidden_state.tolist()
    report["generated"] = causal.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()
    report["classes"] = [type(m).__module__ + "." + type(m).__name__ for m in (causal, mlm, base)]
    report["leaked"] = sorted(name for name in sys.modules if name.startswith("performer_hf"))
    print("REPORT" + json.dumps(report))
    """
)


def load_without_performer_hf(tmp_path: Path, ids: torch.Tensor) -> dict:
    """Load ``tmp_path/causal`` (a causal LM) and ``tmp_path/mlm`` (a masked LM) with trust_remote_code, offline, in
    a process without performer_hf, and run them on ``ids``. Returns the report: the config's and models' modules,
    the causal and masked-LM logits, the base model's hidden states, 6 greedy tokens from the causal LM, and the
    performer_hf modules that leaked into the process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    folders = [str(tmp_path / "causal"), str(tmp_path / "mlm")]
    argv = [sys.executable, "-c", _SCRIPT, *folders, json.dumps(ids.tolist())]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.split("REPORT", 1)[1])
