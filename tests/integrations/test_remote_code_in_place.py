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

# bounded to 4 blocks of 4 keys, so that a 48-token prompt drops blocks and the bundle's pool is what decodes
BOUNDED = {**SPARSE, "select_budget": 4}


def _assert_same_decoding(remote: dict, local: dict):
    torch.testing.assert_close(remote["step_logits"], local["step_logits"], atol=1e-5, rtol=1e-5)
    assert torch.equal(remote["sequences"], local["sequences"])
    assert remote["cache_layers"] == local["cache_layers"] and remote["cache_bytes"] == local["cache_bytes"]
    assert remote["leaked"] == []


@pytest.mark.parametrize("architecture", list(CLASSES))
def test_a_converted_folder_decodes_without_performer_hf_as_with_it(architecture, tmp_path):
    arch, source_class = CLASSES[architecture]
    torch.manual_seed(0)
    source_class(DECODERS[arch]).save_pretrained(tmp_path / "source")
    out = performer_hf.convert(tmp_path / "source", tmp_path / "out", fidelity=False, **BOUNDED)
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoModelForCausalLM": f"modeling_in_place.{architecture}"}
    assert config["architectures"] == [architecture]  # the source's class name, for every tool that reads it

    ids = _ids(1, 48)
    local = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(local) is source_class  # the package imported: the source's own class, as before
    expected = decode_with_performer_hf(local, ids)
    assert "SparseCacheLayer" in expected["cache_layers"]
    remote = decode_without_performer_hf(out, ids, tmp_path)
    assert remote["class"].startswith("transformers_modules.") and remote["class"].endswith(f".{architecture}")
    _assert_same_decoding(remote, expected)
    saved = tmp_path / "report.saved"  # the folder the remote-code model saved: its code again
    assert (saved / "modeling_in_place.py").read_text() == (out / "modeling_in_place.py").read_text()
    assert json.loads((saved / "config.json").read_text())["auto_map"] == config["auto_map"]


def test_a_model_loaded_with_a_performer_attention_ships_its_code_when_asked(tmp_path):
    """Saved before its first forward: the settings and the code are in the folder all the same."""
    _, folder = _source(DECODERS["llama"], tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="performer_hybrid").eval()
    assert performer_hf.ship_remote_code(model) is model
    model.save_pretrained(tmp_path / "shipped")
    config = json.loads((tmp_path / "shipped" / "config.json").read_text())
    assert config["attn_implementation"] == "performer_hybrid" and config["performer_attention"]["local_window"] == 64
    ids = _ids(1, 80)  # past the window: the far field is in use
    remote = decode_without_performer_hf(tmp_path / "shipped", ids, tmp_path)
    _assert_same_decoding(remote, decode_with_performer_hf(model, ids))
    assert remote["cache_layers"] == ["HybridCacheLayer", "HybridCacheLayer"]


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
