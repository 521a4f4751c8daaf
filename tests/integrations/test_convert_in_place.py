"""``performer_hf.convert`` and ``performer-hf convert`` on Llama, Mistral, Qwen2, Qwen3 and Gemma3 checkpoints:
the class and the weights are kept, the config names the attention, exact mode reproduces the source."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import performer_hf
from performer_hf.cli import main
from performer_hf.conversion import SUPPORTED_ARCHITECTURES, ConversionError
from performer_hf.conversion.in_place import IN_PLACE_ARCHITECTURES

from .test_attention_interface import DECODERS, _ids

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
    assert report["attn_implementation"] == "performer_hybrid"
    card = (out / "README.md").read_text()
    assert "base_model: source" in card and "performer_hybrid" in card and "| `local_window` | `64` |" in card
    before, after = load_file(tmp_path / "source" / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(converted) is type(source)
    assert converted.config._attn_implementation == "performer_hybrid"
    ids = _ids(1, 96)  # longer than the hybrid's window: the far field is in use
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


def test_cli_converts_with_favor_settings(tmp_path, capsys):
    _save_source("Qwen2ForCausalLM", tmp_path / "source")
    out = tmp_path / "out"
    code = main(["convert", str(tmp_path / "source"), str(out), "--method", "favor", "--nb-features", "32", "-q"])
    assert code == 0 and capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["attn_implementation"] == "performer"
    assert config["performer_attention"]["nb_features"] == 32


def test_fields_the_architecture_fixes_are_refused_before_anything_is_written(tmp_path):
    _save_source("LlamaForCausalLM", tmp_path / "source")
    with pytest.raises(ConversionError, match="max_position_embeddings cannot be set"):
        performer_hf.convert(tmp_path / "source", tmp_path / "out", max_position_embeddings=4096)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["source"]
