"""Tests of performer_hf.model_assets: the SmolLM2 checkpoint folder written once into the data cache.

The GGUF read (about 20 s) is replaced by a tiny random Llama and a tokenizer stub, so that the tests exercise how
the folder is written and published, not transformers' GGUF loader (tests/integrations/test_real_llm.py reads the
real one).
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from performer_hf.data_assets import DataAssetError
from performer_hf.model_assets import SMOLLM2_FOLDER, smollm2_checkpoint


class _TokenizerStub:
    def save_pretrained(self, folder):
        (folder / "tokenizer.json").write_text("{}")


@pytest.fixture
def tiny_gguf(monkeypatch) -> transformers.LlamaForCausalLM:
    """The model smollm2_checkpoint reads from the GGUF file: a tiny random Llama (counted in ``reads``)."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    model.reads = []

    def from_pretrained(folder, gguf_file, **kwargs):
        model.reads.append(gguf_file)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: _TokenizerStub())
    return model


def _same_weights(folder, model) -> bool:
    saved = load_file(folder / "model.safetensors")
    return all(torch.equal(saved[name], tensor) for name, tensor in model.state_dict().items() if name in saved)


def test_a_folder_without_weights_is_written_anew(tmp_path, tiny_gguf):
    """A SmolLM2 folder that a copy left without model.safetensors cost the whole conversion and then failed moving
    the written folder onto it (OSError: Directory not empty); it is replaced, and nothing is left beside it."""
    partial = tmp_path / SMOLLM2_FOLDER
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    folder = smollm2_checkpoint(tmp_path)
    assert folder == partial and _same_weights(folder, tiny_gguf) and (folder / "tokenizer.json").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == [SMOLLM2_FOLDER]
    assert smollm2_checkpoint(tmp_path) == folder and len(tiny_gguf.reads) == 1  # written once


def test_the_folder_takes_the_umasks_permissions(tmp_path, tiny_gguf):
    """The folder was tempfile.mkdtemp's staging folder renamed, 0700 whatever the umask."""
    previous = os.umask(0o022)
    try:
        folder = smollm2_checkpoint(tmp_path / "cache")
    finally:
        os.umask(previous)
    assert oct(folder.stat().st_mode & 0o777) == oct(0o755)


def test_an_unwritable_cache_is_refused_before_the_gguf_is_read(tmp_path, tiny_gguf):
    """A file as cache_dir dequantised the GGUF (86 s on 2 cores) and only then failed with FileExistsError."""
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(DataAssetError, match="a_file .*cannot be written.*pass a folder you can write as cache_dir"):
        smollm2_checkpoint(tmp_path / "a_file")
    assert tiny_gguf.reads == []
