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


@pytest.mark.studies
@pytest.mark.parametrize("study", STUDIES)
def test_the_study_runs_quick(study, study_server, tmp_path):
    out_dir, log_dir = tmp_path / "out", tmp_path
    out_dir.mkdir()
    argv = [str(BENCHMARKS / f"{study}.py"), "--quick", "--out-dir", str(out_dir)]
    request = {"argv": argv, "cwd": str(out_dir), "log_dir": str(log_dir), "timeout_s": TIMEOUT_S}
    study_server.stdin.write(json.dumps(request) + "\n")
    study_server.stdin.flush()
    answer = study_server.stdout.readline()
    assert answer, f"the study server ended (exit {study_server.poll()}) before it answered"
    answer = json.loads(answer)
    stderr = (log_dir / "stderr.txt").read_text()
    assert not answer["timed_out"], f"{study} --quick hung: it had not ended after {TIMEOUT_S} s\n{stderr[-4000:]}"
    assert answer["returncode"] == 0, f"{study} --quick failed:\n{stderr[-4000:]}"
    if study != "profile_attention":  # a diagnostic that prints and writes nothing
        written = {path.suffix for path in out_dir.iterdir()}
        assert {".json", ".md", ".png"} <= written, f"{study} wrote {sorted(written)}"


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
