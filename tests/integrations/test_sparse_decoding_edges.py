"""The sparse method's decoding at its edges, on transformers' own model classes and the Performer family: a
sequence whose first call holds one token, left padding with the "window" ranking, a chunked prefill with the
"latest" ranking, a state continued in another dtype, and the caches' crop and construction."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import performer_hf
from performer_hf import PerformerCache
from performer_hf.integrations import CACHE_KEYWORD

from .test_attention_interface import DECODERS, SPARSE, VOCAB, _ids, _load, _source

pytestmark = pytest.mark.usefixtures("single_thread")

# the sparse preset's ranking and a budget that nothing below exceeds: cached decoding computes what a full forward
# (every block kept) does
LATEST = {**SPARSE, "select_budget": 16, "select_ranking": "latest"}
# a GPT-2 that converts to the Performer family
GPT2 = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
def test_generate_from_a_one_token_prompt_with_the_methods_cache_equals_a_full_forward(arch, tmp_path):
    """A one-token prompt (a BOS alone) with PerformerCache: the first call's key, a transposed view of the
    projection, stopped the compiled decoding step ("takes keys and values with contiguous rows"). The first logits
    are the source model's (softmax over one key is exact), the later ones a full forward's; and Gemma3's forward
    of one token without a cache (its layers keep a state all the same) stopped the same way."""
    source, folder = _source(DECODERS[arch], tmp_path)
    model = _load(folder, "performer_sparse", **LATEST)
    prompt = _ids(2, 1)
    options = dict(max_new_tokens=30, do_sample=False, output_logits=True, return_dict_in_generate=True)
    generated = model.generate(prompt, **options, **{CACHE_KEYWORD: PerformerCache(model.config)})
    with torch.no_grad():
        full = model(generated.sequences, use_cache=False).logits  # (2, 31, V)
        torch.testing.assert_close(model(prompt, use_cache=False).logits, source(prompt).logits, rtol=1e-5, atol=1e-5)
    for step, logits in enumerate(generated.logits):
        torch.testing.assert_close(logits, full[:, step], rtol=1e-5, atol=1e-5)


def test_a_performer_model_with_a_budget_generates_from_one_token(tmp_path):
    """The Performer family converted from GPT-2 (a fused projection) with a bounded sparse method (budget 2,
    selection among the blocks before the window from position 16 on), from a one-token prompt: plain generate()
    (its own cache) computes what a full forward does while the pool holds every block that left the window."""
    _, folder = _source(GPT2, tmp_path)
    settings = dict(local_window=8, select_block_size=4, select_blocks=1, select_budget=2, num_global_tokens=2)
    out = performer_hf.convert(folder, tmp_path / "sparse", fidelity=False, method="sparse", **settings)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = _ids(2, 1)
    options = dict(max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    generated = model.generate(prompt, **options, pad_token_id=0)
    with torch.no_grad():
        full = model(generated.sequences, use_cache=False).logits
    for step, logits in enumerate(generated.logits):
        torch.testing.assert_close(logits, full[:, step], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["performer", "performer_hybrid", "performer_sparse"])
def test_crop_of_no_token_is_a_no_op_and_assisted_decoding_accepting_every_draft_runs(implementation, tmp_path):
    """transformers' Cache.crop(-n) removes n tokens and crop(0) none (DynamicCache's is a no-op); assisted
    decoding calls crop(-0) when every draft token is accepted. The methods' layers read 0 as "keep 0 tokens" and
    refused ("cannot be cropped from 22 back to 0 tokens"). An identical assistant, whose drafts are all accepted,
    now generates what plain generate() does; a real rollback stays refused."""
    _, folder = _source(DECODERS["llama"], tmp_path)
    model = _load(folder, implementation)
    prompt = _ids(1, 20)
    generated = model.generate(prompt, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = generated[CACHE_KEYWORD]
    for tokens in (0, -0, 22):
        cache.crop(tokens)
        assert cache.get_seq_length() == 22
    with pytest.raises(ValueError, match="cannot be cropped from 22 back to 21 tokens"):
        cache.crop(-1)
    assistant = _load(folder, implementation)
    assisted = model.generate(prompt, max_new_tokens=6, do_sample=False, assistant_model=assistant)
    assert torch.equal(assisted, model.generate(prompt, max_new_tokens=6, do_sample=False))


def test_performer_cache_tells_a_performer_model_to_build_its_own(tmp_path):
    """PerformerCache(model.config) of a Performer-family model told to load it with
    attn_implementation='performer_hybrid', which the family then refuses. It now says the model builds its cache
    itself, and the cache it names decodes as plain generate() does."""
    _, folder = _source(GPT2, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(performer_hf.convert(folder, tmp_path / "hybrid", fidelity=False))
    with pytest.raises(ValueError, match=r"Performer-family model .* DynamicCache\(config=model.config\)"):
        PerformerCache(model.config)
    prompt = _ids(1, 12)
    plain = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    given = {CACHE_KEYWORD: DynamicCache(config=model.config)}
    assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0, **given), plain)


@pytest.mark.parametrize("implementation", ["performer_sparse", "performer_hybrid", "performer"])
def test_forwards_whose_outputs_are_dropped_keep_no_decoding_state(implementation, tmp_path):
    """Each forward without gradients keeps its method's state for the caller's cache, until the keys it returned
    are dropped. The sparse state kept those keys alive (a view's base), so every scoring call kept its state for
    good: 2 states per 2-layer model and forward, 20 MiB after 40 forwards of 512 tokens."""
    import gc

    from performer_hf.modeling.interface_cache import _PENDING_LAYERS

    _, folder = _source(DECODERS["llama"], tmp_path)
    model = _load(folder, implementation)
    with torch.no_grad():
        for seed in range(3):
            model(_ids(1, 40, seed=seed))  # a scoring request: its output and cache dropped
    gc.collect()
    assert [len(layer.self_attn.__dict__.get(_PENDING_LAYERS, {})) for layer in model.model.layers] == [0, 0]


@pytest.mark.parametrize("implementation", ["performer_sparse", "performer_hybrid", "performer"])
def test_a_model_switched_to_sdpa_continues_its_cache_as_sdpa_does(implementation, tmp_path):
    """A prompt prefilled under a Performer method keeps the method's state for its cache; switched to SDPA, the
    model's next call used to put that state in the cache's place, and SDPA attended over it: logits 0.56 from the
    source's (scale 0.55), the new token not even cached. Switched, the states are dropped and SDPA reads the keys."""
    source, folder = _source(DECODERS["llama"], tmp_path)
    model = _load(folder, implementation)
    prompt, token = _ids(1, 30), _ids(1, 1, seed=2)
    with torch.no_grad():
        cache = model(prompt, use_cache=True)[CACHE_KEYWORD]
        keys = DynamicCache()  # the same keys and values, for the source
        for index, layer in enumerate(cache.layers):
            keys.update(layer.keys.clone(), layer.values.clone(), index)
        model.set_attn_implementation("sdpa")
        continued = model(token, **{CACHE_KEYWORD: cache}).logits[:, -1]
        expected = source(token, **{CACHE_KEYWORD: keys}).logits[:, -1]
    torch.testing.assert_close(continued, expected, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 31
