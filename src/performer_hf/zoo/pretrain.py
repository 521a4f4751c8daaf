"""A small softmax GPT-2 trained from scratch on local text: the causal source model of the zoo.

No GPT-2 weights can be had offline, so the ``pretrain: gpt2`` recipe trains a byte-level BPE
tokenizer and a transformers ``GPT2LMHeadModel`` (exact softmax attention) here, then hands the
folder to the converter like any downloaded checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from huggingface_hub import ModelCard, ModelCardData

from .data import read_texts

logger = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
PRETRAINING_FILE = "pretraining.json"


def train_tokenizer(texts: list[str], vocab_size: int):
    """A GPT-2 style byte-level BPE tokenizer (``PreTrainedTokenizerFast``) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        unk_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
    )


def token_blocks(tokenizer, texts: list[str], block_size: int) -> torch.Tensor:
    """(N, block_size) token ids: every text tokenized, concatenated and cut, the partial tail dropped,
    as ``training/run_clm.py`` groups its text."""
    ids = [token for row in tokenizer(texts)["input_ids"] for token in row]
    count = len(ids) // block_size
    if count == 0:
        raise ValueError(f"{len(ids)} tokens are fewer than one block of {block_size}; add text or lower block_size.")
    return torch.tensor(ids[: count * block_size]).view(count, block_size)  # (N, block_size)


@torch.no_grad()
def mean_loss(model, blocks: torch.Tensor, batch_size: int = 32) -> float:
    """Token-weighted next-token cross-entropy of ``model`` over ``blocks`` (N, L)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size]  # (b, L)
        loss = model(input_ids=batch, labels=batch).loss
        scored = batch.shape[0] * (batch.shape[1] - 1)
        total, count = total + float(loss) * scored, count + scored
    return total / count


def pretrain_gpt2(
    train_file: Path, validation_file: Path, output_dir: Path, *, tokenizer: dict, model: dict, training: dict
) -> dict:
    """Train a tokenizer and a ``GPT2LMHeadModel`` on ``train_file`` (JSON lines with ``text``) and save
    both to ``output_dir``.

    ``tokenizer``: ``vocab_size``. ``model``: ``GPT2Config`` fields. ``training``: ``steps``,
    ``batch_size``, ``block_size``, ``learning_rate``, ``warmup_steps``, ``seed`` (AdamW, cosine
    schedule, batches of blocks drawn at random from a seeded generator) and ``eval_blocks`` (validation
    blocks scored at the end; default all). Returns (and writes as
    ``pretraining.json``) the validation loss / perplexity and the training time.
    """
    from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

    settings = {
        "steps": 1000,
        "batch_size": 16,
        "block_size": 128,
        "learning_rate": 1e-3,
        "warmup_steps": 0,
        "seed": 0,
        "eval_blocks": None,
        **training,
    }
    torch.manual_seed(settings["seed"])
    texts = read_texts(train_file)
    tok = train_tokenizer(texts, tokenizer["vocab_size"])
    blocks = token_blocks(tok, texts, settings["block_size"])  # (N, L)
    validation = token_blocks(tok, read_texts(validation_file), settings["block_size"])[: settings["eval_blocks"]]
    config = GPT2Config(
        vocab_size=len(tok),
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        **model,
    )
    gpt2 = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(gpt2.parameters(), lr=settings["learning_rate"], weight_decay=0.01)
    schedule = get_scheduler(
        "cosine", optimizer, num_warmup_steps=settings["warmup_steps"], num_training_steps=settings["steps"]
    )
    generator = torch.Generator().manual_seed(settings["seed"])
    logger.info(
        "pretraining a softmax GPT-2 (%d parameters) on %d blocks of %d tokens for %d steps",
        gpt2.num_parameters(),
        len(blocks),
        settings["block_size"],
        settings["steps"],
    )
    gpt2.train()
    start = time.perf_counter()
    for step in range(1, settings["steps"] + 1):
        batch = blocks[torch.randint(len(blocks), (settings["batch_size"],), generator=generator)]  # (B, L)
        loss = gpt2(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt2.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == settings["steps"]:
            logger.info("pretraining step %d: loss %.4f", step, loss.item())
    seconds = time.perf_counter() - start
    validation_loss = mean_loss(gpt2, validation)
    output_dir.mkdir(parents=True, exist_ok=True)
    gpt2.save_pretrained(output_dir)
    tok.save_pretrained(output_dir)
    card = ModelCardData(license="apache-2.0", library_name="transformers", tags=["gpt2"])
    ModelCard(f"---\n{card.to_yaml()}\n---\n\nA small GPT-2 pretrained by performer-hf's zoo.\n").save(
        output_dir / "README.md"
    )
    result = {
        **settings,
        "tokenizer_vocab_size": len(tok),
        "parameters": gpt2.num_parameters(),
        "train_blocks": len(blocks),
        "validation_loss": validation_loss,
        "validation_perplexity": math.exp(validation_loss),
        "seconds": seconds,
    }
    (output_dir / PRETRAINING_FILE).write_text(json.dumps(result, indent=2) + "\n")
    logger.info("pretrained GPT-2: validation perplexity %.2f in %.0f s", result["validation_perplexity"], seconds)
    return result
