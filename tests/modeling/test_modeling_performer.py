"""Tiny-config model tester for the Performer family: shapes, losses, padding, causality, save/load,
Auto classes, gradient checkpointing, redraw, mixed precision and configuration validation.

Generation and the recurrent cache: test_modeling_performer_generation.py. Hub remote code, the HF
Trainer and parity with transformers' BERT / GPT-2: test_modeling_performer_integration.py.
"""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    DynamicCache,
)

from performer_hf import (
    PerformerConfig,
    PerformerForCausalLM,
    PerformerForMaskedLM,
    PerformerForQuestionAnswering,
    PerformerForSequenceClassification,
    PerformerForTokenClassification,
    PerformerModel,
)
from performer_hf.modeling.modeling_performer import CACHE_FIELD

from ..tiny_models import HEADS, HIDDEN, LAYERS, METHODS, VOCAB, random_centres, random_ids, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

KERNELS = ["softmax", "relu", "exact"]
LN_POSITIONS = ["post", "pre"]
HEAD_AUTO = {
    PerformerModel: AutoModel,
    PerformerForMaskedLM: AutoModelForMaskedLM,
    PerformerForCausalLM: AutoModelForCausalLM,
    PerformerForSequenceClassification: AutoModelForSequenceClassification,
    PerformerForTokenClassification: AutoModelForTokenClassification,
    PerformerForQuestionAnswering: AutoModelForQuestionAnswering,
}


def main_output(model, **inputs) -> torch.Tensor:
    out = model(**inputs)
    return out.last_hidden_state if isinstance(model, PerformerModel) else out[0]


# ---------------------------------------------------------------- heads, shapes, losses


@pytest.mark.parametrize("ln", LN_POSITIONS)
def test_every_head_has_the_right_shapes_and_a_loss(ln):
    B, L = 2, 11
    ids, mask = random_ids(B, L), torch.ones(B, L, dtype=torch.long)
    mask[1, 8:] = 0
    g = torch.Generator().manual_seed(1)
    labels = {
        PerformerForMaskedLM: {"labels": torch.randint(0, VOCAB, (B, L), generator=g)},
        PerformerForCausalLM: {"labels": ids},
        PerformerForSequenceClassification: {"labels": torch.tensor([0, 2])},
        PerformerForTokenClassification: {"labels": torch.randint(0, 3, (B, L), generator=g)},
        PerformerForQuestionAnswering: {"start_positions": torch.tensor([1, 3]), "end_positions": torch.tensor([4, 6])},
    }
    for head in HEAD_AUTO:
        model = tiny_model(head, layer_norm_position=ln).train()
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **labels.get(head, {}))
        assert len(out.hidden_states) == LAYERS + 1
        assert all(h.shape == (B, L, HIDDEN) for h in out.hidden_states)
        if head is PerformerModel:
            assert out.last_hidden_state.shape == (B, L, HIDDEN) and out.pooler_output.shape == (B, HIDDEN)
            torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
            continue
        expected = {
            PerformerForMaskedLM: ("logits", (B, L, VOCAB)),
            PerformerForCausalLM: ("logits", (B, L, VOCAB)),
            PerformerForSequenceClassification: ("logits", (B, 3)),
            PerformerForTokenClassification: ("logits", (B, L, 3)),
            PerformerForQuestionAnswering: ("start_logits", (B, L)),
        }[head]
        assert getattr(out, expected[0]).shape == expected[1], head.__name__
        assert out.loss.dim() == 0 and torch.isfinite(out.loss), head.__name__
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads), head.__name__


def test_the_masked_lm_decoder_adds_its_bias_once_and_a_wrapped_decoder_runs_its_own_forward():
    """The MLM head's logits are the decoder's product plus the separate bias (BERT's ``cls.predictions.bias``), in
    one fused call for a plain ``nn.Linear`` decoder; a decoder with hooks (an adapter, offloading) runs its own
    call: its backward hook runs, its forward hook's change reaches the logits."""
    model = tiny_model(PerformerForMaskedLM).eval()
    with torch.no_grad():
        model.lm_head.bias.normal_(generator=torch.Generator().manual_seed(0))
    head, hidden = model.lm_head, torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1))
    transformed = head.layer_norm(head.act(head.dense(hidden)))
    want = transformed @ head.decoder.weight.T + head.bias  # (2, 5, vocab)
    torch.testing.assert_close(head(hidden), want)
    backward = []
    head.decoder.register_full_backward_hook(lambda module, grad_in, grad_out: backward.append(1))
    head(hidden.requires_grad_()).sum().backward()
    assert backward == [1]  # a backward hook runs only through the decoder's own call
    head.decoder.register_forward_hook(lambda module, args, output: output * 2)
    torch.testing.assert_close(head(hidden), 2 * (want - head.bias) + head.bias)


@pytest.mark.parametrize("head", [PerformerForMaskedLM, PerformerForCausalLM])
def test_a_mask_with_nothing_padded_is_dropped_before_attention(head):
    """A tokenizer's mask of a batch without padding (all ones) reaches attention as no mask (its unmasked paths:
    flash, a hybrid mask without key lookups), the outputs unchanged; a mask with padding reaches it."""
    model = tiny_model(head).eval()
    seen = []
    for module in model.modules():
        if hasattr(module, "attend"):
            attend = module.attend
            module.attend = lambda m, q, k, v, key_mask, *rest, attend=attend: (
                seen.append(key_mask) or attend(m, q, k, v, key_mask, *rest)
            )
    ids = random_ids(2, 9)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        unmasked = model(input_ids=ids, use_cache=False).logits
        ones = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert len(seen) == 2 * LAYERS and all(key_mask is None for key_mask in seen)
        mask[1, 6:] = 0
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    torch.testing.assert_close(ones, unmasked, rtol=0, atol=0)
    assert all(key_mask is not None for key_mask in seen[2 * LAYERS :])


def test_causal_lm_loss_is_shifted_cross_entropy_and_honours_num_items():
    model = tiny_model()
    ids = random_ids(2, 9)
    labels = ids.clone()
    labels[0, 5:] = -100
    out = model(input_ids=ids, labels=labels)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref)
    scored = int((labels[:, 1:] != -100).sum())
    summed = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(2 * scored)).loss
    torch.testing.assert_close(summed, ref / 2)


def test_logits_to_keep_returns_the_last_positions():
    model = tiny_model()
    ids = random_ids(2, 9)
    full = model(input_ids=ids).logits
    torch.testing.assert_close(model(input_ids=ids, logits_to_keep=1).logits, full[:, -1:])


def test_output_attentions_exact_returns_weights():
    ids = random_ids(2, 7)
    model = tiny_model(attention_kernel="exact", layer_norm_position="pre")
    out = model(input_ids=ids, output_attentions=True)
    assert len(out.attentions) == LAYERS and out.attentions[0].shape == (2, HEADS, 7, 7)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, HEADS, 7))
    assert (out.attentions[1].triu(diagonal=1) == 0).all()  # causal
    torch.testing.assert_close(out.logits, model(input_ids=ids).logits)  # same result as the SDPA path


def test_output_attentions_leave_a_row_of_padding_only_as_it_is_without_them():
    """Exact attention's weights for a row whose every token is padding: none (zero), and its outputs what SDPA's
    path gives without weights (they were NaN: softmax over keys that are all masked)."""
    model = tiny_model(PerformerForSequenceClassification, attention_kernel="exact")
    ids, mask = random_ids(2, 7), torch.ones(2, 7, dtype=torch.long)
    mask[0] = 0
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert plain.isfinite().all()
    torch.testing.assert_close(out.logits, plain)
    assert (out.attentions[0][0] == 0).all()
    torch.testing.assert_close(out.attentions[0][1].sum(-1), torch.ones(HEADS, 7))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("method", ["favor", "hybrid"])
def test_output_attentions_of_linear_attention_is_the_matrix_it_implies(method, causal):
    """Each layer's matrix reproduces the layer's output from its values (context = A v, captured from the attention
    method), is row-stochastic and non-negative, masks the future (causal) and the padded keys, and leaves the model's
    outputs as they are; the hybrid's settings keep the approximation in use (a window of 2 tokens, no exact
    dispatch)."""
    settings = {**METHODS[method], "exact_max_length": 0}
    if method == "hybrid":
        settings.update(local_window=2, num_global_tokens=1)
    model = tiny_model(PerformerForCausalLM if causal else PerformerForMaskedLM, **settings, is_decoder=causal)
    random_centres(model)
    ids, mask = random_ids(2, 24), torch.ones(2, 24, dtype=torch.long)
    mask[1, 18:] = 0
    calls = []
    attention = model.base_model.encoder.layer[0].attention
    original = attention.attend
    attention.attend = lambda module, q, k, v, *rest: calls.append(v) or original(module, q, k, v, *rest)
    captured = {}
    hook = attention.register_forward_hook(lambda _m, _a, out: captured.setdefault("context", out))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
        plain = model(input_ids=ids, attention_mask=mask, use_cache=False)
    hook.remove()
    weights = out.attentions[0]  # (B, H, L, L)
    assert weights.shape == (2, HEADS, 24, 24) and (weights >= -1e-6).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, HEADS, 24))
    assert weights[1, :, :, 18:].abs().max() == 0  # padded keys get no weight
    if causal:
        assert weights.triu(diagonal=1).abs().max() == 0
    values = calls[0]  # the values the layer attended with (B, H, L, D)
    context = (weights @ values).transpose(1, 2).reshape(2, 24, -1)  # (B, L, hidden), before the output projection
    torch.testing.assert_close(attention.output(context), captured["context"][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.logits, plain.logits)


def test_output_attentions_of_linear_attention_names_its_limits():
    model = tiny_model(attention_kernel="softmax", max_position_embeddings=1100)
    with pytest.raises(ValueError, match="at most 1024 tokens.*this input has 1025"):
        model(input_ids=random_ids(1, 1025), output_attentions=True, use_cache=False)
    cache = getattr(model(input_ids=random_ids(1, 5), use_cache=True), CACHE_FIELD)
    with pytest.raises(ValueError, match="decodes after 5 cached tokens"):
        model(input_ids=random_ids(1, 1), cache=cache, output_attentions=True)


def test_a_cache_passed_to_a_bidirectional_model_raises_and_use_cache_is_ignored():
    model = tiny_model(PerformerModel)
    with pytest.raises(ValueError, match="needs causal attention"):
        model(input_ids=random_ids(), cache=DynamicCache(config=model.config))
    assert getattr(model(input_ids=random_ids(), use_cache=True), CACHE_FIELD) is None  # as transformers' encoders


def test_attention_mask_of_the_wrong_length_or_batch_raises():
    """A mask of one row for a batch of two was broadcast to every row by exact attention (row 1 masked with row 0's
    mask) and refused inside FAVOR+ under an internal name."""
    with pytest.raises(ValueError, match=r"attention_mask must be 2D .* = \(2, 5\) .* got \(2, 6\)"):
        tiny_model()(input_ids=random_ids(2, 5), attention_mask=torch.ones(2, 6))
    for method in METHODS:
        with pytest.raises(ValueError, match=r"attention_mask must be 2D .* = \(2, 5\) .* got \(1, 5\)"):
            tiny_model(PerformerModel, **METHODS[method])(input_ids=random_ids(2, 5), attention_mask=torch.ones(1, 5))


# ---------------------------------------------------------------- padding and causality


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("ln", LN_POSITIONS)
@pytest.mark.parametrize("head", [PerformerModel, PerformerForCausalLM])
def test_right_padding_leaves_real_positions_unchanged(kernel, ln, head):
    model = tiny_model(head, attention_kernel=kernel, layer_norm_position=ln)
    ids = random_ids(2, 13)
    lengths = [13, 8]
    padded, mask = ids.clone(), torch.ones_like(ids)
    padded[1, 8:], mask[1, 8:] = 0, 0
    with torch.no_grad():
        batched = main_output(model, input_ids=padded, attention_mask=mask)
        for row, n in enumerate(lengths):
            alone = main_output(model, input_ids=ids[row : row + 1, :n])
            torch.testing.assert_close(batched[row, :n], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_causal_outputs_do_not_see_later_tokens(kernel):
    model = tiny_model(attention_kernel=kernel, layer_norm_position="pre")
    ids = random_ids(2, 13)
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 7) % VOCAB
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, model(input_ids=changed).logits
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_encoder_heads_are_bidirectional():
    model = tiny_model(PerformerModel)
    ids = random_ids(1, 9)
    changed = ids.clone()
    changed[0, 8] = (changed[0, 8] + 7) % VOCAB
    with torch.no_grad():
        a, b = main_output(model, input_ids=ids), main_output(model, input_ids=changed)
    assert not torch.allclose(a[:, 0], b[:, 0])


# ---------------------------------------------------------------- save / load / Auto


@pytest.mark.parametrize("kernel", ["softmax", "exact"])
def test_save_load_round_trip_is_bit_identical(tmp_path, kernel):
    ids, mask = random_ids(2, 9), torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    for head, auto in HEAD_AUTO.items():
        model = tiny_model(head, attention_kernel=kernel)
        model.redraw_projections(seed=5)  # the checkpoint must carry the current features, not re-derive them
        folder = tmp_path / head.__name__
        model.save_pretrained(folder)
        assert (folder / "model.safetensors").exists()
        for reloaded in (head.from_pretrained(folder).eval(), auto.from_pretrained(folder).eval()):
            assert type(reloaded) is head
            with torch.no_grad():
                before = main_output(model, input_ids=ids, attention_mask=mask)
                after = main_output(reloaded, input_ids=ids, attention_mask=mask)
            assert torch.equal(before, after), head.__name__
            for name, buffer in model.named_buffers():
                assert torch.equal(buffer, reloaded.get_buffer(name)), name


def test_auto_config_and_auto_model_from_config():
    config = tiny_config()
    assert type(AutoConfig.for_model("performer", hidden_size=HIDDEN, num_attention_heads=HEADS)) is PerformerConfig
    for head, auto in HEAD_AUTO.items():
        assert type(auto.from_config(config)) is head


def test_save_pretrained_lists_every_head_for_remote_code(tmp_path):
    tiny_model(PerformerForMaskedLM).save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_performer.PerformerConfig"
    for head, auto in HEAD_AUTO.items():
        assert auto_map[auto.__name__] == f"modeling_performer.{head.__name__}"
    copied = {p.name for p in tmp_path.glob("*.py")}
    assert {
        "modeling_performer.py",
        "configuration_performer.py",
        "cache_performer.py",
        "favor_attention.py",
        "favor_features.py",
        "favor_projection.py",
    } <= copied


# ---------------------------------------------------------------- gradient checkpointing


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_equal_gradients(kernel, reentrant):
    ids, mask = random_ids(2, 10), torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0

    def grads(checkpointing: bool):
        model = tiny_model(PerformerForCausalLM, attention_kernel=kernel, layer_norm_position="pre").train()
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
        calls = []
        for layer in model.performer.encoder.layer:
            layer.attention.register_forward_hook(lambda *_: calls.append(1))
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        assert len(calls) == LAYERS * (2 if checkpointing else 1)  # checkpointed layers re-run in backward
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


# ---------------------------------------------------------------- random features


def _projections(model) -> list[torch.Tensor]:
    return [b.clone() for n, b in model.named_buffers() if n.endswith("attention.projection")]


def test_projections_are_seeded_buffers_and_redraw_is_deterministic():
    a, b = tiny_model(seed=0), tiny_model(seed=1)  # different weights, same projection_seed
    assert all(torch.equal(x, y) for x, y in zip(_projections(a), _projections(b), strict=True))
    first = _projections(a)
    assert not torch.equal(first[0], first[1])  # one draw per layer
    a.redraw_projections(seed=3)
    b.redraw_projections(seed=3)
    redrawn = _projections(a)
    assert all(torch.equal(x, y) for x, y in zip(redrawn, _projections(b), strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(redrawn, first, strict=True))
    a.redraw_projections(seed=4)
    assert not any(torch.equal(x, y) for x, y in zip(_projections(a), redrawn, strict=True))
    other_seed = tiny_model(projection_seed=7)
    assert not torch.equal(_projections(other_seed)[0], first[0])
    a.redraw_projections(seed=torch.tensor(4))  # a step counter kept as a tensor: the same draw as the number
    b.redraw_projections(seed=4)
    assert all(torch.equal(x, y) for x, y in zip(_projections(a), _projections(b), strict=True))
    time_seed = 1_700_000_000_000_000  # a microsecond timestamp: past 2**63 / 1_000_003
    a.redraw_projections(seed=time_seed)
    b.redraw_projections(seed=time_seed)
    assert all(torch.equal(x, y) for x, y in zip(_projections(a), _projections(b), strict=True))
    for bad in (None, "3", 1.5, -1):
        with pytest.raises(ValueError, match="redraw_projections takes a whole number >= 0 as seed"):
            a.redraw_projections(seed=bad)


@pytest.mark.parametrize("auto", [False, True], ids=["class", "AutoModel"])
def test_loading_with_other_feature_settings_draws_the_features_they_name(auto, tmp_path):
    """from_pretrained(folder, projection_seed=5) named seed 5 in the config but ran (and saved) the checkpoint's
    seed-0 features: |diff| 1.87 to a model drawn with seed 5 on the real MiniLM. The features are drawn from the
    settings given; the same settings, or a model whose features training redrew, keep the checkpoint's; another
    nb_features is refused with the fix."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained if auto else PerformerForCausalLM.from_pretrained
    saved = tiny_model()
    saved.redraw_projections(seed=11)  # as training does: features no seed of the config draws
    saved.save_pretrained(tmp_path)
    for settings in ({}, {"projection_seed": saved.config.projection_seed}):
        kept = load(tmp_path, **settings)
        assert all(torch.equal(x, y) for x, y in zip(_projections(kept), _projections(saved), strict=True))
    for settings in ({"projection_seed": 5}, {"feature_coupling": "iid"}, {"feature_row_norms": "sqrt_d"}):
        drawn = load(tmp_path, **settings)
        expected = _projections(tiny_model(**settings))
        assert all(torch.equal(x, y) for x, y in zip(_projections(drawn), expected, strict=True)), settings
    with pytest.raises(ValueError, match="nb_features=8 differs from the checkpoint's 16: .* Convert the source"):
        load(tmp_path, nb_features=8)


@pytest.mark.parametrize("model_class", [PerformerModel, PerformerForCausalLM])
def test_an_attn_implementation_of_transformers_is_refused_with_the_fix(model_class, tmp_path, caplog):
    """attn_implementation='sdpa' met transformers' 'does not support ... request the support' message, which does
    not say that attention_kernel='exact' runs exact attention (through SDPA). 'eager', which transformers records
    for the family (its heads' base model is checked with it), loads without a word."""
    from transformers import AutoModel

    tiny_model(model_class).save_pretrained(tmp_path)
    for name in ("sdpa", "flash_attention_2"):
        with pytest.raises(ValueError, match=f"not attn_implementation='{name}': set attention_kernel='exact'"):
            AutoModel.from_pretrained(tmp_path, attn_implementation=name)
    with caplog.at_level(logging.WARNING):
        AutoModel.from_pretrained(tmp_path, attn_implementation="eager")
        model_class(tiny_config())
    assert not [record for record in caplog.records if record.name.startswith("performer_hf")]


def test_forward_never_redraws():
    model = tiny_model(feature_redraw_interval=1)
    before = _projections(model)
    ids = random_ids()
    for mode in (model.train, model.eval):
        mode()
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.equal(x, y) for x, y in zip(before, _projections(model), strict=True))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


# ---------------------------------------------------------------- mixed precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_half_precision_outputs_are_finite_and_close(dtype, kernel):
    model = tiny_model(attention_kernel=kernel, layer_norm_position="pre")
    ids, mask = random_ids(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        half = model.to(dtype)(input_ids=ids, attention_mask=mask).logits
    assert half.dtype == dtype and torch.isfinite(half).all()
    assert (half.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_bf16_autocast_training_step_is_finite():
    model = tiny_model(PerformerForMaskedLM).train()
    ids = random_ids(2, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_inputs_and_labels_of_the_wrong_shape_or_kind_are_refused_by_name():
    """Labels that do not match the logits (another length or batch, floats) gave a loss silently (the tokens were
    scored against the wrong rows) or failed inside torch; an unbatched input failed with an IndexError; a GPT-2
    conversion (no token type embeddings) ignored token_type_ids, which its source adds; an input without tokens failed
    inside FAVOR+'s and the hybrid's kernels (a division by zero, a reshape); a negative position id or a token type
    past the table, with an IndexError inside torch; token type or position ids of another shape, or embeddings of
    another width, with a broadcast error inside torch."""
    ids = random_ids(2, 10)
    mlm = tiny_model(PerformerForMaskedLM)
    clm = tiny_model(PerformerForCausalLM)
    cases = [
        (lambda: mlm(input_ids=ids, labels=ids[:, :9]), r"labels must be integer token ids of shape \(2, 10\)"),
        (lambda: mlm(input_ids=ids, labels=ids.float()), r"got torch.float32 labels of shape \(2, 10\)"),
        (lambda: clm(input_ids=ids, labels=ids[:1]), r"labels must be token ids of shape \(2, 10\) .* got \(1, 10\)"),
        (lambda: clm(input_ids=ids, labels=ids.reshape(-1)), r"got \(20,\)"),
        (lambda: clm(input_ids=ids[0]), r"input_ids must be a batch: \(batch, length\), got shape \(10,\)"),
        (lambda: clm(input_ids=ids[:, :0]), r"input_ids of shape \(2, 0\) hold no token"),  # failed in FAVOR+
        (lambda: mlm(inputs_embeds=torch.zeros(0, 10, 32)), r"inputs_embeds of shape \(0, 10, 32\) hold no token"),
        (lambda: mlm(input_ids=ids, position_ids=ids * 0 + 64), r"Position id 64 is out of range: .*=64"),
        (lambda: mlm(input_ids=ids, position_ids=ids * 0 - 1), r"Position id -1 is negative"),  # an IndexError
        (lambda: mlm(input_ids=ids, token_type_ids=ids * 0 + 2), r"token_type_ids hold 2, .* type_vocab_size=2"),
        (lambda: mlm(input_ids=ids, token_type_ids=ids[:, :9] * 0), r"token_type_ids must be \(2, 10\) like input_ids"),
        (lambda: mlm(input_ids=ids, position_ids=ids[:, None]), r"position_ids must be \(2, 10\) like input_ids"),
        (lambda: mlm(inputs_embeds=torch.zeros(2, 10, 31)), r"inputs_embeds must be \(batch, length, hidden_size=32\)"),
        (
            lambda: tiny_model(PerformerForCausalLM, type_vocab_size=0)(input_ids=ids, token_type_ids=ids * 0),
            "no token type embeddings",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    torch.testing.assert_close(mlm(input_ids=ids, labels=ids.int()).loss, mlm(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize(
    "model_class", [PerformerModel, PerformerForMaskedLM, PerformerForCausalLM, PerformerForSequenceClassification]
)
def test_config_return_dict_false_gives_tuples_as_the_argument_does(model_class):
    model = tiny_model(model_class)
    ids = random_ids(2, 10)
    with torch.no_grad():
        expected = model(input_ids=ids, return_dict=False)
        model.config.return_dict = False
        given = model(input_ids=ids)
    assert isinstance(expected, tuple) and isinstance(given, tuple)
    torch.testing.assert_close(given[0], expected[0], rtol=0, atol=0)


def test_classification_labels_that_fit_no_problem_type_are_refused_before_it_is_recorded():
    model = tiny_model(PerformerForSequenceClassification, num_labels=3)
    ids = random_ids(2, 10)
    with pytest.raises(ValueError, match=r"multi_label_classification with num_labels=3 are numbers of shape \(2, 3\)"):
        model(input_ids=ids, labels=torch.tensor([0.0, 2.0]))
    assert model.config.problem_type is None  # a refused call records nothing
    with pytest.raises(ValueError, match=r"class ids \(integers\) of shape \(2,\) or \(2, 1\), got torch.int64"):
        model(input_ids=ids, labels=torch.tensor([0, 2, 1]))
    loss = model(input_ids=ids, labels=torch.tensor([0, 2], dtype=torch.int32)).loss
    assert model.config.problem_type == "single_label_classification" and torch.isfinite(loss)


def test_classification_losses_take_the_label_shapes_of_transformers_heads():
    """Regression over several labels takes (B, num_labels) targets (they were refused, and (B,) ones broadcast
    against the logits or failed inside torch); class ids may come as (B, 1), as transformers' heads flatten them."""
    ids = random_ids(4, 10)
    model = tiny_model(PerformerForSequenceClassification, num_labels=3, problem_type="regression")
    targets = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    output = model(input_ids=ids, labels=targets)
    torch.testing.assert_close(output.loss, F.mse_loss(output.logits, targets))
    with pytest.raises(ValueError, match=r"regression with num_labels=3 are numbers of shape \(4, 3\), got"):
        model(input_ids=ids, labels=targets[:, 0])
    single = tiny_model(PerformerForSequenceClassification, num_labels=3)
    classes = torch.tensor([[0], [2], [1], [1]])
    output = single(input_ids=ids, labels=classes)
    torch.testing.assert_close(output.loss, F.cross_entropy(output.logits, classes.view(-1)))
    scalar = tiny_model(PerformerForSequenceClassification, num_labels=1)
    values = torch.randn(4, 1, generator=torch.Generator().manual_seed(1))
    output = scalar(input_ids=ids, labels=values)
    torch.testing.assert_close(output.loss, F.mse_loss(output.logits, values))


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_size": 30}, "multiple of num_attention_heads"),
        ({"attention_kernel": "cosine"}, "attention_kernel='cosine' is not supported"),
        ({"feature_coupling": "gaussian"}, "feature_coupling"),
        ({"feature_row_norms": "unit"}, "feature_row_norms"),
        ({"layer_norm_position": "sandwich"}, "layer_norm_position"),
        ({"nb_features": 0}, "nb_features must be a positive integer"),
        ({"causal_chunk_size": 0}, "causal_chunk_size must be a positive integer"),
        ({"feature_redraw_interval": 0}, "feature_redraw_interval"),
        ({"position_offset": -1}, "position_offset"),
        ({"nb_features": "256"}, "nb_features must be int, got str '256'"),
        ({"nb_features": True}, "nb_features must be int, got bool"),
        ({"is_decoder": "yes"}, "is_decoder must be bool, got str"),
        ({"hidden_dropout_prob": 3.0}, "hidden_dropout_prob is a probability, between 0 and 1"),
        ({"hidden_act": "gelux"}, "hidden_act='gelux' is not an activation of transformers"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"layer_norm_eps": -1e-5}, "layer_norm_eps must be a finite number >= 0"),
        ({"layer_norm_eps": float("nan")}, "layer_norm_eps must be a finite number >= 0"),
        ({"initializer_range": -0.02}, "initializer_range must be a finite number >= 0"),
        ({"pad_token_id": VOCAB}, f"pad_token_id={VOCAB} is not a token of the vocabulary"),
        ({"position_offset": 2, "pad_token_id": None}, "give pad_token_id, or set position_offset=0"),
        ({"projection_seed": 2**64}, "layer i draws its features from projection_seed \\+ i"),
        ({"problem_type": "ranking"}, "problem_type='ranking' is not supported"),
        ({"attention_method": "hybrid", "far_field_gain": float("nan")}, "far_field_gain must be positive and finite"),
        (
            {"attention_method": "hybrid", "attention_kernel": "softmax_opt", "far_field_parameter": float("nan")},
            "far_field_parameter \\(FAVOR\\+\\+'s A\\) must be finite",
        ),
    ],
)
def test_config_validation_names_the_problem(overrides, message):
    with pytest.raises((ValueError, StrictDataclassClassValidationError), match=message):
        tiny_config(**overrides)


def test_a_classifier_without_labels_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="got num_labels=0: give num_labels"):
        tiny_model(PerformerForSequenceClassification, num_labels=0)


def test_roberta_style_positions_are_checked_by_the_real_tokens_they_count():
    """position_offset > 0 numbers real tokens only (padding takes pad_token_id's position): a padded batch whose
    rows fit the table is read, though its padded length plus the offset would not (it was refused, naming a
    position no token has); a row that does not fit is refused."""
    model = tiny_model(PerformerModel, pad_token_id=1, position_offset=2, max_position_embeddings=10)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 1]])  # 8 real tokens (positions 2 ... 9), then a pad
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=(ids != 1).long()).last_hidden_state
        positions = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9, 1]])
        want = model(input_ids=ids, attention_mask=(ids != 1).long(), position_ids=positions).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    longer = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])  # 9 real tokens: position 10
    with pytest.raises(ValueError, match="Position id 10 is out of range"):
        model(input_ids=longer)


def test_config_json_round_trip(tmp_path):
    config = tiny_config(
        attention_kernel="relu",
        layer_norm_position="pre",
        position_offset=2,
        feature_redraw_interval=100,
        feature_coupling="iid",
        feature_row_norms="sqrt_d",
        is_decoder=True,
        type_vocab_size=0,
    )
    config.save_pretrained(tmp_path)
    reloaded = PerformerConfig.from_pretrained(tmp_path)
    assert reloaded.to_dict() == config.to_dict()
    assert PerformerConfig.from_dict(json.loads(config.to_json_string())).to_dict() == config.to_dict()
    assert reloaded.layer_types == ["favor_attention"] * LAYERS
    assert tiny_config(attention_kernel="exact").layer_types == ["full_attention"] * LAYERS
    assert "layer_types" not in json.loads(config.to_json_string())  # derived, not stored


def test_a_performer_attn_implementation_is_refused_by_the_family_which_runs_its_configs(tmp_path):
    """attn_implementation='performer_hybrid' on a Performer-family folder ran its config's FAVOR+ silently, while
    config._attn_implementation said 'performer_hybrid'."""
    tiny_model(PerformerForCausalLM).save_pretrained(tmp_path)
    for implementation in ("performer", "performer_hybrid", "performer_sparse"):
        with pytest.raises(ValueError, match=f"attn_implementation='{implementation}' gives transformers models"):
            PerformerForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation)
    exact = PerformerForCausalLM.from_pretrained(tmp_path, attention_kernel="exact")  # the fix the message names
    assert exact.config.attention_kernel == "exact"


@pytest.mark.parametrize("field, value", [("exact_max_length", 0), ("local_window", 2), ("num_global_tokens", 0)])
def test_attention_settings_changed_after_the_model_was_built_are_refused_before_they_are_saved(field, value, tmp_path):
    """The attention modules read their settings when they are built: a config field set afterwards used to be
    ignored by forward and written by save_pretrained (a hybrid encoder with exact_max_length=32 set to 0: its reload
    1.9 from the saved model's logits). Forward and save refuse it, naming the fix, and write nothing."""
    model = tiny_model(PerformerModel, **METHODS["hybrid"], exact_max_length=32)
    ids = random_ids()
    expected = model(ids).last_hidden_state
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=f"config.{field} changed after this model was built.*from_pretrained"):
        model(ids)
    with pytest.raises(ValueError, match=f"config.{field} changed after this model was built"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    setattr(model.config, field, {"exact_max_length": 32, "local_window": 4, "num_global_tokens": 1}[field])
    torch.testing.assert_close(model(ids).last_hidden_state, expected, rtol=0, atol=0)  # set back: runs as built


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"exact_max_length": -5}, "exact_max_length must be >= 0"),
        ({"layer_norm_position": "x"}, "layer_norm_position='x' is not supported"),
        ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob is a probability"),
        ({"hidden_act": "nope"}, "hidden_act='nope' is not an activation"),
        ({"causal_chunk_size": 0}, "causal_chunk_size must be a positive integer"),
        ({"attention_method": "bogus"}, "attention_method='bogus' is not supported"),
    ],
)
def test_settings_given_to_from_pretrained_are_checked_as_the_configs_are(settings, message, tmp_path):
    """from_pretrained sets its keyword arguments on the loaded config one by one, past the config's checks: they
    loaded silently (exact_max_length=-5), or failed deep in torch, or at a later save after writing its code files."""
    tiny_model(PerformerForMaskedLM, **METHODS["hybrid"]).save_pretrained(tmp_path)
    for loader in (PerformerForMaskedLM, AutoModelForMaskedLM):
        with pytest.raises(ValueError, match=message):
            loader.from_pretrained(tmp_path, **settings)


def test_a_causal_lm_checks_the_decoder_settings_whatever_is_decoder_says():
    """PerformerForCausalLM attends causally with any config, so the decoders' checks apply: FAVOR+ with an exact
    prefix, accepted with is_decoder=False and then ignored (the first 16 positions 4.85 from exact attention), is
    refused as it is with is_decoder=True."""
    for is_decoder in (True, False):
        refused = (ValueError, StrictDataclassClassValidationError)  # the model's, or the config's (is_decoder=True)
        with pytest.raises(refused, match="exact_max_length=16 with is_decoder=True needs the hybrid method"):
            PerformerForCausalLM(tiny_config(**METHODS["favor"], exact_max_length=16, is_decoder=is_decoder))


def test_a_causal_lm_of_an_encoder_config_names_the_encoder_loaders(tmp_path):
    """A converted encoder's folder (the default hybrid, routed, exact on accelerators up to 8K) loaded with
    AutoModelForCausalLM (its auto_map offers it) was refused one causal setting at a time, without saying that the
    folder is an encoder: the error says so and names the loaders that take it."""
    encoder = PerformerModel(tiny_config(routed_blocks=2, accelerator_exact_max_length=64))
    encoder.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"bidirectional encoder's \(is_decoder=False\).*AutoModelForMaskedLM"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_stray_field_is_refused_with_a_method_that_takes_it():
    """A sparse decoder given exact_max_length was told to set attention_method='favor', itself refused for decoders
    with an exact prefix: the fix named is the hybrid, which takes it."""
    sparse = {"attention_method": "sparse", "local_window": 8, "select_block_size": 4, "is_decoder": True}
    with pytest.raises(StrictDataclassClassValidationError, match="set attention_method='hybrid'"):
        PerformerConfig(**sparse, exact_max_length=16)
    tiny_config(
        attention_method="hybrid", attention_kernel="poly2", local_window=8, is_decoder=True, exact_max_length=16
    )


def test_question_answering_takes_positions_as_one_column_too():
    """transformers' question-answering heads take (B, 1) start / end positions (a squeezed loss): so does ours,
    with the loss of (B,) positions (it was torch's 'multi-target not supported')."""
    model = tiny_model(PerformerForQuestionAnswering, **METHODS["favor"])
    ids, starts, ends = random_ids(), torch.tensor([1, 3]), torch.tensor([4, 6])
    flat = model(ids, start_positions=starts, end_positions=ends).loss
    column = model(ids, start_positions=starts[:, None], end_positions=ends[:, None]).loss
    torch.testing.assert_close(column, flat, rtol=0, atol=0)


def test_input_ids_out_of_the_vocabulary_are_refused_by_name():
    model = tiny_model(PerformerModel, **METHODS["favor"])
    for bad in (VOCAB, -1):
        ids = random_ids()
        ids[1, 3] = bad
        with pytest.raises(ValueError, match=f"input_ids hold {bad}, out of range: this model has vocab_size={VOCAB}"):
            model(ids)
