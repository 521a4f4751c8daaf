"""Parts of benchmarks/ that the --quick smoke runs (tests/test_studies.py) do not reach: the harness's peak-memory
probe, the model_speed.py arms that a quick run leaves out, the shared and the studies' flags (bad ones end before any
measurement) and the work folder of llm_linearization.py on a failed run."""

import importlib
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
MODEL_KINDS = ["encoder", "decoder", "llama"]  # model_speed.py's

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


def test_model_speed_runs_when_its_first_arm_does_not_apply_to_the_model(model_speed, tmp_path, monkeypatch):
    """``--models encoder --arms sparse favor`` ended in ``KeyError: 'sparse'`` once the models were built (the batch's
    vocabulary was read from the first arm's model, which the encoder skips): a multi-model run died there. (The models
    are built and each step runs once; the timing is not this test's.)"""

    def run_once(steps, reps):
        for step in steps.values():
            step.work()
        return {arm: {"median_s": 1.0, "finite": step.finite} for arm, step in steps.items()}

    monkeypatch.setattr(model_speed, "time_arms", run_once)
    flags = "--quick --models encoder --arms sparse favor --lengths 64 --out-dir".split()
    payload = model_speed.main([*flags, str(tmp_path)])
    assert {(r["arm"], r["mode"]) for r in payload["results"]} == {("favor", "train"), ("favor", "inference")}
    assert all(r["finite"] for r in payload["results"]) and (tmp_path / "model_speed.png").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--models", "encoder", "--arms", "sparse"], "--arms sparse: none of them runs on the encoder model"),
        (["--models", "decoder", "llama", "--arms", "tiled"], "--arms tiled: none of them runs on the decoder model"),
        (["--models", "llama", "--arms", "exact", "bound"], "none of them runs on the llama model"),
        (["--models", "encoder", "--arms", "flash"], "--arms flash: none of them runs on the encoder model on cpu"),
        (["--part", "attention", "--arms", "sdpa_fused"], "--arms sdpa_fused: none of them runs on the encoder"),
        (["--part", "decode", "--models", "encoder"], "the encoder does not decode: pass --models decoder llama"),
        (["--part", "attention", "--models", "llama"], "has not: pass --models encoder decoder"),
        (["--device", "cuda"], "--device cuda: torch finds no CUDA device here"),
    ],
)
def test_model_speed_refuses_flags_that_cannot_run_together(flags, message, model_speed, tmp_path, capsys, monkeypatch):
    """Before, these measured nothing or crashed late: ``--part decode --models encoder`` wrote a JSON and an empty
    Markdown, then its plot failed (no rows); ``--part attention --models llama`` raised a ValueError traceback, and
    ``--device cuda`` without CUDA torch's "Found no NVIDIA driver"; an arm list no arm of which the model runs, a
    KeyError after building the models (``--part attention --arms sdpa_fused``: a run that timed nothing). Now each
    is a usage error before any model is built."""
    if flags[0] == "--device" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    monkeypatch.setattr(model_speed, "measure", _stop_measuring)
    with pytest.raises(SystemExit) as stopped:
        model_speed.main([*flags, "--out-dir", str(tmp_path)])
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and message in error, error
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "part, models", [("model", MODEL_KINDS), ("decode", ["decoder", "llama"]), ("attention", MODEL_KINDS[:2])]
)
def test_model_speeds_default_models_are_those_its_part_runs(part, models, model_speed, tmp_path, monkeypatch):
    """``--part attention`` with the default models raised its ValueError at llama, after the encoder and decoder."""
    monkeypatch.setattr(model_speed, "measure", _stop_measuring)
    with pytest.raises(_Measuring) as measuring:
        model_speed.main(["--part", part, "--out-dir", str(tmp_path)])
    assert measuring.value.args[0].models == models


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (main() sets it where unset)
    import harness

    return harness


def _study(harness, measured: list, **options):
    """A study in the harness that measures nothing: its flags, measure (which records its settings), markdown, plot."""
    arguments = harness.parser("A study of nothing.", quick="2 steps", **options)
    arguments.add_argument("--steps", type=harness.at_least(1), default=8)
    arguments.add_argument("--contexts", type=harness.at_least(1), nargs="+", default=[64, 128])

    def measure(args):
        measured.append(dict(vars(args)))
        return {"summary": {"steps": args.steps}}

    def markdown(payload):
        return f"# {payload['summary']['steps']} steps\n"

    return arguments, measure, markdown, lambda payload: harness.pyplot().figure()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "argument --steps: expected a whole number >= 1, got 0"),
        (["--contexts", "64", "-1"], "argument --contexts: expected a whole number >= 1, got -1"),
        (["--steps", "two"], "argument --steps: expected a whole number, got 'two'"),
        (["--threads", "-1"], "argument --threads: expected a whole number >= 0, got -1"),
        (["--out-dir", "{file}"], "{file} is a file, not a folder"),
        (["--out-dir", "{file}/results"], "{file} is a file, not a folder"),
        (["--from-json", "{tmp}/missing.json"], "--from-json {tmp}/missing.json: No such file or directory"),
        (["--from-json", "{file}"], "--from-json {file}: not JSON"),
        (["--from-json", "{list}"], "--from-json {list}: holds a JSON list"),
        (["--from-json", "{other}"], "--from-json {other}: not nothing's JSON (no 'summary' in it)"),
    ],
)
def test_bad_flags_end_in_a_usage_error_before_measuring(flags, message, harness, tmp_path, capsys):
    """Before, these ended in tracebacks, the bad --out-dir only after the whole measurement (which was lost), a bad
    count often at its end (statistics of no steps); now each is one usage line that names the flag or the file."""
    paths = {"tmp": tmp_path, "file": tmp_path / "a-file", "list": tmp_path / "list.json", "other": tmp_path / "o.json"}
    paths["file"].write_text("not JSON")
    paths["list"].write_text("[1, 2]")
    paths["other"].write_text(json.dumps({"results": []}))  # another study's JSON
    measured = []
    arguments, measure, markdown, plot = _study(harness, measured, threads=1)
    argv = [flag.format(**paths) for flag in flags]
    out_dir = [] if "--out-dir" in flags else ["--out-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as stopped:
        harness.main("nothing", arguments, measure, markdown, plot, argv=[*argv, *out_dir])
    assert stopped.value.code == 2 and not measured
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.format(**paths) in error and "Traceback" not in error, error
    assert not (tmp_path / "out" / "nothing.md").exists()


def test_flags_given_with_quick_win_over_its_settings(harness, tmp_path):
    """--quick sets the study's quick flags where they are not given: before, the study overwrote the flags given with
    its quick settings (``decode.py --quick --contexts 0`` ran contexts 256 2048, without a word)."""
    measured = []
    study = _study(harness, measured, quick_flags={"steps": 2, "contexts": [8, 16]})
    assert "it sets --steps 2 --contexts 8 16 where they are not given" in " ".join(study[0].format_help().split())
    out = ["--out-dir", str(tmp_path)]
    harness.main("nothing", *study, argv=["--quick", *out])
    harness.main("nothing", *study, argv=["--quick", "--contexts", "32", *out])
    harness.main("nothing", *study, argv=["--contexts", "32", *out])
    assert [(run["steps"], run["contexts"]) for run in measured] == [(2, [8, 16]), (2, [32]), (8, [32])]
    assert all("quick_flags" not in run for run in measured)

    misspelt = _study(harness, [], quick_flags={"step": 2})
    with pytest.raises(ValueError, match=r"quick flags \['step'\] are none of its flags"):
        harness.main("nothing", *misspelt, argv=["--quick", *out])


def test_a_quick_run_without_out_dir_leaves_the_committed_results(harness, tmp_path, monkeypatch, caplog):
    """``decode.py --quick`` without ``--out-dir`` replaced the committed decode.json, .md and .png with its smoke
    figures, without a word; now a quick run writes to a new temporary folder, which it logs, and only a full run
    writes to benchmarks/results/ by default."""
    results, temporary = tmp_path / "results", tmp_path / "temporary"
    temporary.mkdir()
    monkeypatch.setattr(harness, "RESULTS", results)  # (before the parser: the default it gave was fixed there)
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    study = _study(harness, [], quick_flags={"steps": 2})
    with caplog.at_level("INFO", logger="benchmarks.harness"):
        harness.main("nothing", *study, argv=["--quick"])
    assert not results.exists()
    (written,) = temporary.iterdir()
    assert sorted(path.name for path in written.iterdir()) == ["nothing.json", "nothing.md", "nothing.png"]
    assert f"writing to {written}" in caplog.text
    harness.main("nothing", *study, argv=[])  # a full run: the committed results, as before
    assert (results / "nothing.md").read_text() == "# 8 steps\n" and len(list(temporary.iterdir())) == 1


class _Measuring(Exception):
    """Raised by a stand-in ``measure`` with the settings it was given: the study stops there."""


def _stop_measuring(args):
    raise _Measuring(args)


@pytest.mark.parametrize(
    "study, flags, message",
    [
        ("approximation", ["--seeds", "0"], "argument --seeds: expected a whole number >= 1, got 0"),
        ("decode", ["--steps", "0"], "argument --steps: expected a whole number >= 2, got 0"),
        ("decode", ["--steps", "1"], "argument --steps: expected a whole number >= 2, got 1"),
        ("decode", ["--quick", "--contexts", "0"], "argument --contexts: expected a whole number >= 1, got 0"),
        ("decode", ["--warmup", "-1"], "argument --warmup: expected a whole number >= 0, got -1"),
        ("approximation_quality", ["--docs", "2"], "argument --docs: expected a whole number >= 3, got 2"),
    ],
)
def test_studies_refuse_bad_counts(study, flags, message, harness, tmp_path, capsys, monkeypatch):
    """``approximation.py --seeds 0`` and ``decode.py --steps 0`` (or 1: its p10-p90 band) ended in a StatisticsError
    after the measurement; ``--quick`` hid a bad ``--contexts`` by overwriting it."""
    module = importlib.import_module(study)
    monkeypatch.setattr(module, "measure", _stop_measuring)
    with pytest.raises(SystemExit) as stopped:
        module.main([*flags, "--out-dir", str(tmp_path)])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_decode_quick_keeps_the_contexts_given(harness, tmp_path, monkeypatch):
    import decode

    monkeypatch.setattr(decode, "measure", _stop_measuring)
    with pytest.raises(_Measuring) as measuring:
        decode.main(["--quick", "--contexts", "512", "--out-dir", str(tmp_path)])
    args = measuring.value.args[0]
    assert args.contexts == [512] and (args.steps, args.rounds) == (16, 2)


def test_approximation_quality_counts_a_nan_figure_as_a_miss(harness, tmp_path, monkeypatch):
    """With 2 documents (the quick run's) the docs' pairwise Spearman is NaN (one pair), and ``select`` counted it as
    meeting the 0.95 floor (``nan < 0.95`` is False): a method could be picked on a figure that was never measured.
    Now --docs takes at least 3 (the quick run 3), and a figure that is not finite misses its floor."""
    import approximation_quality

    quality = {"mean_cosine": 0.99, "pairwise_spearman": 0.99}
    entry = {
        "sentences": quality,
        "docs": {**quality, "pairwise_spearman": math.nan},
        "speed": {"attention_speedup": 3},
    }
    summary = {"nan docs": {"256": entry}, "measured": {"256": {**entry, "docs": quality}}}
    selection = approximation_quality.select(summary)
    assert selection["best"] == "measured" and selection["passing"] == ["measured"]
    assert selection["misses"]["nan docs"] == ["pairwise_spearman nan < 0.95 (docs)"]
    no_speed = {"nan speed": {"256": {**entry, "docs": quality, "speed": {"attention_speedup": math.nan}}}}
    assert approximation_quality.select(no_speed)["best"] is None

    monkeypatch.setattr(approximation_quality, "measure", _stop_measuring)
    with pytest.raises(_Measuring) as measuring:
        approximation_quality.main(["--quick", "--out-dir", str(tmp_path)])
    assert measuring.value.args[0].docs == 3


@pytest.fixture
def llm_linearization(harness):
    import llm_linearization

    return llm_linearization


@pytest.mark.parametrize("flags", [["--transfer-steps", "0"], ["--transfer-steps", "-3"], ["--decode-contexts", "0"]])
def test_llm_linearization_refuses_bad_counts(flags, llm_linearization, capsys):
    """``--transfer-steps 0`` was a ConversionError traceback after 37 s of work (the source scored, the zero-shot
    conversion made and scored)."""
    with pytest.raises(SystemExit) as stopped:
        llm_linearization.arguments().parse_args(flags)
    assert stopped.value.code == 2 and f"argument {flags[0]}: expected a whole number >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("stop", [RuntimeError("a failed stage"), KeyboardInterrupt()])
def test_llm_linearization_removes_its_work_folder_however_it_ends(stop, llm_linearization, tmp_path, monkeypatch):
    """The temporary work folder (a converted SmolLM2 is 530 MB) was removed only after a finished run: a failure or
    Ctrl-C left it in /tmp. Here the first model load fails, after the folder is made."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the study's temporary folder goes
    monkeypatch.setattr(llm_linearization, "smollm2_checkpoint", lambda: tmp_path / "smollm2")
    monkeypatch.setattr(llm_linearization, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda folder: None))
    monkeypatch.setattr(llm_linearization, "python_docs", lambda: [])
    monkeypatch.setattr(llm_linearization, "_tokens", lambda tokenizer, texts: torch.zeros(1, 4096, dtype=torch.long))
    monkeypatch.setattr(llm_linearization, "_docstrings_file", lambda work: work / "docstrings.jsonl")
    folders = []

    def load_arm(*args, **kwargs):
        folders.extend(tmp_path.glob("llm-linearization-*"))
        raise stop

    monkeypatch.setattr(llm_linearization, "load_arm", load_arm)
    args = llm_linearization.arguments().parse_args(["--quick"])
    with pytest.raises(type(stop)):
        llm_linearization.measure(args)
    assert len(folders) == 1  # made where this test looks
    assert not list(tmp_path.glob("llm-linearization-*"))
