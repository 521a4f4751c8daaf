"""Every study of benchmarks/ still runs: its ``--quick`` configuration (a smoke test whose figures say nothing),
in a fresh process, writing into a temporary folder so that the committed results stay as they are. A study that
no longer runs against the current code fails here, not when someone next needs its figures. The runs go two at a
time, each on one thread (most of a smoke run is one thread's imports and Python: on two cores, 280 s in all where
one after the other on two threads took 370 s), the longest first; CI runs them against the newest transformers of
the range (``-m "not studies"`` leaves them out, as scripts/test.sh does for the oldest)."""

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
NOT_STUDIES = {
    "harness": "what the studies share",
    "passkey": "the pass-key task of the retrieval studies",
    "kvpress_anchor": "runs in an environment of its own (kvpress 0.5.5 needs transformers < 5.3): tested below",
}
STUDIES = sorted(path.stem for path in BENCHMARKS.glob("*.py") if path.stem not in NOT_STUDIES)


def test_every_study_is_listed():
    assert len(STUDIES) >= 13 and "model_speed" in STUDIES and "llm_linearization" in STUDIES


# the longest smoke runs (about 25 to 80 s each), started first so that the two at a time end together
LONGEST = ("llm_linearization", "model_speed", "long_context_retrieval", "long_documents", "compat_sentiment")


def _run_quick(study: str, out_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(BENCHMARKS / f"{study}.py"), "--quick", "--out-dir", str(out_dir)]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=out_dir)


@pytest.fixture(scope="module")
def quick_runs(request, tmp_path_factory):
    """The selected studies' quick runs, started two at a time: {study: (future result, its output folder)}."""
    selected = {item.callspec.params["study"] for item in request.session.items if "quick_runs" in item.fixturenames}
    order = [study for study in LONGEST if study in selected] + sorted(selected - set(LONGEST))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = {}
        for study in order:
            out_dir = tmp_path_factory.mktemp(study)
            runs[study] = pool.submit(_run_quick, study, out_dir), out_dir
        yield runs
        for future, _ in runs.values():
            future.cancel()


@pytest.mark.studies
@pytest.mark.parametrize("study", STUDIES)
def test_the_study_runs_quick(study, quick_runs):
    future, out_dir = quick_runs[study]
    result = future.result()
    assert result.returncode == 0, f"{study} --quick failed:\n{result.stderr[-4000:]}"
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
