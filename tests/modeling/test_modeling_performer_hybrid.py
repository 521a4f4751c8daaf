"""Hybrid attention (exact window / global tokens / routed blocks + a linear far field) in the models:
config fields, the attention module against dense O(L^2) references, padding, causality, the
constant-size decoding cache, save/load, remote code and conversion with the new settings."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, GPT2LMHeadModel

from performer_hf import PerformerConfig, PerformerForCausalLM, PerformerForMaskedLM, PerformerModel
from performer_hf.cli import main
from performer_hf.conversion import convert
from performer_hf.conversion.convert import METHODS
from performer_hf.conversion.fidelity import sample_batch
from performer_hf.modeling.cache_performer import HybridCacheLayer
from performer_hf.modeling.modeling_performer import CACHE_FIELD

from ..conversion_sources import CASES, save_source
from ..hybrid_reference import reference
from ..remote_code import load_without_performer_hf
from ..tiny_models import (
    HEADS,
    HIDDEN,
    HYBRID_BIDIRECTIONAL,
    LAYERS,
    random_centres,
    random_ids,
    tiny_config,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")

HEAD_DIM = HIDDEN // HEADS
CAUSAL = dict(attention_kernel="poly2", center_features=True, local_window=4, num_global_tokens=1)
PER_LAYER_A = [[-0.05 * (h + 1) for h in range(HEADS)] for _ in range(LAYERS)]


def hybrid_model(model_class, seed=0, **overrides):
    """A tiny model (see tiny_config) with random non-zero fixed centres when it centres."""
    return random_centres(tiny_model(model_class, seed, **overrides))


# ---------------------------------------------------------------- configuration


def test_hybrid_fields_round_trip_through_json(tmp_path):
    config = tiny_config(
        attention_kernel="softmax_opt",
        feature_coupling="simplex",
        local_window=7,
        num_global_tokens=2,
        routed_blocks=3,
        route_block_size=5,
        route_group_size=2,
        query_block_size=6,
        center_features=True,
        far_field_parameter=PER_LAYER_A,
    )
    config.save_pretrained(tmp_path)
    reloaded = PerformerConfig.from_pretrained(tmp_path)
    for name in (
        "attention_kernel",
        "feature_coupling",
        "local_window",
        "num_global_tokens",
        "routed_blocks",
        "route_block_size",
        "route_group_size",
        "query_block_size",
        "center_features",
        "far_field_parameter",
    ):
        assert getattr(reloaded, name) == getattr(config, name), name
    assert json.loads((tmp_path / "config.json").read_text())["far_field_parameter"] == PER_LAYER_A
    assert reloaded.uses_hybrid_attention and reloaded.layer_types == ["hybrid_attention"] * LAYERS


@pytest.mark.parametrize(
    "overrides, hybrid, layer_type",
    [
        ({}, False, "favor_attention"),  # plain FAVOR+ stays plain FAVOR+
        ({"feature_coupling": "simplex"}, False, "favor_attention"),
        ({"attention_kernel": "poly2"}, True, "hybrid_attention"),  # polynomial kernels exist only in the hybrid
        ({"local_window": 3}, True, "hybrid_attention"),
        ({"center_features": True, "attention_kernel": "softmax_hyperbolic"}, True, "hybrid_attention"),
        (
            {**HYBRID_BIDIRECTIONAL, "attention_kernel": "exact"},
            False,
            "full_attention",
        ),  # exact ignores the hybrid fields
    ],
)
def test_which_attention_a_config_selects(overrides, hybrid, layer_type):
    # configs that do not name their method (those saved before attention_method existed) get the one their
    # fields always selected, and record it
    config = tiny_config(**overrides)
    assert config.uses_hybrid_attention == hybrid and config.layer_types == [layer_type] * LAYERS
    method = {"favor_attention": "favor", "hybrid_attention": "hybrid", "full_attention": "exact"}[layer_type]
    assert config.attention_method == method and config.to_dict()["attention_method"] == method


def test_a_config_saved_without_its_method_loads_with_the_method_its_fields_select(tmp_path):
    config = tiny_config(**HYBRID_BIDIRECTIONAL)
    saved = {key: value for key, value in config.to_dict().items() if key != "attention_method"}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert PerformerConfig.from_pretrained(tmp_path).attention_method == "hybrid"
    # attention_kernel="exact" is exact attention, whatever method a copied config names
    assert PerformerConfig.from_dict({**config.to_dict(), "attention_kernel": "exact"}).attention_method == "exact"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"local_window": -1}, "local_window must be >= 0"),
        ({"route_block_size": 0}, "route_block_size must be a positive integer"),
        ({"route_group_size": -1}, "route_group_size must be >= 0"),
        ({"attention_kernel": "relu", "local_window": 5}, "'relu' is not a kernel of attention_method='hybrid'"),
        ({"attention_kernel": "bogus"}, "attention_kernel='bogus' is not supported"),
        ({"feature_coupling": "bogus"}, "feature_coupling='bogus' is not supported"),
        ({"is_decoder": True, "routed_blocks": 2}, "Set routed_blocks=0 for causal models"),
        ({"is_decoder": True, "attention_kernel": "softmax_opt"}, "needs a fixed far_field_parameter"),
        ({"attention_kernel": "poly2", "far_field_parameter": -0.1}, "only applies to attention_kernel='softmax_opt'"),
        ({"attention_kernel": "softmax_opt", "far_field_parameter": [[-0.1] * HEADS]}, "num_hidden_layers=2 lists"),
        ({"attention_kernel": "softmax_opt", "far_field_parameter": 0.2}, "must be below 1/8"),
        ({"attention_kernel": "poly2", "far_field_gain": 0.0}, "far_field_gain must be positive"),
        ({"attention_kernel": "poly2", "far_field_gain": [[1.0] * HEADS]}, "num_hidden_layers=2 lists"),
        ({"attention_kernel": "relu", "far_field_gain": 0.5}, "'relu' is not a kernel of attention_method='hybrid'"),
        # an explicit method is validated against the fields it reads: another method's fields are refused
        ({"attention_method": "favor", "local_window": 3}, "local_window is not read by attention_method='favor'"),
        ({"attention_method": "favor", "far_field_gain": 0.5}, "set attention_method='hybrid'"),
        ({"attention_method": "favor", "attention_kernel": "poly2"}, "or set attention_method='hybrid'"),
        ({"attention_method": "hybrid", "attention_kernel": "elu"}, "or set attention_method='favor'"),
        ({"attention_method": "bogus"}, "attention_method='bogus' is not supported"),
    ],
)
def test_invalid_hybrid_settings_name_the_problem(overrides, message):
    with pytest.raises((ValueError, StrictDataclassClassValidationError), match=message):
        tiny_config(**overrides)


def test_simplex_coupling_reaches_the_projection():
    model = hybrid_model(PerformerModel, feature_coupling="simplex")
    directions = torch.nn.functional.normalize(model.encoder.layer[0].attention.projection[:HEAD_DIM].double(), dim=-1)
    cosines = directions @ directions.T  # one block: a regular simplex, pairwise cosine -1 / (d - 1)
    off_diagonal = cosines[~torch.eye(HEAD_DIM, dtype=torch.bool)]
    torch.testing.assert_close(off_diagonal, torch.full_like(off_diagonal, -1 / (HEAD_DIM - 1)))


# ---------------------------------------------------------------- the attention module against dense references


def _module_inputs(module, length=23, seed=0):
    """Hidden states (B, L, hidden), their q, k, v (B, H, L, d), and a right-padding mask (B, L), float64."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, length, HIDDEN, generator=g, dtype=torch.float64)
    q, k, v = (module._split_heads(layer(hidden)) for layer in (module.query, module.key, module.value))
    mask = torch.arange(length)[None, :] < torch.tensor([length, length - 8])[:, None]
    return hidden, q, k, v, mask


def _merge_heads(module, context):
    batch, _, length, _ = context.shape
    return module.output(context.transpose(1, 2).reshape(batch, length, HIDDEN))  # (B, L, hidden)


@pytest.mark.parametrize(
    "overrides",
    [
        HYBRID_BIDIRECTIONAL,
        {**HYBRID_BIDIRECTIONAL, "attention_kernel": "softmax", "nb_features": 24},
        {**HYBRID_BIDIRECTIONAL, "attention_kernel": "softmax_opt", "center_features": False},  # A from each sequence
        {**HYBRID_BIDIRECTIONAL, "attention_kernel": "softmax_opt", "far_field_parameter": PER_LAYER_A},
        {**HYBRID_BIDIRECTIONAL, "route_group_size": 2, "routed_blocks": 1},  # 6 key blocks in 3 groups of 2, 1 kept
        {**HYBRID_BIDIRECTIONAL, "far_field_gain": [[0.5] * HEADS, [0.2, 3.0] + [1.0] * (HEADS - 2)]},
    ],
    ids=[
        "poly2-centred",
        "softmax-centred",
        "softmax_opt-closed-form",
        "softmax_opt-per-layer-A",
        "routing-groups",
        "per-layer-gain",
    ],
)
@torch.no_grad()
def test_bidirectional_attention_module_equals_the_dense_reference(overrides):
    module = hybrid_model(PerformerModel, **overrides).double().encoder.layer[1].attention
    hidden, q, k, v, mask = _module_inputs(module)
    config = module_config = tiny_config(**overrides)
    parameter, gain = module_config.layer_far_field_parameter(1), module_config.layer_far_field_gain(1)
    expected = reference(
        q,
        k,
        v,
        module.projection,
        far_field=config.attention_kernel,
        mask=mask,
        local_window=config.local_window,
        num_global_tokens=config.num_global_tokens,
        routed_blocks=config.routed_blocks,
        route_block_size=config.route_block_size,
        route_group_size=config.route_group_size,
        query_block_size=config.query_block_size,
        center=config.center_features,
        far_field_parameter=None if parameter is None else torch.tensor(parameter),
        far_field_gain=gain,
    )
    got, _ = module(hidden, mask, causal=False)
    real = mask.bool()
    torch.testing.assert_close(got[real], _merge_heads(module, expected)[real], rtol=1e-9, atol=1e-9)


def _causal_poly2_reference(q, k, v, a, c, local_window, num_global_tokens, mask):
    """Causal hybrid attention with fixed centres a, c (H, d) and the poly2 far field, as one dense matrix."""
    L = q.shape[2]
    x, y = q * HEAD_DIM**-0.25, k * HEAD_DIM**-0.25
    a, c = a[None, :, None, :], c[None, :, None, :]  # (1, H, 1, d)
    t = (x - a) @ (y - c).transpose(-2, -1)  # (B, H, L, L)
    scale = x @ c.transpose(-2, -1) + (y @ a.transpose(-2, -1)).transpose(-2, -1) - (a * c).sum(-1, keepdim=True)
    kernel = (1 + t / 2) ** 2 * scale.exp()  # estimates exp(x . y)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    support = ((i - j >= 0) & (i - j < local_window)) | (j < num_global_tokens)
    weights = torch.where(support, (x @ y.transpose(-2, -1)).exp(), kernel) * ((j <= i) & mask[:, None, None, :])
    return (weights @ v) / weights.sum(-1, keepdim=True)


@torch.no_grad()
def test_causal_attention_module_with_fixed_centres_equals_the_dense_reference():
    module = hybrid_model(PerformerForCausalLM, **CAUSAL).double().performer.encoder.layer[0].attention
    hidden, q, k, v, mask = _module_inputs(module)
    expected = _causal_poly2_reference(q, k, v, module.query_center, module.key_center, 4, 1, mask)
    got, _ = module(hidden, mask, causal=True)
    real = mask.bool()
    torch.testing.assert_close(got[real], _merge_heads(module, expected)[real], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "model_class, overrides", [(PerformerModel, HYBRID_BIDIRECTIONAL), (PerformerForCausalLM, CAUSAL)]
)
@torch.no_grad()
def test_a_window_covering_the_sequence_is_exact_attention(model_class, overrides):
    length = 13
    model = hybrid_model(model_class, **{**overrides, "local_window": 2 * length + 1}, layer_norm_position="pre")
    exact = model_class(tiny_config(attention_kernel="exact", layer_norm_position="pre")).eval()
    exact.load_state_dict(model.state_dict(), strict=False)  # the exact model has no centres
    ids, mask = random_ids(2, length), torch.ones(2, length, dtype=torch.long)
    mask[1, 9:] = 0
    got, expected = (m(input_ids=ids, attention_mask=mask, use_cache=False)[0] for m in (model, exact))
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- padding and causality


@torch.no_grad()
def test_right_padding_does_not_change_the_real_tokens():
    model = hybrid_model(PerformerForMaskedLM, **HYBRID_BIDIRECTIONAL)
    ids = random_ids(2, 29, seed=3)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    batched = model(input_ids=ids, attention_mask=mask).logits
    alone = model(input_ids=ids[1:, :17]).logits
    torch.testing.assert_close(batched[1, :17], alone[0], rtol=1e-5, atol=1e-5)


ROUTED = {"routed_blocks": 3, "route_block_size": 4, "route_group_size": 2, "query_block_size": 4}


@pytest.mark.parametrize("pads", [8, 7])
@pytest.mark.parametrize("routing", [{}, ROUTED], ids=["window", "routed"])
@pytest.mark.parametrize("far_field", ["poly2", "softmax_opt"])
@torch.no_grad()
def test_a_left_padded_bidirectional_row_computes_what_it_does_alone(far_field, routing, pads):
    """An encoder's left-padded row (position ids given as the row's own) computes what it does alone, padded by a
    whole number of blocks or not: its global tokens, which attend to and are read by every token exactly, are its
    first real tokens, not the pads in the first positions (0.6 apart before), and its routed blocks and their groups
    hold the tokens they hold alone (0.154 apart on the converter's preset, 64 pads, when only the global tokens
    moved in front of the pads)."""
    settings = {"attention_kernel": far_field, "center_features": True, "local_window": 5, "num_global_tokens": 2}
    model = hybrid_model(PerformerModel, initializer_range=0.3, exact_max_length=0, **settings, **routing)
    ids = random_ids(2, 41, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :pads] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    padded = model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    alone = model(input_ids=ids[1:, pads:]).last_hidden_state
    torch.testing.assert_close(padded[1, pads:], alone[0], rtol=1e-5, atol=1e-5)


def _left_padded_attention(exact_max_length: int, pads: int):
    """Layer 0's attention of a tiny causal hybrid with 2 global tokens (random centres), inputs of 4x unit scale
    (2, 60, hidden) and their mask, row 1 left-padded by ``pads``."""
    config = tiny_config(**{**CAUSAL, "num_global_tokens": 2, "exact_max_length": exact_max_length})
    attention = random_centres(PerformerForCausalLM(config)).performer.encoder.layer[0].attention.eval()
    states = torch.randn(2, 60, HIDDEN, generator=torch.Generator().manual_seed(0)) * 4
    mask = torch.ones(2, 60, dtype=torch.bool)
    mask[1, :pads] = False
    return attention, states, mask


@torch.no_grad()
def test_a_left_padded_causal_row_reads_its_first_real_tokens_as_global_tokens():
    """Batched generate() pads on the left: the causal hybrid's global tokens went by position, so a padded row's
    were pads and its first real tokens joined the far field (here attention outputs 0.008 apart, 48x relative, where
    the row alone reads them exactly). They are its global tokens now: the row computes what it does alone,
    its implied attention weights too (output_attentions), and a converted GPT-2's batched generation equals each
    prompt's alone."""
    pads = 13
    attention, states, mask = _left_padded_attention(exact_max_length=0, pads=pads)
    padded, padded_weights = attention(states, mask, causal=True, output_attentions=True)
    alone, alone_weights = attention(states[1:, pads:], None, causal=True, output_attentions=True)
    torch.testing.assert_close(padded[1, pads:], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded_weights[1, :, pads:, pads:], alone_weights[0], rtol=1e-5, atol=1e-5)
    assert not padded_weights[1, :, pads:, :pads].any()  # no weight on the pads
    model = hybrid_model(PerformerForCausalLM, **{**CAUSAL, "num_global_tokens": 2, "exact_max_length": 0})
    ids = random_ids(2, 40, seed=4)
    ids[1, :pads] = 0
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    batch = model.generate(ids, attention_mask=(ids != 0).long(), **options)
    single = model.generate(ids[1:, pads:], **options)
    assert torch.equal(batch.sequences[1, pads:], single.sequences[0])
    for ours, theirs in zip(batch.logits, single.logits, strict=True):
        torch.testing.assert_close(ours[1], theirs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pads", [5, 19, 25, 40], ids=["prefix holds its globals", "one", "none", "row short"])
@torch.no_grad()
def test_a_left_padded_row_after_an_exact_prefix_reads_its_first_real_tokens_as_global_tokens(pads):
    """With an exact prefix (``exact_max_length=20``: the first 20 positions attend exactly), the hybrid after it
    starts from the prefix's state, whose global tokens went by position: a row padded by 5 read pads (outputs
    0.001-0.003 from the row alone at every later position). A row padded past the prefix (its 2 global tokens not
    in it, or one) read pads even after the prefix's keys were ordered (outputs 0.001 and 0.005 apart, 1% and 4% of
    their scale). They are its first real tokens now: the row's outputs equal its outputs alone wherever both take
    the same rule (the prefix goes by position: alone, a row's first 20 tokens attend exactly), and at its global
    tokens, which attend exactly either way."""
    attention, states, mask = _left_padded_attention(exact_max_length=20, pads=pads)
    padded = attention(states, mask, causal=True)[0][1, pads:]
    alone = attention(states[1:, pads:], None, causal=True)[0][0]
    same = [i for i in range(60 - pads) if i < 2 or (i < 20) == (pads + i < 20)]
    torch.testing.assert_close(padded[same], alone[same], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_row_padded_past_the_exact_prefix_decodes_as_its_whole_sequence_reads():
    """generate() of a left-padded batch whose short row is padded past the exact prefix: the prefill moves that row's
    global tokens into the prefix, and the cache built after it decodes what a full forward of the generated
    sequences reads (each step's logits), so the order stays the call's own."""
    model = hybrid_model(PerformerForCausalLM, **{**CAUSAL, "num_global_tokens": 2, "exact_max_length": 20})
    ids = random_ids(2, 40, seed=4)
    ids[1, :25] = 0
    out = model.generate(
        ids,
        attention_mask=(ids != 0).long(),
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    sequences = out.sequences
    mask = (sequences != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers a left-padded row's tokens
    full = model(sequences, attention_mask=mask, position_ids=positions, use_cache=False).logits  # (2, 45, vocab)
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, 39 + step], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_chunked_prefill_past_the_exact_prefix_is_refused_where_a_row_lost_its_global_tokens(compiled):
    """A prefill in chunks whose first chunk, the exact prefix, holds none of a padded row's global tokens cannot give
    them back to its state: refused, naming the fix (compiled too: before, the traced check was skipped and the row
    went on with pads as its global tokens); with the row's tokens in the prefix it runs."""
    model = hybrid_model(PerformerForCausalLM, **{**CAUSAL, "num_global_tokens": 2, "exact_max_length": 20})
    if compiled:
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="aot_eager")
    ids = random_ids(2, 40, seed=4)
    options = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, prefill_chunk_size=20)
    ids[1, :25] = 0
    # (traced, the graph's assertion raises a RuntimeError and names no row)
    error, refusal = (RuntimeError, "A row .*") if compiled else (ValueError, "Row 1 .* 25 ")
    with pytest.raises(error, match=rf"{refusal}padding tokens.*exact prefix.*prefill_chunk_size=None"):
        model.generate(ids, attention_mask=(ids != 0).long(), **options)
    ids[1, :10] = 0
    ids[1, 10:25] = random_ids(1, 15, seed=5)
    model.generate(ids, attention_mask=(ids != 0).long(), **options)


@pytest.mark.parametrize(
    "overrides",
    [CAUSAL, {**CAUSAL, "attention_kernel": "softmax_opt", "far_field_parameter": PER_LAYER_A, "nb_features": 24}],
    ids=["poly2-fixed-centres", "softmax_opt-fixed-A"],
)
@torch.no_grad()
def test_causal_outputs_do_not_depend_on_later_tokens(overrides):
    model = hybrid_model(PerformerForCausalLM, **overrides)
    ids = random_ids(2, 21)
    changed = ids.clone()
    changed[:, 12:] = random_ids(2, 9, seed=7)
    before, after = (model(input_ids=t, use_cache=False).logits for t in (ids, changed))
    torch.testing.assert_close(before[:, :12], after[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 12:], after[:, 12:])


@pytest.mark.parametrize(
    "model_class, overrides", [(PerformerForMaskedLM, HYBRID_BIDIRECTIONAL), (PerformerForCausalLM, CAUSAL)]
)
def test_hybrid_models_train(model_class, overrides):
    model = hybrid_model(model_class, **overrides).train()
    model.activation_checkpointing_enable()
    ids = random_ids(2, 21)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.performer.encoder.layer[0].attention.query.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- generation with the constant-size cache


def _greedy(model, ids, use_cache, **kwargs):
    return model.generate(
        ids,
        max_new_tokens=8,
        do_sample=False,
        use_cache=use_cache,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )


@pytest.mark.parametrize(
    "overrides",
    [
        CAUSAL,
        {**CAUSAL, "attention_kernel": "softmax_opt", "far_field_parameter": -0.1},
        {"attention_kernel": "softmax", "local_window": 3, "num_global_tokens": 2},
    ],
    ids=["poly2-fixed-centres", "softmax_opt-fixed-A", "softmax-window"],
)
@torch.no_grad()
def test_cached_greedy_generation_equals_recomputation(overrides):
    model = hybrid_model(PerformerForCausalLM, layer_norm_position="pre", **overrides)
    ids = random_ids(2, 9)  # longer than the window: the cache must carry the window's keys
    cached, recomputed = _greedy(model, ids, use_cache=True), _greedy(model, ids, use_cache=False)
    assert torch.equal(cached.sequences, recomputed.sequences)
    for a, b in zip(cached.scores, recomputed.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    cache = getattr(cached, CACHE_FIELD)
    assert all(isinstance(layer, HybridCacheLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 9 + 8 - 1
    state = cache.layers[0].get_state()
    window = model.config.local_window
    assert state.keys.shape == (2, HEADS, window - 1, HEAD_DIM)  # constant size: the window, not the context
    assert state.global_keys.shape == (2, HEADS, model.config.num_global_tokens, HEAD_DIM)


@torch.no_grad()
def test_beam_search_reorders_the_hybrid_cache():
    model = hybrid_model(PerformerForCausalLM, layer_norm_position="pre", **CAUSAL)
    ids = random_ids(2, 9)
    kwargs = {"max_new_tokens": 6, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


# ---------------------------------------------------------------- save / load and remote code


def _save_hybrid_pair(tmp_path):
    causal = hybrid_model(PerformerForCausalLM, layer_norm_position="pre", type_vocab_size=0, **CAUSAL)
    mlm = hybrid_model(PerformerForMaskedLM, **{**HYBRID_BIDIRECTIONAL, "attention_kernel": "softmax_opt"})
    causal.save_pretrained(tmp_path / "causal")
    mlm.save_pretrained(tmp_path / "mlm")
    return causal, mlm


@torch.no_grad()
def test_save_and_load_reproduce_the_outputs_bit_for_bit(tmp_path):
    causal, mlm = _save_hybrid_pair(tmp_path)
    weights = load_file(tmp_path / "causal" / "model.safetensors")
    torch.testing.assert_close(
        weights["performer.encoder.layer.1.attention.key_center"],
        causal.performer.encoder.layer[1].attention.key_center,
    )
    ids = random_ids(2, 19)
    for model, folder, auto in ((causal, "causal", AutoModelForCausalLM), (mlm, "mlm", AutoModelForMaskedLM)):
        reloaded = auto.from_pretrained(tmp_path / folder).eval()
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits), folder


def test_trust_remote_code_loads_hybrid_checkpoints_without_performer_hf(tmp_path):
    causal, mlm = _save_hybrid_pair(tmp_path)
    copied = {p.name for p in (tmp_path / "causal").glob("*.py")}
    assert {"modeling_performer.py", "favor_hybrid.py", "favor_optimal.py", "cache_performer.py"} <= copied
    ids = random_ids(2, 9)
    report = load_without_performer_hf(tmp_path, ids)
    assert report["leaked"] == []
    with torch.no_grad():
        assert torch.equal(torch.tensor(report["causal_logits"]), causal(input_ids=ids).logits)
        assert torch.equal(torch.tensor(report["mlm_logits"]), mlm(input_ids=ids).logits)
    assert report["generated"] == causal.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()


# ---------------------------------------------------------------- conversion


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-sources")
    cases = {case.name: case for case in CASES}
    for name in ("bert-mlm", "gpt2-lm"):
        save_source(cases[name], root / name)
    return root


def test_default_conversion_is_the_hybrid_and_calibrates_causal_centres(tiny_sources, tmp_path):
    bert = convert(tiny_sources / "bert-mlm", tmp_path / "bert", fidelity=False)
    config = json.loads((bert / "config.json").read_text())
    preset = METHODS["hybrid"]["bidirectional"]
    assert preset["attention_kernel"] == "poly2" and preset["routed_blocks"] > 0
    assert {name: config[name] for name in preset} == preset
    card = (bert / "README.md").read_text()
    assert f"routed exact key blocks: {preset['routed_blocks']} blocks of {preset['route_block_size']} keys" in card

    gpt2 = convert(tiny_sources / "gpt2-lm", tmp_path / "gpt2", fidelity=False)
    config = PerformerConfig.from_pretrained(gpt2)
    assert config.routed_blocks == 0 and config.center_features and config.local_window > 0
    report = json.loads((gpt2 / "conversion_report.json").read_text())
    assert report["calibration"]["centres"] and report["attention"]["attention_kernel"] == config.attention_kernel

    # the centres are the means of the source's own scaled queries / keys on the sample text
    source = GPT2LMHeadModel.from_pretrained(tiny_sources / "gpt2-lm").eval()
    batch = sample_batch(config)
    captured = []
    source.transformer.h[1].attn.c_attn.register_forward_hook(lambda _m, _a, out: captured.append(out))
    with torch.no_grad():
        source(**batch)
    q, k, _ = captured[0].split(HIDDEN, dim=-1)  # (B, L, hidden) each
    real = batch["attention_mask"].bool()
    weights = load_file(gpt2 / "model.safetensors")
    for name, t in (("query_center", q), ("key_center", k)):
        expected = (t[real] * HEAD_DIM**-0.25).view(-1, HEADS, HEAD_DIM).mean(0)  # (H, d)
        stored = weights[f"performer.encoder.layer.1.attention.{name}"]
        torch.testing.assert_close(stored, expected, rtol=1e-4, atol=1e-5)

    if config.attention_kernel == "softmax_opt":  # A calibrated per layer and head
        assert torch.tensor(config.far_field_parameter).shape == (LAYERS, HEADS)
        fixed = convert(tiny_sources / "gpt2-lm", tmp_path / "fixed", fidelity=False, far_field_parameter=-0.3)
        assert PerformerConfig.from_pretrained(fixed).far_field_parameter == -0.3  # the user's A is kept

    model = AutoModelForCausalLM.from_pretrained(gpt2).eval()
    ids = random_ids(1, 7)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=False))


def test_convert_command_with_hybrid_flags(tiny_sources, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "convert",
            str(tiny_sources / "bert-mlm"),
            str(out),
            "--local-window",
            "5",
            "--num-global-tokens",
            "2",
            "--routed-blocks",
            "3",
            "--route-block-size",
            "4",
            "--query-block-size",
            "4",
            "--far-field",
            "softmax_opt",
            "--feature-coupling",
            "simplex",
            "--no-center-features",
            "--calibrate",
            "-q",
        ]
    )
    assert code == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert (config["local_window"], config["num_global_tokens"], config["routed_blocks"]) == (5, 2, 3)
    assert (config["attention_kernel"], config["feature_coupling"], config["center_features"]) == (
        "softmax_opt",
        "simplex",
        False,
    )
    parameter = torch.tensor(config["far_field_parameter"])  # calibrated: one A per layer and head
    assert parameter.shape == (LAYERS, HEADS) and (parameter <= 0).all()
    errors = torch.tensor(json.loads((out / "conversion_report.json").read_text())["calibration"]["far_field_error"])
    assert errors.shape == (LAYERS, HEADS) and (errors > 0).all()
    model = AutoModelForMaskedLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=random_ids(2, 40)).logits).all()
    card = (out / "README.md").read_text()
    assert "FAVOR++ parameter A: per layer and head, calibrated or learned at conversion" in card
    assert "exact local window: 5 tokens" in card


def test_method_favor_converts_to_plain_favor_and_hybrid_rejects_favor_only_kernels(tiny_sources, tmp_path, capsys):
    out = tmp_path / "favor"
    assert main(["convert", str(tiny_sources / "bert-mlm"), str(out), "--method", "favor", "--no-fidelity", "-q"]) == 0
    config = PerformerConfig.from_pretrained(out)
    assert config.attention_kernel == "softmax" and not config.uses_hybrid_attention
    relu = tmp_path / "relu"  # a FAVOR+-only kernel picks plain FAVOR+ by itself
    assert (
        main(["convert", str(tiny_sources / "bert-mlm"), str(relu), "--attention-kernel", "relu", "--no-fidelity"]) == 0
    )
    assert not PerformerConfig.from_pretrained(relu).uses_hybrid_attention
    capsys.readouterr()
    code = main(
        [
            "convert",
            str(tiny_sources / "bert-mlm"),
            str(tmp_path / "bad"),
            "--method",
            "hybrid",
            "--attention-kernel",
            "relu",
            "--no-fidelity",
        ]
    )
    assert code == 1 and "convert with --method favor" in capsys.readouterr().err
    code = main(
        ["convert", str(tiny_sources / "gpt2-lm"), str(tmp_path / "bad"), "--routed-blocks", "2", "--no-fidelity"]
    )
    assert code == 1 and "Set routed_blocks=0 for causal models" in capsys.readouterr().err


def test_a_field_set_after_the_config_was_built_fails_when_the_model_is_built():
    config = tiny_config()  # FAVOR+
    config.local_window = 5  # would be ignored by FAVOR+: refused with the fix instead
    with pytest.raises(ValueError, match="set attention_method='hybrid'"):
        PerformerModel(config)
    config.attention_method = "hybrid"
    assert PerformerModel(config).encoder.layer[0].attention.hybrid_spec.local_window == 5


@torch.no_grad()
def test_a_mask_buffer_refilled_between_calls_is_read_anew():
    """A batch buffer reused for every batch (``torch.from_numpy`` over one array: numpy writes are no tensor
    version): what the layers read from the mask once per forward (the rows' sink order) was kept for the next call,
    which computed the first mask's answer (4.0e-3 from the new mask's)."""
    numpy = pytest.importorskip("numpy")
    model = random_centres(tiny_model(**{**CAUSAL, "num_global_tokens": 2}, exact_max_length=0))
    ids = random_ids(2, 40, seed=1)
    buffer = numpy.ones((2, 40), dtype=bool)
    buffer[1, :6] = False
    mask = torch.from_numpy(buffer)
    model(ids, attention_mask=mask)
    buffer[0, :9] = False  # the next batch, written into the same buffer
    expected = model(ids, attention_mask=torch.from_numpy(buffer.copy())).logits
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, rtol=0, atol=0)
