"""Exact dispatch: short bidirectional inputs (``exact_max_length``) and inputs the hybrid's exact support covers
entirely get exact softmax attention, equal to the exact-attention twin of the same weights."""

import types

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import DynamicCache

from performer_hf import PerformerConfig, PerformerForMaskedLM, PerformerModel
from performer_hf.attention_card import method_description
from performer_hf.conversion.fidelity import approximation_only
from performer_hf.favor import HybridSpec, exact_attention, hybrid_attention
from performer_hf.modeling.attention_methods import ATTENTION_METHODS, preset_under
from performer_hf.modeling.attention_settings import resolved_settings
from performer_hf.modeling.method_exact import exact_is_enough, exact_max_length
from performer_hf.modeling.modeling_performer import CACHE_FIELD
from tests.tiny_models import METHODS, random_centres, random_ids, tiny_config, tiny_model

BIDIRECTIONAL_HYBRID = {**METHODS["hybrid"], "routed_blocks": 2, "route_block_size": 4, "query_block_size": 4}
APPROXIMATIONS = {"favor": METHODS["favor"], "hybrid": BIDIRECTIONAL_HYBRID}


def _exact_twin(model, model_class):
    """The same weights with attention_kernel="exact" (the projection and centres are unused there)."""
    fields = {
        **model.config.to_dict(),
        "attention_kernel": "exact",
        "center_features": False,
        "local_window": 0,
        "num_global_tokens": 0,
        "routed_blocks": 0,
        "exact_max_length": 0,
    }
    twin = model_class(PerformerConfig(**fields)).eval()
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all("center" in name for name in unexpected), (missing, unexpected)
    return twin


def _padded_batch(length):
    ids = random_ids(batch=2, length=length)
    mask = torch.ones_like(ids)
    mask[1, length - 5 :] = 0  # right padding
    return ids, mask


@pytest.mark.parametrize("method", sorted(APPROXIMATIONS))
def test_inputs_up_to_exact_max_length_get_exact_attention_with_its_gradients(method):
    model = random_centres(tiny_model(PerformerForMaskedLM, exact_max_length=24, **APPROXIMATIONS[method]))
    twin = _exact_twin(model, PerformerForMaskedLM)
    ids, mask = _padded_batch(24)
    labels = torch.where(mask.bool(), ids, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    ref = twin(ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], ref.logits[real], rtol=1e-5, atol=1e-5)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("method", sorted(APPROXIMATIONS))
def test_longer_inputs_run_the_method_itself(method):
    # the padded row's real tokens one over the threshold: bit-identical to the same model without exact dispatch
    model = random_centres(tiny_model(PerformerModel, exact_max_length=23, **APPROXIMATIONS[method]))
    plain = random_centres(tiny_model(PerformerModel, **APPROXIMATIONS[method]))
    plain.load_state_dict(model.state_dict())
    ids, mask = _padded_batch(29)
    dispatched = model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(dispatched, plain(ids, attention_mask=mask).last_hidden_state, rtol=0, atol=0)
    twin = _exact_twin(model, PerformerModel)
    exact = twin(ids, attention_mask=mask).last_hidden_state
    # either side of the threshold agrees within the approximation's error
    real = mask.bool()
    error = (dispatched - exact)[real].norm() / exact[real].norm()
    assert error < 0.05, f"{method}: relative error {error:.3f} to exact attention just above exact_max_length"


def test_causal_hybrid_within_its_window_is_exact_attention_and_needs_no_threshold():
    model = random_centres(
        tiny_model(local_window=8, **{k: v for k, v in METHODS["hybrid"].items() if k != "local_window"})
    )
    twin = _exact_twin(model, type(model))
    ids = random_ids(length=8)
    torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_causal_favor_model_refuses_exact_max_length():
    invalid = (ValueError, StrictDataclassClassValidationError)
    with pytest.raises(invalid, match="exact_max_length=512 with is_decoder=True needs the hybrid method"):
        tiny_config(is_decoder=True, exact_max_length=512, **METHODS["favor"])
    with pytest.raises(invalid, match="exact_max_length must be >= 0"):
        tiny_config(exact_max_length=-1)


@pytest.mark.parametrize("method", sorted(APPROXIMATIONS))
def test_accelerators_keep_exact_attention_to_their_own_crossover(method):
    """``accelerator_exact_max_length`` sets the crossover on every device but the CPU (None: exact_max_length);
    the fidelity report's approximation_only turns both off."""
    model = tiny_model(PerformerModel, exact_max_length=8, accelerator_exact_max_length=32, **APPROXIMATIONS[method])
    attention = model.encoder.layer[0].attention
    on = {device: torch.empty(1, 4, 24, 8, device=device) for device in ("cpu", "meta")}  # meta: as an accelerator
    assert exact_max_length(attention, torch.device("cpu")) == 8
    assert exact_max_length(attention, torch.device("cuda")) == 32
    assert not exact_is_enough(attention, on["cpu"], False, None)
    assert exact_is_enough(attention, on["meta"], False, None)
    assert not exact_is_enough(attention, on["meta"], True, None)  # bidirectional only
    with approximation_only(model):
        assert not exact_is_enough(attention, on["meta"], False, None)
    assert exact_is_enough(attention, on["meta"], False, None)
    attention.accelerator_exact_max_length = None
    assert exact_max_length(attention, torch.device("cuda")) == 8


def test_the_accelerator_crossover_is_bidirectional_and_not_negative():
    invalid = (ValueError, StrictDataclassClassValidationError)
    with pytest.raises(invalid, match="accelerator_exact_max_length must be >= 0"):
        tiny_config(is_decoder=False, accelerator_exact_max_length=-1, **BIDIRECTIONAL_HYBRID)
    with pytest.raises(invalid, match="accelerator_exact_max_length=4096 with is_decoder=True"):
        tiny_config(is_decoder=True, accelerator_exact_max_length=4096, **METHODS["hybrid"])


def test_a_given_exact_max_length_holds_on_accelerators_too():
    """A conversion's or a model's own ``exact_max_length`` without an accelerator crossover holds on accelerators
    too (``0``: never exact, anywhere; settings saved before the field keep their behaviour); the preset's applies
    otherwise. The card says what accelerators get."""
    preset = ATTENTION_METHODS["hybrid"].presets["bidirectional"]
    assert preset["accelerator_exact_max_length"] == 8192
    assert "accelerator_exact_max_length" not in preset_under(preset, {"exact_max_length": 0})
    assert preset_under(preset, {"local_window": 9}) == preset
    kept = {"exact_max_length": 0, "accelerator_exact_max_length": 4096}
    assert preset_under(preset, kept) == preset
    saved = types.SimpleNamespace(performer_attention={"exact_max_length": 512})
    assert resolved_settings(saved, "performer_hybrid", causal=False)["accelerator_exact_max_length"] is None
    fresh = types.SimpleNamespace(performer_attention=None)
    assert resolved_settings(fresh, "performer_hybrid", causal=False)["accelerator_exact_max_length"] == 8192
    config = tiny_config(exact_max_length=8, accelerator_exact_max_length=0, **BIDIRECTIONAL_HYBRID)
    assert "on GPUs and other accelerators, no input keeps exact attention" in method_description(config)
    config.accelerator_exact_max_length = 64
    assert "on GPUs and other accelerators, inputs of at most 64 tokens keep exact attention" in method_description(
        config
    )


def test_a_causal_hybrid_attends_exactly_at_its_first_exact_max_length_positions():
    # one layer, so that the attention's inputs are the same embeddings in every model: positions below T equal
    # the exact twin, later positions (and their gradients, which reach the earlier keys through the state the
    # hybrid continues from) the hybrid without an exact prefix, and short inputs train exactly
    hybrid = {k: v for k, v in METHODS["hybrid"].items() if k != "local_window"}
    config = dict(num_hidden_layers=1, local_window=3, **hybrid)
    model = random_centres(tiny_model(exact_max_length=9, **config))
    with torch.no_grad():  # larger logits: the hybrid's approximation error shows
        for name, parameter in model.named_parameters():
            if ".query." in name or ".key." in name:
                parameter.mul_(4)
    plain = tiny_model(**config)
    plain.load_state_dict(model.state_dict())
    twin = _exact_twin(model, type(model))
    ids = random_ids(length=20)
    logits, exact, approximate = model(ids).logits, twin(ids).logits, plain(ids).logits
    torch.testing.assert_close(logits[:, 9:], approximate[:, 9:], rtol=1e-5, atol=1e-6)
    weights = torch.randn(approximate[:, 9:].shape, generator=torch.Generator().manual_seed(0))
    (logits[:, 9:] * weights).sum().backward()
    (approximate[:, 9:] * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    model.zero_grad()
    error = (logits[:, :9] - exact[:, :9]).abs().max()
    approximation_error = (approximate[:, :9] - exact[:, :9]).abs().max()
    assert error < 1e-6 and approximation_error > 30 * error, (error, approximation_error)
    short = random_ids(length=9)
    out, ref = model(short, labels=short), twin(short, labels=short)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_exact_prefix_cache_holds_keys_until_the_sequence_passes_it():
    model = random_centres(tiny_model(exact_max_length=6, **METHODS["hybrid"]))
    ids = random_ids(length=12)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :6], **{CACHE_FIELD: cache}, use_cache=True)
        layer = cache.layers[0]
        assert layer.get_exact_prefix()[0].shape[2] == 6 and layer.get_seq_length() == 6
        model(ids[:, 6:7], **{CACHE_FIELD: cache}, use_cache=True)
    assert layer.get_exact_prefix() is None and layer.get_seq_length() == 7 and layer.get_state().length == 7
    assert layer.get_state().keys.shape[2] == METHODS["hybrid"]["local_window"] - 1  # the window buffer only


@pytest.mark.parametrize("causal", [False, True])
def test_covers_is_true_only_where_the_hybrid_is_exact_attention(causal):
    # HybridSpec.covers decides the dispatch: wherever it says so, the hybrid itself must equal exact attention
    # (to float64 rounding), and one token longer it must not (covers is as wide as it can be)
    g = torch.Generator().manual_seed(0)
    for local_window, num_global_tokens in ((1, 0), (5, 0), (6, 2), (9, 1), (0, 3), (17, 1)):
        spec = HybridSpec(far_field="poly2", local_window=local_window, num_global_tokens=num_global_tokens)
        longest = max(length for length in range(1, 40) if spec.covers(length, causal))
        for length in (1, longest, longest + 1):
            q, k, v = (torch.randn(1, 2, length, 8, generator=g, dtype=torch.float64) for _ in range(3))
            error = hybrid_attention(q, k, v, None, spec, causal=causal) - exact_attention(q, k, v, causal=causal)
            if length <= longest:
                assert error.abs().max() < 1e-12, (spec, length)
            else:
                assert error.abs().max() > 1e-8, f"{spec}: {length} tokens are exact too, covers() is too narrow"


@pytest.mark.parametrize("method", sorted(APPROXIMATIONS))
@pytest.mark.parametrize("padding", ["right", "left"])
def test_a_padded_row_gets_the_attention_it_gets_alone_whatever_it_is_batched_with(method, padding):
    """The crossover counts a row's real tokens, not the batch's padded length: a short row batched with a long one
    (as pipelines and sentence encoders batch) took the approximation, and differed from itself alone."""
    settings = {**APPROXIMATIONS[method], "routed_blocks": 1} if method == "hybrid" else APPROXIMATIONS[method]
    model = random_centres(tiny_model(PerformerModel, exact_max_length=16, **settings))  # (a support < 16 keys)
    with torch.no_grad():  # larger logits: the approximation's error shows
        for name, parameter in model.named_parameters():
            if ".query." in name or ".key." in name:
                parameter.mul_(8)
    short, long = random_ids(batch=1, length=16, seed=1), random_ids(batch=1, length=40, seed=2)
    ids = torch.zeros(3, 40, dtype=torch.long)
    mask = torch.zeros(3, 40, dtype=torch.long)
    pad = 24 if padding == "left" else 0
    ids[0, pad : pad + 16], mask[0, pad : pad + 16] = short[0], 1
    ids[1], mask[1] = long[0], 1
    ids[2, pad : pad + 16], mask[2, pad : pad + 16] = short[0], 1  # two short rows
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
        alone = {name: model(row).last_hidden_state[0] for name, row in (("short", short), ("long", long))}
    for row in (0, 2):
        torch.testing.assert_close(batched[row][mask[row].bool()], alone["short"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched[1], alone["long"], rtol=1e-5, atol=1e-5)
    every_row_short = model(ids[[0, 2]], attention_mask=mask[[0, 2]], position_ids=position_ids[[0, 2]])
    torch.testing.assert_close(every_row_short.last_hidden_state[0][mask[0].bool()], alone["short"])


def test_a_mask_edited_in_place_is_read_again():
    """The rows' real lengths are read once per mask: a bool mask edited in place between calls (a reused buffer)
    kept the first call's decision."""
    model = random_centres(tiny_model(PerformerModel, exact_max_length=16, **APPROXIMATIONS["favor"]))
    ids = random_ids(batch=2, length=40)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, 30:] = False
    with torch.no_grad():
        model(ids, attention_mask=mask)
        mask[1, 12:] = False  # row 1 now short: exact attention, as alone
        reused = model(ids, attention_mask=mask).last_hidden_state[1, :12]
        alone = model(ids[1:, :12]).last_hidden_state[0]
    torch.testing.assert_close(reused, alone, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # an inference tensor has no version counter (sentence-transformers encodes so)
        mask = mask.clone()
        mask[1, 12:] = True
        model(ids, attention_mask=mask)
        mask[1, 12:] = False
        torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state[1, :12], alone)
