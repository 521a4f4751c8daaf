"""The ``performer-hf`` command line: conversion, Hub ids through the local cache, every error path
(exit status, one-line message, no traceback, no leftover folder) and the demo."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForTokenClassification

from performer_hf.cli import main
from performer_hf.conversion import ConversionError, demo
from performer_hf.conversion.convert import METHODS
from performer_hf.conversion.source import resolve_source

from .conversion_sources import CASES, TINY_BERT, save_source

BERT_MLM = next(case for case in CASES if case.name == "bert-mlm")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli") / "tiny-bert"
    save_source(BERT_MLM, folder)
    return folder


def copy_source(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "source"
    shutil.copytree(folder, target)
    return target


def assert_failed_cleanly(code: int, capsys, out: Path, message: str) -> None:
    """Exit status 1, a one-line message naming the cause, and no output or staging folder left."""
    captured = capsys.readouterr()
    assert code == 1
    error_lines = captured.err.strip().splitlines()
    assert len(error_lines) == 1 and error_lines[0].startswith("performer-hf: error: ")
    assert message in error_lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_convert_command(tiny_bert, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "convert",
            str(tiny_bert),
            str(out),
            "--nb-features",
            "16",
            "--set",
            "hidden_dropout_prob=0.0",
            "--feature-redraw-interval",
            "100",
            "--base-model",
            "org/tiny-bert",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.strip().splitlines()[-1] == str(out)
    assert "attention rel. error" in captured.out  # the fidelity table is printed
    config = json.loads((out / "config.json").read_text())
    assert (config["nb_features"], config["hidden_dropout_prob"], config["feature_redraw_interval"]) == (16, 0.0, 100)
    assert "redrawn every 100 optimizer steps" in (out / "README.md").read_text()


def _unsupported(folder: Path, tmp_path: Path) -> Path:
    source = tmp_path / "token-classification"
    BertForTokenClassification(BertConfig(**TINY_BERT)).save_pretrained(source)
    return source


def _no_weights(folder: Path, tmp_path: Path) -> Path:
    source = copy_source(folder, tmp_path)
    (source / "model.safetensors").unlink()
    return source


def _corrupt_weights(folder: Path, tmp_path: Path) -> Path:
    source = copy_source(folder, tmp_path)
    (source / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    return source


def _truncated_weights(folder: Path, tmp_path: Path) -> Path:
    source = copy_source(folder, tmp_path)
    data = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(data[: len(data) // 2])
    return source


def _edit_config(**changes):
    def make(folder: Path, tmp_path: Path) -> Path:
        source = copy_source(folder, tmp_path)
        config = json.loads((source / "config.json").read_text())
        config.update(changes)
        (source / "config.json").write_text(json.dumps(config))
        return source

    return make


def _bad_json(folder: Path, tmp_path: Path) -> Path:
    source = copy_source(folder, tmp_path)
    (source / "config.json").write_text("{not json")
    return source


def _missing_tensor(folder: Path, tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    source = copy_source(folder, tmp_path)
    state = load_file(source / "model.safetensors")
    del state["bert.encoder.layer.1.output.dense.weight"]
    save_file(state, source / "model.safetensors")
    return source


class Exploit:
    """Pickles to a call of os.system: loading it must be refused, never executed."""

    def __reduce__(self):
        return (os.system, (f"touch {Path(__file__).parent / 'PWNED'}",))


def _pickled_object(folder: Path, tmp_path: Path) -> Path:
    source = copy_source(folder, tmp_path)
    (source / "model.safetensors").unlink()
    torch.save(
        {"bert.embeddings.word_embeddings.weight": torch.zeros(99, 32), "x": Exploit()}, source / "pytorch_model.bin"
    )
    return source


ERROR_CASES = [
    ("unsupported", _unsupported, [], "'BertForTokenClassification' is not supported; supported: BertModel"),
    ("no-weights", _no_weights, [], "has no weights"),
    ("corrupt-weights", _corrupt_weights, [], "cannot read weights"),
    ("truncated-weights", _truncated_weights, [], "cannot read weights"),
    ("bad-config-json", _bad_json, [], "is not valid JSON"),
    ("fewer-layers-in-config", _edit_config(num_hidden_layers=1), [], "config.json does not match the weights"),
    ("shape-mismatch", _edit_config(intermediate_size=40), [], "has shape (37,) but config.json implies (40,)"),
    ("missing-tensor", _missing_tensor, [], "lacks tensors the converted model needs"),
    ("wrong-model-type", _edit_config(model_type="gpt2"), [], "needs 'bert'"),
    ("pickled-object", _pickled_object, [], "refusing to read"),
    ("unknown-field", None, ["--set", "nb_feature=3"], "unknown PerformerConfig field(s) ['nb_feature']"),
    ("fixed-field", None, ["--set", "hidden_size=64"], "fixed by the source weights"),
    ("invalid-kernel", None, ["--attention-kernel", "bogus"], "attention_kernel='bogus' is not supported"),
    ("bad-set-syntax", None, ["--set", "nb_features"], "--set expects FIELD=VALUE"),
    ("shrinking-positions", None, ["--max-position-embeddings", "8"], "can only grow"),
    # were: a kernel the user never gave refused; the --set value taken silently; --calibrate ignored silently
    ("method-set-as-field", None, ["--set", "attention_method=favor"], "convert with method='favor' (--method favor"),
    ("field-given-twice", None, ["--set", "nb_features=8", "--nb-features", "16"], "nb_features is given twice"),
    ("calibrate-favor", None, ["--method", "favor", "--calibrate"], "the favor method has none: leave it out"),
    ("calibrate-exact", None, ["--attention-kernel", "exact", "--calibrate"], "exact attention has none"),
    # was: ignored silently, the folder converted as it is
    ("revision-of-a-folder", None, ["--revision", "v1"], "--revision applies to Hub ids; check out that revision"),
    # was: the default encoder conversion "calibrated" its centres, which bidirectional attention never reads
    ("calibrate-encoder", None, ["--calibrate"], "encoders centre each sequence by its own means; --calibrate fits"),
    (
        "calibrate-set-a",
        None,
        ["--far-field", "softmax_opt", "--set", "far_field_parameter=-0.1", "--calibrate"],
        "which far_field_parameter already sets",
    ),
]


@pytest.mark.parametrize("make, options, message", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_errors_exit_cleanly(make, options, message, tiny_bert, tmp_path, capsys):
    source = make(tiny_bert, tmp_path) if make is not None else tiny_bert
    capsys.readouterr()  # what making the source printed (transformers' progress bars): not the command's
    out = tmp_path / "converted"
    code = main(["convert", str(source), str(out), "--no-fidelity", *options])
    assert_failed_cleanly(code, capsys, out, message)
    assert not (Path(__file__).parent / "PWNED").exists()


def test_a_revision_of_a_local_folder_is_refused(tiny_bert):
    """A revision with a local folder was ignored (the folder converted as it is); resolve_source refuses it too."""
    with pytest.raises(ConversionError, match="is a local folder: --revision applies to Hub ids"):
        resolve_source(tiny_bert, "v1")
    assert resolve_source(tiny_bert) == (tiny_bert.resolve(), None)


def test_existing_output_needs_overwrite_and_is_replaced_only_on_success(tiny_bert, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    assert main(["convert", str(tiny_bert), str(out), "--no-fidelity"]) == 1
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "old"

    broken = _no_weights(tiny_bert, tmp_path)
    assert main(["convert", str(broken), str(out), "--no-fidelity", "--overwrite"]) == 1
    assert (out / "keep.txt").read_text() == "old"  # a failed conversion leaves the old folder alone

    assert main(["convert", str(tiny_bert), str(out), "--no-fidelity", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "source"]


def test_empty_output_folder_is_fine(tiny_bert, tmp_path):
    (tmp_path / "out").mkdir()
    assert main(["convert", str(tiny_bert), str(tmp_path / "out"), "--no-fidelity", "-q"]) == 0


def test_an_output_folder_that_is_a_link_is_written_where_it_links_with_its_permissions(tiny_bert, tmp_path):
    """An output given as a symbolic link (to a larger disk) was replaced by a new folder beside it, the link's target
    left empty; and an output folder took the staging folder's 0700 (``tempfile.mkdtemp``'s) whatever the umask,
    where ``save_pretrained`` gives 0755. The link is kept and the checkpoint written through it, an existing folder
    keeps its permissions and a new one takes the umask's."""
    target, link = tmp_path / "disk" / "models", tmp_path / "work" / "out"
    target.mkdir(parents=True)
    link.parent.mkdir()
    link.symlink_to(target)
    previous = os.umask(0o022)
    try:
        assert main(["convert", str(tiny_bert), str(link), "--no-fidelity", "-q"]) == 0
        assert link.is_symlink() and (target / "model.safetensors").is_file()
        assert sorted(p.name for p in link.parent.iterdir()) == ["out"]  # no staging folder left beside it
        assert (target.stat().st_mode & 0o777) == 0o755
        assert main(["convert", str(tiny_bert), str(tmp_path / "new"), "--no-fidelity", "-q"]) == 0
        assert ((tmp_path / "new").stat().st_mode & 0o777) == 0o755
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o750)
        assert main(["convert", str(tiny_bert), str(shared), "--no-fidelity", "-q"]) == 0
        assert (shared.stat().st_mode & 0o777) == 0o750
    finally:
        os.umask(previous)


def test_a_command_run_in_a_process_leaves_its_logging_as_it_was(tiny_bert, tmp_path, caplog):
    """main() prints the package's log records on stdout while a command runs (and turns transformers' progress bars
    off), then puts back what it changed, after a success and after an error: records logged later in the process
    still reach its handlers (here pytest's), as they did before."""
    from transformers.utils import logging as hf_logging

    package_logger = logging.getLogger("performer_hf")
    before = package_logger.handlers[:], package_logger.level, package_logger.propagate
    out = tmp_path / "out"
    assert main(["convert", str(tiny_bert), str(out), "--no-fidelity", "-q"]) == 0
    assert main(["convert", str(tiny_bert), str(out), "--no-fidelity", "-q"]) == 1  # exists: no --overwrite
    assert (package_logger.handlers, package_logger.level, package_logger.propagate) == before
    assert hf_logging.is_progress_bar_enabled()
    with caplog.at_level(logging.WARNING, logger="performer_hf.conversion"):
        logging.getLogger("performer_hf.conversion").warning("after the command")
    assert [record.getMessage() for record in caplog.records] == ["after the command"]


def _hub_cache(folder: Path, cache: Path, repo_id: str) -> None:
    """Lay ``folder`` out as huggingface_hub's cache holds a downloaded snapshot of ``repo_id``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    revision = "0" * 40
    shutil.copytree(folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_console_script_resolves_hub_ids_from_the_cache_offline(tiny_bert, tmp_path):
    cache = tmp_path / "hub"
    _hub_cache(tiny_bert, cache, "org/tiny-bert")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "performer_hf.cli", "convert"]
    done = subprocess.run(
        [*command, "org/tiny-bert", str(tmp_path / "out"), "--no-fidelity", "-q"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: org/tiny-bert" in card


def test_hub_id_missing_from_the_offline_cache(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "missing"
    code = main(["convert", "org/missing", str(out), "--no-fidelity"])
    assert_failed_cleanly(
        code, capsys, out, "'org/missing' is not a local folder and could not be fetched from the Hub"
    )


def test_demo_on_the_real_minilm_at_a_short_length(tmp_path, monkeypatch):
    """The demo's full path (conversion, sentence metrics, timing, memory in child processes) at
    256 tokens; `bash scripts/demo.sh` runs it at 8192."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # measured in this process: the fresh-process wrapper is covered by test_peak_memory_in_a_fresh_process
    monkeypatch.setattr(demo, "peak_memory", demo._measure_memory_in_this_process)
    result = demo.run_demo(tmp_path / "demo", length=256, num_sentences=12, repeats=1)
    assert result["fidelity"]["exact_max_abs_diff"]["hidden states"] < 1e-4
    assert result["sentences"]["count"] == 12 and -1 <= result["sentences"]["pairwise_spearman"] <= 1
    # as shipped, short sentences keep exact attention; the approximation is measured too
    assert (
        result["exact_max_length"] == METHODS["hybrid"]["bidirectional"]["exact_max_length"] > 0
        and result["sentences"]["mean_cosine"] > 0.9999
    )
    assert 0.9 < result["sentences_approximated"]["mean_cosine"] < result["sentences"]["mean_cosine"]
    config = json.loads((tmp_path / "demo" / "config.json").read_text())
    assert config["max_position_embeddings"] == 512 and config["attention_kernel"] == "poly2"  # the default method
    for memory in result["memory"].values():
        assert memory["process_peak_mb"] > 0
    text = demo.format_demo(result)
    assert "pairwise-similarity Spearman" in text and "speed-up" in text


def test_peak_memory_in_a_fresh_process(tiny_bert, tmp_path):
    assert main(["convert", str(tiny_bert), str(tmp_path / "out"), "--no-fidelity", "-q"]) == 0
    memory = demo.peak_memory("performer", tmp_path / "out", 64, 64)
    assert memory["process_peak_mb"] > memory["forward_peak_mb"] >= 0


def test_demo_method_reaches_the_conversion(tmp_path, monkeypatch):
    """`performer-hf demo --method favor` converts with plain FAVOR+ (the default is covered above)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(demo, "peak_memory", demo._measure_memory_in_this_process)
    out = tmp_path / "demo"
    assert (
        main(
            [
                "demo",
                "--output-dir",
                str(out),
                "--length",
                "128",
                "--sentences",
                "4",
                "--repeats",
                "1",
                "--method",
                "favor",
            ]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["attention_kernel"] == "softmax" and config["local_window"] == 0 and config["routed_blocks"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["convert", "in"], "the following arguments are required: output_dir"),
        (["convert", "in", "out", "--nb-features", "x"], "argument --nb-features: invalid int value: 'x'"),
        (["zoo", "frob"], "argument zoo_command: invalid choice: 'frob'"),
        (["frob"], "argument command: invalid choice: 'frob'"),
    ],
)
def test_bad_command_lines_end_with_one_line(argv, message, capsys):
    """What argparse refuses: one line on stderr naming the problem and where the options are, status 2."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].endswith("--help)")


def test_the_front_knows_the_package_s_options():
    """performer_hf_cli parses without importing performer_hf: its copy of the options must be the package's (after a
    change to the config fields or the presets: performer_hf.cli.write_options(), then ruff format)."""
    import performer_hf_cli.options as front
    from performer_hf import PerformerConfig
    from performer_hf.cli import _CONFIG_OPTIONS
    from performer_hf.conversion import SUPPORTED_ARCHITECTURES
    from performer_hf.conversion.convert import DEFAULT_IN_PLACE_METHOD, DEFAULT_METHOD, FIXED_BY_SOURCE, METHODS

    assert front.CONFIG_OPTIONS == [(name, kind.__name__, text) for name, kind, text in _CONFIG_OPTIONS]
    assert front.METHODS == tuple(sorted(METHODS)) and front.SUPPORTED_ARCHITECTURES == tuple(SUPPORTED_ARCHITECTURES)
    assert (front.DEFAULT_METHOD, front.DEFAULT_IN_PLACE_METHOD) == (DEFAULT_METHOD, DEFAULT_IN_PLACE_METHOD)
    assert set(front.CONFIG_FIELDS) == {field.name for field in dataclasses.fields(PerformerConfig)}
    assert set(front.FIXED_BY_SOURCE) == FIXED_BY_SOURCE


@pytest.mark.parametrize(
    ("argv", "message", "status"),
    [
        (["convert", "in", "out", "--nb-features", "x"], "argument --nb-features: invalid int value: 'x'", 2),
        (["convert", "./no-such-folder", "out"], "source './no-such-folder' is neither an existing folder", 1),
        (["convert", "in", "{full}"], "exists and is not empty; pass --overwrite to replace it", 1),
        (["convert", "in", "out", "--set", "nb_features"], "--set expects FIELD=VALUE, got 'nb_features'", 1),
        (["convert", "in", "out", "--set", "nb_feature=3"], "unknown PerformerConfig field(s) ['nb_feature']", 1),
        (["convert", "in", "out", "--set", "hidden_size=64"], "['hidden_size'] are fixed by the source weights", 1),
        (["convert", "in", "out", "--transfer-text", "t.txt"], "without transfer steps: set --transfer-steps too", 1),
        (["push", "{full}", "org/name"], "has no config.json; save the model with save_pretrained first", 1),
        (["push", "no-such-folder", "org/name"], "no-such-folder is not a folder", 1),
    ],
)
def test_command_line_mistakes_end_before_torch_is_imported(argv, message, status, tmp_path):
    """The console script's front (performer_hf_cli) finds these without performer_hf, torch or transformers, whose
    import takes seconds: one line, at once."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    argv = [arg.format(full=tmp_path / "full") for arg in argv]
    script = (
        "import sys, performer_hf_cli\n"
        f"status = performer_hf_cli.main({argv!r})\n"
        "assert not {'torch', 'transformers', 'performer_hf'} & set(sys.modules), 'imported'\n"
        "sys.exit(status)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    lines = done.stderr.splitlines()
    assert done.returncode == status and len(lines) == 1 and message in lines[0], done.stderr
