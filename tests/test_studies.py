"""Every study of benchmarks/ still runs: its ``--quick`` configuration (a smoke test whose figures say nothing),
in a process of its own on one thread (forked from tests/study_server.py, which has made the imports they share),
writing into a temporary folder so that the committed results stay as they are. A study that no longer runs against
the current code fails here, not when someone next needs its figures. CI runs them against the newest transformers of
the range (``-m "not studies"`` leaves them out, as scripts/test.sh does for the oldest); under pytest-xdist they are
the session's first tests, the longest first (tests/conftest.py), so that the workers share them and end together."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
NOT_STUDIES = {
    "harness": "what the studies share",
    "passkey": "the pass-key task of the retrieval studies",
    # its report is tested below
    "kvpress_anchor": "runs in an environment of its own (kvpress 0.5.5 needs transformers < 5.3)",
}
STUDIES = sorted(path.stem for path in BENCHMARKS.glob("*.py") if path.stem not in NOT_STUDIES)
TIMEOUT_S = 900  # a smoke run that has not ended by then hangs


def test_every_study_is_listed():
    assert len(STUDIES) >= 13 and "model_speed" in STUDIES and "llm_linearization" in STUDIES


@pytest.fixture(scope="session")
def study_server():
    """tests/study_server.py, for this session (this pytest-xdist worker): the smoke runs' processes fork from it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(Path(__file__).with_name("study_server.py")), str(BENCHMARKS)]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) as server:
        yield server
        server.stdin.close()  # the end of its input ends it


def _run_in_server(server, argv: list[str], cwd: Path, log_dir: Path, timeout_s: float) -> dict:
    """``argv`` run by tests/study_server.py: its answer, ``{"returncode", "timed_out"}``."""
    request = {"argv": argv, "cwd": str(cwd), "log_dir": str(log_dir), "timeout_s": timeout_s}
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    answer = server.stdout.readline()
    assert answer, f"the study server ended (exit {server.poll()}) before it answered"
    return json.loads(answer)


@pytest.mark.studies
@pytest.mark.parametrize("study", STUDIES)
def test_the_study_runs_quick(study, study_server, tmp_path):
    out_dir, log_dir = tmp_path / "out", tmp_path
    out_dir.mkdir()
    argv = [str(BENCHMARKS / f"{study}.py"), "--quick", "--out-dir", str(out_dir)]
    answer = _run_in_server(study_server, argv, out_dir, log_dir, TIMEOUT_S)
    stderr = (log_dir / "stderr.txt").read_text()
    assert not answer["timed_out"], f"{study} --quick hung: it had not ended after {TIMEOUT_S} s\n{stderr[-4000:]}"
    assert answer["returncode"] == 0, f"{study} --quick failed:\n{stderr[-4000:]}"
    if study != "profile_attention":  # a diagnostic that prints and writes nothing
        written = {path.suffix for path in out_dir.iterdir()}
        assert {".json", ".md", ".png"} <= written, f"{study} wrote {sorted(written)}"


@pytest.mark.studies
def test_model_speeds_decoding_part_runs_quick(study_server, tmp_path):
    """``model_speed.py --part decode`` (the GPU check's decoding times), on the decoder: a row per arm, finite."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    argv = [str(BENCHMARKS / "model_speed.py"), "--quick", "--part", "decode", "--models", "decoder", "--out-dir"]
    answer = _run_in_server(study_server, [*argv, str(out_dir)], out_dir, tmp_path, TIMEOUT_S)
    assert answer["returncode"] == 0, (tmp_path / "stderr.txt").read_text()[-4000:]
    results = json.loads((out_dir / "model_speed_decode.json").read_text())["results"]
    assert {r["arm"] for r in results} == {"sdpa", "hybrid", "favor", "sparse", "bound"}
    assert all(r["mode"] == "decode" and r["median_s"] > 0 and r["finite"] for r in results)


@pytest.mark.studies
def test_the_study_server_reports_failures_and_ends_hung_runs_with_what_they_started(study_server, tmp_path):
    """What the smoke tests rely on: a script's exit status, its own arguments and output, and a run past its time
    killed with the processes it started (a smoke run that hung would otherwise hold the suite)."""
    script = tmp_path / "study.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "print('arguments', sys.argv[1:])\n"
        "print('to stderr', file=sys.stderr)\n"
        "if sys.argv[1] == 'hang':\n"
        "    open('child.pid', 'w').write(str(subprocess.Popen(['sleep', '60']).pid))\n"
        "    time.sleep(60)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    for code in (0, 3):
        answer = _run_in_server(study_server, [str(script), str(code)], tmp_path, tmp_path, 60)
        assert answer == {"returncode": code, "timed_out": False}
        assert (tmp_path / "stdout.txt").read_text() == f"arguments ['{code}']\n"
        assert (tmp_path / "stderr.txt").read_text() == "to stderr\n"
    start = time.monotonic()
    answer = _run_in_server(study_server, [str(script), "hang"], tmp_path, tmp_path, 2)
    assert answer == {"returncode": -9, "timed_out": True} and time.monotonic() - start < 30
    # the process it started is gone with its group, not left running: no longer there, or dead and not yet reaped
    stat = Path(f"/proc/{(tmp_path / 'child.pid').read_text()}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_the_pass_key_prompts_have_their_length_and_the_same_keys_everywhere():
    """passkey.py, shared by long_context_retrieval.py and kvpress_anchor.py: prompts of the asked length (to a few
    tokens: text decoded and encoded again) with the key at its depth, the same keys for a seed."""
    sys.path.insert(0, str(BENCHMARKS))
    import passkey
    from transformers import AutoTokenizer

    from performer_hf.data_assets import bbc_news
    from performer_hf.model_assets import smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    filler = passkey.filler_tokens(tokenizer, bbc_news()["test"][:40])
    trials = passkey.trials([512, 1024], 3, seed=0)
    assert trials == passkey.trials([512, 1024], 3, seed=0) and [d for d, _ in trials[512]] == [0.0, 0.5, 1.0]
    for length, settings in trials.items():
        for depth, key in settings:
            text = passkey.prompt(tokenizer, filler, length, depth, key)
            assert abs(len(tokenizer(text)["input_ids"]) - length) <= 8
            assert text.startswith(passkey.HEADER) and text.endswith(passkey.QUESTION)
            where = text.index(f"The pass key is {key}") / len(text)
            assert abs(where - depth) < 0.1


def test_the_kvpress_anchor_matches_the_study_cache_sizes_and_reports_each_press():
    sys.path.insert(0, str(BENCHMARKS))
    import kvpress_anchor

    rows = {"4096": [{"cache_bytes": 10}, {"cache_bytes": 12}], "8184": [{"cache_bytes": 20}]}
    study = {
        "arms": {
            "source": {"passkey": {"4096": [{"cache_bytes": 48}], "8184": [{"cache_bytes": 100}]}},
            "latest-16": {"passkey": rows},
        }
    }
    assert kvpress_anchor._fractions(study, "latest-16") == {4096: 0.25, 8184: 0.2}
    found = [{"length": 4096, "found": True}, {"length": 4096, "found": False}, {"length": 8184, "found": True}]
    payload = {
        "transformers": "5.2.0",
        "kvpress": "0.5.5",
        "lengths": [4096, 8184],
        "runs": [{"press": "snapkv", "arm": "latest-16", "fractions": {"4096": 0.25, "8184": 0.2}, "rows": found}],
    }
    text = kvpress_anchor.markdown(payload)
    assert (
        "| snapkv | latest-16 | 4096 | 25.0% | 1/2 |" in text and "| snapkv | latest-16 | 8184 | 20.0% | 1/1 |" in text
    )
