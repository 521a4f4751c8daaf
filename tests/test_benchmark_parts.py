"""Parts of benchmarks/ that the --quick smoke runs (tests/test_studies.py) do not reach: the harness's peak-memory
probe, and the model_speed.py arms that a quick run leaves out."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, harness
from performer_hf.cpu_memory import retain_freed_memory

assert retain_freed_memory()  # freed blocks stay in the heap: what an earlier arm leaves for a later one
for _ in range(3):  # 64 MiB allocated, touched and freed into the heap (the heap may grow twice: small objects
    torch.ones(64 << 18)  # can land in the freed block's start)

def extra(release_freed):  # a block that needs 32 MiB: the heap's free memory holds it
    with harness.PeakMemory(release_freed=release_freed) as memory:
        torch.ones(32 << 18)
    return {"mb": memory.extra / 2**20, "method": memory.method}

print(json.dumps({"kept": extra(False), "released": extra(True)}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/clear_refs and glibc's malloc_trim")
def test_released_freed_memory_counts_again_in_the_peak():
    """With ``release_freed``, a block that reuses memory an earlier block freed (and the heap kept) still counts it;
    without, it does not, which made model_speed.py's CPU peaks depend on the arms run before. In a fresh interpreter:
    the allocator setting that keeps freed memory is process-wide."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(BENCHMARKS)], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["kept"]["mb"] < 8, result  # the block reused freed memory: the resident set did not grow
    assert 30 <= result["released"]["mb"] < 48, result  # given back first, the block's 32 MiB count again
    assert "malloc_trim" in result["released"]["method"] and "malloc_trim" not in result["kept"]["method"]


@pytest.fixture
def model_speed(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import model_speed

    return model_speed


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_every_setting_arm_of_model_speed_converts(kind, model_speed, tmp_path):
    """The arms that are settings of the default conversion (exact, approximation, tiled), which a quick run leaves
    out: the decoder's exact arm asked for accelerator_exact_max_length, which causal models refuse, and a full run
    died there after the encoder's hour, writing nothing."""
    arms = ["exact", "approximation"] + (["tiled"] if kind == "encoder" else [])
    models = model_speed.build_models(kind, 64, arms, tmp_path, vocabulary=model_speed.QUICK_VOCABULARY)
    assert sorted(models) == sorted(arms)
    assert models["exact"].config.exact_max_length >= 1 << 30 and models["approximation"].config.exact_max_length == 0


def test_model_speed_writes_each_result_as_it_comes(model_speed, tmp_path, monkeypatch):
    """A run stopped part-way (here its second timing fails; on the device, a time limit or the OOM killer) leaves its
    JSON and Markdown with the results measured before, marked partial; the finished run's files say nothing of it.
    Before, the harness wrote only at the end: a stopped run left nothing."""
    import harness  # (on the path model_speed's fixture puts benchmarks/ on)

    argv = ["--quick", "--models", "encoder", "--arms", "sdpa", "favor", "--out-dir", str(tmp_path)]
    (tmp_path / "model_speed.png").write_bytes(b"an earlier run's figure")
    time_arms, calls = model_speed.time_arms, []

    def stopped_at_the_second(steps, reps):
        calls.append(sorted(steps))
        if len(calls) == 2:
            raise KeyboardInterrupt("stopped")  # (a time limit's SIGTERM ends the process where it stands)
        return time_arms(steps, reps)

    monkeypatch.setattr(model_speed, "time_arms", stopped_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        model_speed.main(argv)
    partial = json.loads((tmp_path / "model_speed.json").read_text())
    assert partial["partial"] is True and "load_average" in partial["environment"]
    assert {(r["arm"], r["mode"]) for r in partial["results"]} == {("sdpa", "train"), ("favor", "train")}
    assert all(r["median_s"] > 0 for r in partial["results"])
    text = (tmp_path / "model_speed.md").read_text()
    assert "Partial results" in text
    train, inference = text.split("## encoder, train")[1].split("## encoder, inference")
    assert re.search(r"\| 128 \| \d+ \| \d+\.\d+ \| \d+\.\d+ \|", train) and "| 128 | - |" not in train, text
    assert "| 128 | 1 | - | - | - |" in inference, text  # not measured: no times
    assert not (tmp_path / "model_speed.png").exists()  # the earlier figure is gone; the finished run draws its own
    assert not harness._measuring  # the harness holds no study once the run has ended, even by an exception

    monkeypatch.setattr(model_speed, "time_arms", time_arms)
    model_speed.main(argv)
    finished = json.loads((tmp_path / "model_speed.json").read_text())
    assert "partial" not in finished and len(finished["results"]) == 4
    assert "Partial results" not in (tmp_path / "model_speed.md").read_text()
    assert (tmp_path / "model_speed.png").exists() and not list(tmp_path.glob("*.tmp"))
