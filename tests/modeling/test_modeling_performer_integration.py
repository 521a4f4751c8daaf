"""The Performer in the Hugging Face ecosystem: exact mode against transformers' own BERT and GPT-2,
Hub remote code in a process without performer_hf, and training with the HF Trainer."""

import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from performer_hf import PerformerForCausalLM, PerformerForMaskedLM, PerformerModel

from ..remote_code import load_without_performer_hf
from ..tiny_models import HEADS, HIDDEN, LAYERS, VOCAB, random_ids, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")

# ---------------------------------------------------------------- exact mode == transformers' softmax attention


def _copy(dst: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor) -> None:
    dst.weight.copy_(weight)
    dst.bias.copy_(bias)


@torch.no_grad()
def _bert_into_performer(bert: BertModel, performer: PerformerModel) -> None:
    """Independent of performer_hf.conversion: a hand-written BERT -> Performer weight copy."""
    e, pe = bert.embeddings, performer.embeddings
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm"):
        getattr(pe, name).load_state_dict(getattr(e, name).state_dict())
    for src, dst in zip(bert.encoder.layer, performer.encoder.layer, strict=True):
        for name in ("query", "key", "value"):
            getattr(dst.attention, name).load_state_dict(getattr(src.attention.self, name).state_dict())
        dst.attention.output.load_state_dict(src.attention.output.dense.state_dict())
        dst.attention_norm.load_state_dict(src.attention.output.LayerNorm.state_dict())
        dst.mlp.fc_in.load_state_dict(src.intermediate.dense.state_dict())
        dst.mlp.fc_out.load_state_dict(src.output.dense.state_dict())
        dst.mlp_norm.load_state_dict(src.output.LayerNorm.state_dict())
    performer.pooler.dense.load_state_dict(bert.pooler.dense.state_dict())


@torch.no_grad()
def _gpt2_into_performer(gpt2: GPT2LMHeadModel, performer: PerformerForCausalLM) -> None:
    """GPT-2's Conv1D stores (in, out): transpose into nn.Linear's (out, in)."""
    t, pe = gpt2.transformer, performer.performer.embeddings
    pe.word_embeddings.weight.copy_(t.wte.weight)
    pe.position_embeddings.weight.copy_(t.wpe.weight)
    for src, dst in zip(t.h, performer.performer.encoder.layer, strict=True):
        qkv_w, qkv_b = src.attn.c_attn.weight.T.chunk(3, dim=0), src.attn.c_attn.bias.chunk(3)
        for name, w, b in zip(("query", "key", "value"), qkv_w, qkv_b, strict=True):
            _copy(getattr(dst.attention, name), w, b)
        _copy(dst.attention.output, src.attn.c_proj.weight.T, src.attn.c_proj.bias)
        dst.attention_norm.load_state_dict(src.ln_1.state_dict())
        _copy(dst.mlp.fc_in, src.mlp.c_fc.weight.T, src.mlp.c_fc.bias)
        _copy(dst.mlp.fc_out, src.mlp.c_proj.weight.T, src.mlp.c_proj.bias)
        dst.mlp_norm.load_state_dict(src.ln_2.state_dict())
    performer.performer.encoder.final_norm.load_state_dict(t.ln_f.state_dict())


def test_exact_post_ln_model_equals_bert_with_padding_and_token_types():
    torch.manual_seed(0)
    bert = BertModel(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=37,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    ).eval()
    performer = PerformerModel(tiny_config(attention_kernel="exact")).eval()
    _bert_into_performer(bert, performer)
    ids, mask = random_ids(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    with torch.no_grad():
        ref = bert(input_ids=ids, attention_mask=mask, token_type_ids=types)
        out = performer(input_ids=ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], ref.last_hidden_state[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=1e-5, atol=1e-5)


def test_exact_pre_ln_causal_lm_equals_gpt2_forward_and_generation():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_inner=37,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            pad_token_id=0,
        )
    ).eval()
    performer = PerformerForCausalLM(
        tiny_config(
            attention_kernel="exact",
            layer_norm_position="pre",
            hidden_act="gelu_new",
            layer_norm_eps=1e-5,
            type_vocab_size=0,
        )
    ).eval()
    _gpt2_into_performer(gpt2, performer)
    ids, mask = random_ids(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    with torch.no_grad():
        ref, out = gpt2(input_ids=ids, attention_mask=mask).logits, performer(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)

    left, left_mask = ids.clone(), torch.ones_like(ids)
    left[1, :4], left_mask[1, :4] = 0, 0
    kwargs = {"attention_mask": left_mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(performer.generate(left, **kwargs), gpt2.generate(left, **kwargs))


# ---------------------------------------------------------------- remote code without the package


def test_trust_remote_code_loads_in_a_process_without_performer_hf(tmp_path):
    causal = PerformerForCausalLM(tiny_config(layer_norm_position="pre", type_vocab_size=0)).eval()
    mlm = PerformerForMaskedLM(tiny_config(attention_kernel="relu")).eval()
    causal.save_pretrained(tmp_path / "causal")
    mlm.save_pretrained(tmp_path / "mlm")
    for folder in ("causal", "mlm"):
        copied = {p.name for p in (tmp_path / folder).glob("*.py")}
        assert {
            "modeling_performer.py",
            "configuration_performer.py",
            "cache_performer.py",
            "favor_attention.py",
            "favor_features.py",
            "favor_projection.py",
        } <= copied
    ids = random_ids(2, 9)

    report = load_without_performer_hf(tmp_path, ids)

    assert report["leaked"] == []
    assert report["config"].startswith("transformers_modules.")
    assert all(name.startswith("transformers_modules.") for name in report["classes"])
    with torch.no_grad():
        assert torch.equal(torch.tensor(report["causal_logits"]), causal(input_ids=ids).logits)
        assert torch.equal(torch.tensor(report["mlm_logits"]), mlm(input_ids=ids).logits)
        assert torch.equal(torch.tensor(report["base_hidden"]), mlm.performer(input_ids=ids).last_hidden_state)
    expected = causal.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert report["generated"] == expected.tolist()


# ---------------------------------------------------------------- HF Trainer


class _CopyTask(torch.utils.data.Dataset):
    """Sequences that repeat a random 4-token motif: learnable by a tiny causal LM in a few steps."""

    def __init__(self, size=64, length=16):
        g = torch.Generator().manual_seed(0)
        motifs = torch.randint(1, VOCAB, (size, 4), generator=g)
        self.ids = motifs.repeat(1, length // 4)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def test_hf_trainer_reduces_the_loss(tmp_path):
    torch.manual_seed(0)
    model = PerformerForCausalLM(tiny_config(layer_norm_position="pre", type_vocab_size=0))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=30,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        activation_checkpointing=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_CopyTask(), eval_dataset=_CopyTask(size=16))
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    assert trainer.evaluate()["eval_loss"] < before
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 30 and all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, losses
