"""``performer_hf.convert`` and ``performer-hf convert`` on Llama, Mistral, Qwen2, Qwen3 and Gemma3 checkpoints:
the class and the weights are kept, the config names the attention, exact mode reproduces the source."""

import json
import logging
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import performer_hf
from performer_hf.cli import main
from performer_hf.conversion import SUPPORTED_ARCHITECTURES, ConversionError, TransferSettings
from performer_hf.conversion.in_place import IN_PLACE_ARCHITECTURES
from performer_hf.integrations import text_batches
from performer_hf.modeling.far_fields import FAR_FIELDS

from .test_attention_interface import DECODERS, VOCAB, _ids

pytestmark = pytest.mark.usefixtures("single_thread")

CLASSES = {
    "LlamaForCausalLM": ("llama", transformers.LlamaForCausalLM),
    "MistralForCausalLM": ("mistral", transformers.MistralForCausalLM),
    "Qwen2ForCausalLM": ("qwen2", transformers.Qwen2ForCausalLM),
    "Qwen3ForCausalLM": ("qwen3", transformers.Qwen3ForCausalLM),
    "Gemma3ForCausalLM": ("gemma3", transformers.Gemma3ForCausalLM),
}


def _save_source(architecture, folder):
    arch, model_class = CLASSES[architecture]
    torch.manual_seed(0)
    model = model_class(DECODERS[arch]).eval()
    model.save_pretrained(folder)
    return model


def test_every_in_place_architecture_is_tested_and_listed():
    assert set(CLASSES) == set(IN_PLACE_ARCHITECTURES)
    assert set(IN_PLACE_ARCHITECTURES) <= set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("architecture", list(CLASSES))
def test_convert_keeps_the_class_and_weights_and_names_the_attention(architecture, tmp_path):
    source = _save_source(architecture, tmp_path / "source")
    out = performer_hf.convert(tmp_path / "source", tmp_path / "out")
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["exact_parity_max_abs_diff"] <= 1e-5
    assert report["attn_implementation"] == "performer_sparse"  # decoders convert to the sparse method
    card = (out / "README.md").read_text()
    # a local folder given no Hub id: named in plain text, no base_model metadata (it was "base_model: source")
    assert "base_model" not in card.split("---")[1] and "The local checkpoint `source`" in card
    assert "performer_sparse" in card and "| `local_window` | `512` |" in card
    before, after = load_file(tmp_path / "source" / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(converted) is type(source)
    assert converted.config._attn_implementation == "performer_sparse"
    ids = _ids(1, 1200)  # past the window and the 8 selected blocks: the selection is in use
    with torch.no_grad():
        logits, reference = converted(ids).logits, source(ids).logits
    assert torch.isfinite(logits).all() and not torch.allclose(logits, reference, atol=1e-5)


def test_a_bfloat16_checkpoint_stays_bfloat16_byte_for_byte(tmp_path):
    _save_source("LlamaForCausalLM", tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(tmp_path / "source")
    out = performer_hf.convert(tmp_path / "source", tmp_path / "out")
    before, after = load_file(tmp_path / "source" / "model.safetensors"), load_file(out / "model.safetensors")
    assert {t.dtype for t in after.values()} == {torch.bfloat16}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_exact_conversion_matches_the_source(architecture, tmp_path):
    source = _save_source(architecture, tmp_path / "source")
    out = performer_hf.convert(tmp_path / "source", tmp_path / "out", method="favor", attention_kernel="exact")
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids(2, 40)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-5, rtol=1e-5)
    fidelity = json.loads((out / "conversion_report.json").read_text())["fidelity"]  # exact: nothing differs
    assert fidelity["text"].endswith("random token ids (the source folder has no usable tokenizer)")
    assert max(fidelity["attention_error_propagated"]) < 1e-5 and fidelity["top1_agreement"] == 1.0
    assert abs(fidelity["kl_mean"]) < 1e-6 and fidelity["perplexity"] == pytest.approx(fidelity["source_perplexity"])


def test_cli_converts_with_favor_settings(tmp_path, capsys):
    _save_source("Qwen2ForCausalLM", tmp_path / "source")
    out = tmp_path / "out"
    code = main(["convert", str(tmp_path / "source"), str(out), "--method", "favor", "--nb-features", "32", "-q"])
    assert code == 0 and capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["attn_implementation"] == "performer"
    assert config["performer_attention"]["nb_features"] == 32


@pytest.mark.parametrize("far_field", sorted(FAR_FIELDS))
def test_a_hybrid_converts_with_every_far_field_and_reloads_as_loaded_directly(far_field, tmp_path):
    """The in-place hybrid's causal preset set FAVOR++'s A (0.0) under every far field, which refused it for all but
    softmax_opt ("set it to None"), and convert dropped far_field_parameter=None: no other far field converted."""
    _save_source("LlamaForCausalLM", tmp_path / "source")
    settings = {"attention_kernel": far_field, "local_window": 8}
    out = performer_hf.convert(tmp_path / "source", tmp_path / "out", method="hybrid", fidelity=False, **settings)
    assert (
        main(
            [
                "convert",
                str(tmp_path / "source"),
                str(tmp_path / "cli"),
                "--method",
                "hybrid",
                "--far-field",
                far_field,
                "-q",
            ]
        )
        == 0
    )
    # set to None explicitly: kept, not dropped (causal FAVOR++ then needs a fixed A, and says so)
    none = {"far_field_parameter": None}
    if FAR_FIELDS[far_field].uses_parameter:
        with pytest.raises(ConversionError, match="needs a fixed far_field_parameter"):
            performer_hf.convert(tmp_path / "source", tmp_path / "none", method="hybrid", **settings, **none)
    else:
        performer_hf.convert(
            tmp_path / "source", tmp_path / "none", method="hybrid", fidelity=False, **settings, **none
        )
        saved = json.loads((tmp_path / "none" / "config.json").read_text())["performer_attention"]
        assert saved["far_field_parameter"] is None
    direct = AutoModelForCausalLM.from_pretrained(tmp_path / "source", attn_implementation="performer_hybrid").eval()
    direct.config.performer_attention = settings
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids(1, 48)
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, direct(ids).logits)
    expected_a = 0.0 if FAR_FIELDS[far_field].uses_parameter else None  # FAVOR++'s A where its far field has one
    assert converted.config.performer_attention["far_field_parameter"] == expected_a


def test_fields_the_architecture_fixes_are_refused_before_anything_is_written(tmp_path):
    _save_source("LlamaForCausalLM", tmp_path / "source")
    with pytest.raises(ConversionError, match="max_position_embeddings cannot be set"):
        performer_hf.convert(tmp_path / "source", tmp_path / "out", max_position_embeddings=4096)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["source"]


@pytest.mark.parametrize("field", [{"local_window": 5}, {"far_field_gain": 0.5}])
def test_a_favor_conversion_given_the_hybrids_fields_is_refused_with_the_fix(field, tmp_path):
    """convert(method='favor', local_window=5) wrote the FAVOR+ preset without the window, and the model ran the
    hybrid in its first layer and FAVOR+ after it at its first call (FAVOR+ everywhere from its second)."""
    _save_source("LlamaForCausalLM", tmp_path / "source")
    with pytest.raises(ConversionError, match=f"{next(iter(field))} is not read by .* convert with method='hybrid'"):
        performer_hf.convert(tmp_path / "source", tmp_path / "out", method="favor", fidelity=False, **field)
    assert not (tmp_path / "out").exists()


def test_a_folder_converted_already_is_refused_as_a_source(tmp_path):
    """Re-converting a converted folder (to switch method) measured against the folder's own Performer attention as
    if it were the source: a misleading parity failure from FAVOR+, a sparse model's perplexity reported as the
    source's. Refused, naming the fix, before anything is written."""
    _save_source("LlamaForCausalLM", tmp_path / "source")
    converted = performer_hf.convert(tmp_path / "source", tmp_path / "favor", method="favor", fidelity=False)
    with pytest.raises(ConversionError, match="was converted already .* Convert the original checkpoint"):
        performer_hf.convert(converted, tmp_path / "out", method="hybrid", fidelity=False)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_of_vocabulary_and_merges_files_is_copied_whole(tmp_path):
    """A byte-level BPE tokenizer saved as vocab.json + merges.txt (no tokenizer.json, as older Qwen2 and GPT-2
    folders ship it) reaches the converted folder whole: it encodes text as the source's does."""
    _save_source("Qwen2ForCausalLM", tmp_path / "source")
    vocab = {"h": 0, "e": 1, "l": 2, "o": 3, "he": 4, "ll": 5, "hell": 6, "hello": 7, "Ġ": 8, "w": 9, "r": 10, "d": 11}
    (tmp_path / "source" / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "source" / "merges.txt").write_text("#version: 0.2\nh e\nl l\nhe ll\nhell o\n")
    (tmp_path / "source" / "added_tokens.json").write_text(json.dumps({"<|endoftext|>": 12}))
    config = {"tokenizer_class": "Qwen2Tokenizer", "unk_token": None, "eos_token": "<|endoftext|>"}
    (tmp_path / "source" / "tokenizer_config.json").write_text(json.dumps(config))
    out = performer_hf.convert(tmp_path / "source", tmp_path / "out", fidelity=False)
    report = json.loads((out / "conversion_report.json").read_text())
    assert {"vocab.json", "merges.txt", "added_tokens.json", "tokenizer_config.json"} <= set(report["copied_files"])
    text = "hello world hello<|endoftext|>"
    expected = AutoTokenizer.from_pretrained(tmp_path / "source")(text).input_ids
    assert 7 in expected and AutoTokenizer.from_pretrained(out)(text).input_ids == expected


@pytest.mark.parametrize("where", ["the source", "its parent"])
def test_an_output_folder_that_would_replace_the_source_is_refused(where, tmp_path, capsys):
    """Converting into the source folder, or a folder holding it, would replace the source even with --overwrite:
    the library and the command line refuse it, before anything is written, naming another folder."""
    _save_source("LlamaForCausalLM", tmp_path / "models" / "source")
    (tmp_path / "models" / "source" / "NOTES.md").write_text("mine")
    before = sorted(p.name for p in (tmp_path / "models" / "source").iterdir())
    out = tmp_path / "models" / "source" if where == "the source" else tmp_path / "models"
    with pytest.raises(ConversionError, match=r"the source .*: writing it would replace the source"):
        performer_hf.convert(tmp_path / "models" / "source", out, overwrite=True, fidelity=False)
    assert main(["convert", str(tmp_path / "models" / "source"), str(out), "--overwrite", "-q"]) == 1
    assert "source-performer" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "models" / "source").iterdir()) == before
    assert (tmp_path / "models" / "source" / "NOTES.md").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["source"]


def test_staging_folders_left_by_a_killed_conversion_are_deleted_others_named(tmp_path, caplog):
    """A conversion killed before it could remove its staging folder left it beside the output for good (a
    SmolLM2-sized copy each time): the next one to the same output deletes it, as its process on this host is gone.
    One whose process still runs, or made on another host sharing the folder, may still be written: named in a
    warning, kept."""
    _save_source("LlamaForCausalLM", tmp_path / "source")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    killed = f".out.tmp-{host}-{gone.stdout.strip()}-abc123"
    running = f".out.tmp-{host}-{os.getpid()}-def456"
    elsewhere = f".out.tmp-otherhost-{gone.stdout.strip()}-ghi789"
    for name in (killed, running, elsewhere, ".out.tmp-unnamed"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="performer_hf.conversion"):
        performer_hf.convert(tmp_path / "source", tmp_path / "out", fidelity=False)
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert all(name in warned for name in (running, elsewhere, ".out.tmp-unnamed")) and killed not in warned
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [running, elsewhere, ".out.tmp-unnamed", "out", "source"]
    )


def test_an_output_folder_under_a_file_is_refused_in_one_line(tmp_path, capsys):
    _save_source("LlamaForCausalLM", tmp_path / "source")
    (tmp_path / "afile").write_text("x")
    assert main(["convert", str(tmp_path / "source"), str(tmp_path / "afile" / "sub"), "-q"]) == 1
    assert "afile is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("defect", ["a tensor missing", "a layer more in config.json", "another intermediate_size"])
@pytest.mark.parametrize("fidelity", [True, False])
def test_weights_that_do_not_match_the_config_are_refused_by_name(defect, fidelity, tmp_path):
    """Without the fidelity check, a missing tensor (or a layer config.json adds) was written drawn at random, the
    model 'converted'; with it, the difference was blamed on the adapter ('please report it'); tensors of other
    shapes ended in a transformers traceback."""
    from safetensors.torch import save_file

    source = tmp_path / "source"
    _save_source("LlamaForCausalLM", source)
    config = json.loads((source / "config.json").read_text())
    if defect == "a tensor missing":
        weights = load_file(source / "model.safetensors")
        del weights["model.layers.1.mlp.down_proj.weight"]
        save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
        expected = "tensors missing: model.layers.1.mlp.down_proj.weight"
    elif defect == "a layer more in config.json":
        config["num_hidden_layers"] += 1
        expected = "tensors missing: model.layers.2."
    else:
        config["intermediate_size"] += 32
        expected = "tensors of other shapes: model.layers.0.mlp.down_proj.weight [64, 96] where config.json makes"
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=f"do not match its config.json \\({re.escape(expected)}"):
        performer_hf.convert(source, tmp_path / "out", fidelity=fidelity)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, which takes no new folder")
def test_an_output_folder_that_cannot_be_made_is_refused_in_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """The conversion ran whole (about 2 minutes for SmolLM2) before a traceback from making its staging folder."""
    _save_source("LlamaForCausalLM", tmp_path / "source")
    monkeypatch.setattr("performer_hf.conversion.in_place._load", lambda *args, **kwargs: pytest.fail("loaded"))
    assert main(["convert", str(tmp_path / "source"), "/proc/performer-hf-test/out", "-q"]) == 1
    err = capsys.readouterr().err
    assert "output folder /proc/performer-hf-test/out cannot be written" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--local-window", "100"], "local_window=100 must be a multiple of select_block_size=64"),
        (["--method", "hybrid", "--local-window", "-3"], "local_window"),
        (["--set", "select_ranking=best"], "select_ranking"),
        (["--method", "favor", "--nb-features", "0"], "nb_features"),
    ],
)
def test_bad_attention_settings_end_with_one_line_before_anything_is_loaded(options, message, tmp_path, capsys):
    """Settings a decoder converted in place cannot take are refused with the settings' own message, as a
    conversion error (one line on the command line, no traceback), before the source is loaded or anything written."""
    _save_source("LlamaForCausalLM", tmp_path / "source")
    assert main(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "-q", *options]) == 1
    err = capsys.readouterr().err
    assert "invalid attention settings" in err and message in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def _save_tokenizer(folder, text):
    """A word-level tokenizer over ``text``'s words (the tiny sources have none)."""
    words = sorted(set(text.split()))
    assert len(words) < VOCAB
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)


def _transfer_text(path, words=600):
    rng = random.Random(0)
    path.write_text(" ".join(f"w{rng.randrange(60)}" for _ in range(words)))
    return path


def test_text_batches_refuses_each_bad_argument_with_its_own_reason(tmp_path):
    """A string as texts was read character by character ('h\\n\\ne\\n\\nl...'), count=0 said the text was shorter than
    one window, length=0 raised ZeroDivisionError."""
    text = _transfer_text(tmp_path / "text.txt").read_text()
    _save_tokenizer(tmp_path / "tokenizer", text)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert [b["input_ids"].shape for b in text_batches(tokenizer, [text], 16, 3)] == [(1, 16)] * 3
    with pytest.raises(ValueError, match=r"got a single string .* pass \[text\]"):
        text_batches(tokenizer, text, 16, 3)
    for length in (0, 1, 2.0, True):
        with pytest.raises(ValueError, match=f"length is the tokens of a window, at least 2, got {length!r}"):
            text_batches(tokenizer, [text], length, 3)
    for count in (0, -1, None):
        with pytest.raises(ValueError, match=f"count is the number of windows, at least 1, got {count!r}"):
            text_batches(tokenizer, [text], 16, count)


def test_convert_with_attention_transfer_equals_transfer_attention_on_the_text(tmp_path):
    source = _save_source("LlamaForCausalLM", tmp_path / "source")
    text_file = _transfer_text(tmp_path / "text.txt")
    _save_tokenizer(tmp_path / "source", text_file.read_text())
    out = tmp_path / "out"
    args = [
        "convert",
        str(tmp_path / "source"),
        str(out),
        "--method",
        "hybrid",
        "--local-window",
        "8",
        "--transfer-steps",
        "20",  # (four steps at the default rate overshoot: the transfer would end above its start and be undone)
        "--transfer-text",
        str(text_file),
        "--transfer-length",
        "32",
        "-q",
    ]
    assert main(args) == 0
    report = json.loads((out / "conversion_report.json").read_text())["attention_transfer"]
    assert report["text"] == "text.txt" and report["steps"] == 20 and report["tokens"] == 20 * 32
    assert not report["restored"] and sum(report["relative_error_last"].values()) < sum(
        report["relative_error_first"].values()
    )
    card = (out / "README.md").read_text()
    assert "Attention transfer at conversion" in card and "| `far_field_gain` | per layer and head (2 x 4)" in card
    before, after = load_file(tmp_path / "source" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)  # the source's weights, byte for byte
    assert any(".performer_attention.projection" in k for k in after.keys() - before.keys())

    # the same transfer by hand, on the same windows of the same text
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", attn_implementation="performer_hybrid").eval()
    model.config.performer_attention = {"local_window": 8}
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "source")
    batches = text_batches(tokenizer, [text_file.read_text()], 32, 20)
    performer_hf.transfer_attention(model, batches, steps=20, progress=False)
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    zero_shot = _load_zero_shot(tmp_path)
    ids = _ids(1, 48)
    with torch.no_grad():
        expected = model(ids).logits
        torch.testing.assert_close(converted(ids).logits, expected, atol=1e-6, rtol=1e-6)
        assert not torch.allclose(zero_shot(ids).logits, expected, atol=1e-4)
        assert not torch.allclose(source(ids).logits, expected, atol=1e-4)


def _load_zero_shot(tmp_path):
    out = performer_hf.convert(
        tmp_path / "source", tmp_path / "zero-shot", method="hybrid", local_window=8, fidelity=False
    )
    return AutoModelForCausalLM.from_pretrained(out).eval()


def test_a_transfer_without_the_sources_tokenizer_is_refused_before_loading(tmp_path, monkeypatch):
    """A folder without tokenizer files converts (fidelity falls back to random ids), but transfer tokenizes its
    text: after loading the model, a 40-line traceback from AutoTokenizer."""
    _save_source("LlamaForCausalLM", tmp_path / "source")
    monkeypatch.setattr("performer_hf.conversion.in_place._load", lambda *args, **kwargs: pytest.fail("loaded"))
    with pytest.raises(ConversionError, match="tokenizer, and .* has none: add its tokenizer files"):
        performer_hf.convert(tmp_path / "source", tmp_path / "out", method="hybrid", transfer=TransferSettings(2))
    assert not (tmp_path / "out").exists()


def test_bad_transfer_requests_are_refused_before_anything_is_written(tmp_path):
    _save_source("LlamaForCausalLM", tmp_path / "source")
    text_file = _transfer_text(tmp_path / "text.txt", words=20)
    _save_tokenizer(tmp_path / "source", text_file.read_text())
    with pytest.raises(ConversionError, match="is not a file"):
        TransferSettings(2, tmp_path / "missing.txt")
    for steps in (-1, True):
        with pytest.raises(ConversionError, match="positive whole number"):
            TransferSettings(steps)
    with pytest.raises(ConversionError, match="at least 2"):
        TransferSettings(2, length=1)
    cases = [
        (TransferSettings(2, text_file, 32), "fewer than one window of 32"),
        (TransferSettings(2, text_file, 16), "train on longer inputs"),
    ]
    for transfer, message in cases:
        with pytest.raises(ConversionError, match=message):
            performer_hf.convert(tmp_path / "source", tmp_path / "out", method="hybrid", transfer=transfer)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["source", "text.txt"]
    # the keywords of earlier releases still work, with a FutureWarning that names the new ones
    with pytest.warns(FutureWarning, match="transfer=TransferSettings"), pytest.raises(ConversionError, match="32"):
        performer_hf.convert(
            tmp_path / "source",
            tmp_path / "out",
            method="hybrid",
            transfer_steps=2,
            transfer_text=text_file,
            transfer_length=32,
        )
    # the sparse method (the decoders' default) learns nothing: transfer names the method that does
    with pytest.raises(ConversionError, match="--method hybrid"):
        performer_hf.convert(tmp_path / "source", tmp_path / "out", transfer=TransferSettings(2, text_file, 16))
    with pytest.warns(FutureWarning), pytest.raises(ConversionError, match="without transfer steps"):
        performer_hf.convert(tmp_path / "source", tmp_path / "out", transfer_text=text_file)
    assert main(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--transfer-text", str(text_file)]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source", "text.txt"]
    bert = tmp_path / "bert"
    bert_config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    transformers.BertModel(bert_config).save_pretrained(bert)
    with pytest.raises(ConversionError, match="for the models converted in place"):
        performer_hf.convert(bert, tmp_path / "out", transfer=TransferSettings(2))
    assert not (tmp_path / "out").exists()
