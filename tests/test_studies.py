"""Every study of benchmarks/ still runs: its ``--quick`` configuration (a smoke test whose figures say nothing),
in a fresh process, writing into a temporary folder so that the committed results stay as they are. A study that
no longer runs against the current code fails here, not when someone next needs its figures. About seven minutes
in all on two CPU cores; CI runs them against the newest transformers of the range (``-m "not studies"`` leaves them
out, as scripts/test.sh does for the oldest)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
STUDIES = sorted(path.stem for path in BENCHMARKS.glob("*.py") if path.stem != "harness")


def test_every_study_is_listed():
    assert len(STUDIES) >= 13 and "model_speed" in STUDIES and "llm_linearization" in STUDIES


@pytest.mark.studies
@pytest.mark.parametrize("study", STUDIES)
def test_the_study_runs_quick(study, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(BENCHMARKS / f"{study}.py"), "--quick", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert result.returncode == 0, f"{study} --quick failed:\n{result.stderr[-4000:]}"
    if study != "profile_attention":  # a diagnostic that prints and writes nothing
        written = {path.suffix for path in tmp_path.iterdir()}
        assert {".json", ".md", ".png"} <= written, f"{study} wrote {sorted(written)}"
