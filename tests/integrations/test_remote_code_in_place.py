"""A folder converted in place carries the code that loads it: with ``trust_remote_code=True``, in a process where
performer_hf cannot be imported, it computes the logits, greedy tokens and bounded decoding state that it computes
with the package; where the package is imported, it loads as the source's own class."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertModel
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import performer_hf
from performer_hf.modeling import attention_interface
from performer_hf.modeling.cache_performer import FavorCacheLayer, SparseCacheLayer

from ..remote_code import decode_with_performer_hf, decode_without_performer_hf
from .test_attention_interface import DECODERS, SPARSE, _ids, _source
from .test_convert_in_place import CLASSES

pytestmark = pytest.mark.usefixtures("single_thread")

# bounded to 4 blocks of 4 keys, so that an 80-token prompt drops blocks and the bundle's pool is what decodes
BOUNDED = {**SPARSE, "select_budget": 4}


def _assert_same_decoding(remote: dict, local: dict):
    torch.testing.assert_close(remote["step_logits"], local["step_logits"], atol=1e-5, rtol=1e-5)
    assert torch.equal(remote["sequences"], local["sequences"])
    assert remote["cache_layers"] == local["cache_layers"] and remote["cache_bytes"] == local["cache_bytes"]
    assert remote["leaked"] == []


def test_converted_folders_decode_without_performer_hf_as_with_it(tmp_path):
    """Every architecture converted in place (the bounded sparse default), and a Llama loaded with the hybrid and
    saved through ship_remote_code before its first forward: loaded with trust_remote_code in one process without
    performer_hf, each decodes an 80-token prompt (past the hybrid's window, and past the sparse pool's budget) as the
    package does, and saves its code again."""
    folders, expected, ids = [], [], _ids(1, 80)
    for architecture, (arch, source_class) in CLASSES.items():
        torch.manual_seed(0)
        source_class(DECODERS[arch]).save_pretrained(tmp_path / architecture)
        out = performer_hf.convert(tmp_path / architecture, tmp_path / f"{architecture}-out", fidelity=False, **BOUNDED)
        config = json.loads((out / "config.json").read_text())
        assert config["auto_map"] == {"AutoModelForCausalLM": f"modeling_in_place.{architecture}"}
        assert config["architectures"] == [architecture]  # the source's class name, for every tool that reads it
        local = AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(local) is source_class  # the package imported: the source's own class, as before
        folders.append(out)
        expected.append(decode_with_performer_hf(local, ids))
        assert "SparseCacheLayer" in expected[-1]["cache_layers"]

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "LlamaForCausalLM", attn_implementation="performer_hybrid")
    assert performer_hf.ship_remote_code(model.eval()) is model
    model.save_pretrained(tmp_path / "shipped")  # before its first forward: the settings are in the folder all the same
    config = json.loads((tmp_path / "shipped" / "config.json").read_text())
    assert config["attn_implementation"] == "performer_hybrid" and config["performer_attention"]["local_window"] == 64
    folders.append(tmp_path / "shipped")
    expected.append(decode_with_performer_hf(model, ids))
    assert expected[-1]["cache_layers"] == ["HybridCacheLayer", "HybridCacheLayer"]

    remote_reports = decode_without_performer_hf(folders, ids, tmp_path)
    for index, (folder, remote, local) in enumerate(zip(folders, remote_reports, expected, strict=True)):
        name = json.loads((folder / "config.json").read_text())["architectures"][0]
        assert remote["class"].startswith("transformers_modules.") and remote["class"].endswith(f".{name}")
        _assert_same_decoding(remote, local)
        saved = tmp_path / "report.saved" / str(index)  # the folder the remote-code model saved: its code again
        assert (saved / "modeling_in_place.py").read_text() == (folder / "modeling_in_place.py").read_text()
        assert json.loads((saved / "config.json").read_text())["auto_map"] == {
            "AutoModelForCausalLM": f"modeling_in_place.{name}"
        }


def test_with_the_package_imported_its_attention_serves_the_remote_class(tmp_path):
    _, folder = _source(DECODERS["qwen3"], tmp_path)
    out = performer_hf.convert(folder, tmp_path / "out", fidelity=False, **BOUNDED)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(remote).__module__.startswith("transformers_modules.")
    # the folder's copy left the package's registrations in place: its attention (with the compiled kernels) and its
    # cache layers, which the Performer family's caches are built from
    assert ALL_ATTENTION_FUNCTIONS["performer_sparse"] is attention_interface.ATTENTION_FUNCTIONS["performer_sparse"]
    for name, layer in {"favor_attention": FavorCacheLayer, "sparse_attention": SparseCacheLayer}.items():
        assert DYNAMIC_LAYER_TYPE_MAPPING[name] is layer
    local = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids(2, 30)
    with torch.no_grad():
        assert torch.equal(remote(ids).logits, local(ids).logits)


def test_a_remote_code_model_saved_before_it_runs_keeps_its_attention(tmp_path):
    """transformers does not save the attn_implementation a model was loaded with; the shipped class records it."""
    _, folder = _source(DECODERS["mistral"], tmp_path)
    out = performer_hf.convert(folder, tmp_path / "out", fidelity=False, method="hybrid")
    AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).save_pretrained(tmp_path / "again")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["attn_implementation"] == "performer_hybrid"
    assert config["performer_attention"] == json.loads((out / "config.json").read_text())["performer_attention"]
    assert (tmp_path / "again" / "modeling_in_place.py").is_file()


def test_ship_remote_code_names_what_it_takes(tmp_path):
    with pytest.raises(ValueError, match="architectures converted in place.*BertModel"):
        performer_hf.ship_remote_code(BertModel(BertConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1)))
    _, folder = _source(DECODERS["llama"], tmp_path)
    softmax = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="attn_implementation='sdpa', not a Performer attention"):
        performer_hf.ship_remote_code(softmax)
