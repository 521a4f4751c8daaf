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


# argv = ids file (torch.save), report file, folders...; the report (torch.save), one entry per folder: the model's
# class and module, greedy generation's tokens and logits at each step (the first: the prompt's last position), and
# its cache: the layers' classes and the bytes held. Each model is then saved to <report file>.saved/<index>.
_DECODE_SCRIPT = BLOCK_PERFORMER_HF + textwrap.dedent(
    """
    import importlib
    import torch
    from transformers import AutoModelForCausalLM

    ids_file, report_file, *folders = sys.argv[1:]
    ids = torch.load(ids_file)
    reports = []
    for index, folder in enumerate(folders):
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        bundle = type(model).__module__.rsplit(".", 1)[0]  # the folder's modules, as transformers imported them
        held_bytes = importlib.import_module(bundle + ".cache_performer").held_bytes
        generated = model.generate(
            ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        cache = getattr(generated, "cache", None) or generated.past_key_values
        reports.append({
            "class": type(model).__module__ + "." + type(model).__name__,
            "sequences": generated.sequences,
            "step_logits": torch.stack(generated.logits),
            "cache_layers": [type(layer).__name__ for layer in cache.layers],
            "cache_bytes": held_bytes(cache),
            "leaked": sorted(name for name in sys.modules if name.startswith("performer_hf")),
        })
        model.save_pretrained(f"{report_file}.saved/{index}")  # a loaded folder saves its code again
    torch.save(reports, report_file)
    """
)


def decode_without_performer_hf(folders: list[Path], ids: torch.Tensor, work: Path) -> list[dict]:
    """Load each causal LM of ``folders`` with trust_remote_code, offline, in one process without performer_hf; run
    it on ``ids``: greedily generate 4 tokens with plain ``generate()``, then save it to ``<work>/report.saved/<i>``.
    Returns the reports of ``_DECODE_SCRIPT``, in the order of ``folders``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(work / "modules"), OMP_NUM_THREADS="1")
    torch.save(ids, work / "ids.pt")
    argv = [sys.executable, "-c", _DECODE_SCRIPT, str(work / "ids.pt"), str(work / "report"), *map(str, folders)]
    result = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(work / "report")


def decode_with_performer_hf(model, ids: torch.Tensor) -> dict:
    """What ``decode_without_performer_hf`` reports, for ``model`` run here (performer_hf imported)."""
    from performer_hf import held_bytes

    generated = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    cache = getattr(generated, "cache", None) or generated.past_key_values
    return {
        "sequences": generated.sequences,
        "step_logits": torch.stack(generated.logits),
        "cache_layers": [type(layer).__name__ for layer in cache.layers],
        "cache_bytes": held_bytes(cache),
    }
