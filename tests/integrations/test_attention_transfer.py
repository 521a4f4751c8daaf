"""Attention transfer on tiny random models: the method's learnable parts (projection, centres, FAVOR++'s A,
the far-field gain) move toward softmax attention, the model's own weights do not, and the result saves, reloads
and decodes exactly."""

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import performer_hf
from performer_hf import PerformerCache, PerformerForCausalLM
from performer_hf.integrations import CACHE_KEYWORD

from ..tiny_models import METHODS, Logits, tiny_model
from .test_attention_interface import DECODERS, SHORT_WINDOW, _bert_config, _ids, _load, _source

pytestmark = pytest.mark.usefixtures("single_thread")


def _batches(count=3, length=48):
    return [{"input_ids": _ids(2, length, seed=10 + i)} for i in range(count)]


@pytest.mark.parametrize("implementation", ["performer", "performer_hybrid"])
def test_transfer_lowers_the_error_and_touches_only_the_attention_parameters(implementation, tmp_path):
    source, folder = _source(DECODERS["llama"], tmp_path)
    model = _load(folder, implementation, **SHORT_WINDOW[implementation])
    weights = {name: p.clone() for name, p in model.named_parameters()}
    ids = _ids(1, 48, seed=3)
    with torch.no_grad():
        reference = source(ids).logits
        before = (model(ids).logits - reference).abs().mean()
    report = performer_hf.transfer_attention(model, _batches(), steps=30, learning_rate=1e-2, progress=False)
    assert report.steps == 30 and report.tokens == 30 * 2 * 48
    assert sum(report.error_last.values()) < 0.5 * sum(report.error_first.values())
    with torch.no_grad():
        after = (model(ids).logits - reference).abs().mean()
    assert after < before
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters() if name in weights)
    assert all(p.requires_grad for name, p in model.named_parameters() if name in weights)
    learned = dict(model.model.layers[0].self_attn.performer_attention.named_buffers())
    expected = {"projection", "query_center", "key_center"} if implementation == "performer_hybrid" else {"projection"}
    assert set(learned) == expected
    if implementation == "performer_hybrid":  # FAVOR++'s A and the far-field gain per layer and head
        rows = model.config.performer_attention["far_field_parameter"]
        assert len(rows) == 2 and all(len(row) == 4 and max(row) < 0.125 for row in rows)
        assert rows[0] != [0.0] * 4
        gains = model.config.performer_attention["far_field_gain"]
        assert len(gains) == 2 and all(len(row) == 4 and min(row) > 0 for row in gains)
        assert gains[0] != [1.0] * 4
        state = model.model.layers[0].self_attn.performer_attention
        assert state.far_field_gain == gains[0]  # what the model now runs with: plain numbers, no graph


@pytest.mark.parametrize("kernel", ["poly2", "taylor2"])
def test_a_transfer_that_ends_worse_keeps_the_model_as_it_was_and_reports_its_start(kernel, tmp_path, caplog):
    """A near-exact far field: Adam at the default rate moved the centres and gains by ~lr a step on near-zero
    gradients and left the logits further from the source (poly2 6.2e-5 -> 1.4e-3), while the report, whose first
    figure was the mean of steps 1-10, said the error fell ~20x."""
    source, folder = _source(DECODERS["llama"], tmp_path)
    model = _load(folder, "performer_hybrid", local_window=8, attention_kernel=kernel, far_field_parameter=None)
    held = _ids(2, 64, seed=99)
    with torch.no_grad():
        reference, before = source(held).logits, model(held).logits
    batches = [{"input_ids": _ids(2, 64, seed=10 + i)} for i in range(4)]
    with caplog.at_level("WARNING", logger="performer_hf"):
        report = performer_hf.transfer_attention(model, batches, steps=40, progress=False)
    assert report.restored and report.error_last == report.error_first
    assert "keeps the attention it had" in caplog.text
    assert not getattr(model.config, "performer_learned_attention", False)
    with torch.no_grad():
        after = model(held).logits
    assert torch.equal(after, before)  # not only no worse: the very model it was
    assert (after - reference).abs().max() < 1e-3
    # the report's first figure is the error before any update: what a transfer that moves nothing measures
    still = performer_hf.transfer_attention(model, batches[:1], steps=1, learning_rate=0.0, window=1, progress=False)
    first = performer_hf.transfer_attention(
        _load(folder, "performer_hybrid", local_window=8, attention_kernel=kernel, far_field_parameter=None),
        batches[:1],
        steps=1,
        window=1,
        progress=False,
    )
    assert first.error_first == pytest.approx(still.error_first, rel=1e-5)


def test_a_transferred_model_saves_reloads_and_decodes_exactly(tmp_path):
    _, folder = _source(DECODERS["qwen2"], tmp_path)
    model = _load(folder, "performer_hybrid", local_window=8)
    # (at the default rate five steps overshoot and end above the start: the model would keep what it had)
    report = performer_hf.transfer_attention(model, _batches(), steps=5, learning_rate=1e-3, progress=False)
    assert not report.restored and sum(report.error_last.values()) < sum(report.error_first.values())
    ids = _ids(1, 40, seed=4)
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path / "transferred")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "transferred").eval()
    assert reloaded.config.performer_learned_attention
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)
    # saved again from the reloaded model, the tensors stay
    reloaded.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    cache = PerformerCache(again.config)
    generated = again.generate(
        ids[:, :24],
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **{CACHE_KEYWORD: cache},
    )
    with torch.no_grad():
        full = again(generated.sequences).logits
    for step, logits in enumerate(generated.logits):
        torch.testing.assert_close(logits[0], full[0, 23 + step], atol=1e-5, rtol=1e-5)
    # the trained tensors are read at the first forward: a folder moved before it is named, with the fix
    moved = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    (tmp_path / "again").rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="cannot be read now .*load the model again from where its folder is"):
        moved(ids)


def test_transfer_refuses_inputs_the_window_covers_and_models_without_performer_attention(tmp_path):
    source, folder = _source(DECODERS["llama"], tmp_path)
    model = _load(folder, "performer_hybrid")  # window 64: 48-token inputs are exact attention
    with pytest.raises(ValueError, match="train on longer inputs"):
        performer_hf.transfer_attention(model, _batches(), steps=2, progress=False)
    with pytest.raises(ValueError, match="runs no Performer attention"):
        performer_hf.transfer_attention(source, _batches(), steps=2, progress=False)


def test_transfer_refusals_name_their_cause(tmp_path):
    """Ids of another tokenizer ended in torch's IndexError; a batch of padding alone said the transfer "diverged ...
    lower learning_rate"; an encoder under the bidirectional preset was told to "train on longer inputs", where its
    exact_max_length (2048, above BERT's 512 positions) kept every input exact. The model is left untouched."""
    _, folder = _source(DECODERS["llama"], tmp_path / "llama")  # vocabulary 96
    model = _load(folder, "performer_hybrid", local_window=8)
    with pytest.raises(ValueError, match=r"batch 1 holds token ids from .* outside the model's vocabulary \(0 to 95\)"):
        performer_hf.transfer_attention(
            model, [_batches()[0], {"input_ids": _ids(2, 48) + 200}], steps=2, progress=False
        )
    padding = {"input_ids": _ids(2, 48), "attention_mask": torch.zeros(2, 48, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"batch 0's attention_mask is all zeros: it has no real token"):
        performer_hf.transfer_attention(model, [padding], steps=2, progress=False)
    assert not getattr(model.config, "performer_learned_attention", False)
    _, bert = _source(_bert_config(), tmp_path / "bert", encoder=True)
    encoder = _load(bert, "performer_hybrid", encoder=True, local_window=8)
    with pytest.raises(ValueError, match=r"exact_max_length=2048 keeps bidirectional inputs .* these have 48\. Set it"):
        performer_hf.transfer_attention(encoder, _batches(), steps=2, progress=False)
    encoder.config.performer_attention = {**encoder.config.performer_attention, "exact_max_length": 0}
    report = performer_hf.transfer_attention(encoder, _batches(), steps=2, progress=False)  # the fix: it trains
    assert report.steps == 2  # (its poly2 far field is near-exact already: the model keeps it, report.restored)


def test_a_performer_family_model_is_refused_with_its_own_fix(tmp_path):
    """A Performer-family model was told it "runs no Performer attention" and to convert it with performer_hf.convert
    (which made it); its far field is calibrated at conversion."""
    model = tiny_model(PerformerForCausalLM, **METHODS["hybrid"])
    with pytest.raises(ValueError, match=r"Performer-family model .*--calibrate"):
        performer_hf.transfer_attention(model, _batches(), steps=2, progress=False)


def test_a_model_with_peft_adapters_is_refused_with_the_fix_and_a_merged_one_transfers(tmp_path):
    """On a LoRA model the transfer trained, but the adapter saved none of it (the learned tensors, A and the gains went
    to the base's weights and config): PeftModel.from_pretrained(base, adapter) ran logits 0.13 from the trained
    model's, without a word."""
    peft = pytest.importorskip("peft")
    _, folder = _source(DECODERS["llama"], tmp_path)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(_load(folder, "performer_hybrid", local_window=8), lora)
    for model in (wrapped, wrapped.base_model.model):  # the PeftModel, and the model peft injected the adapters into
        with pytest.raises(ValueError, match=r"peft adapters.*Transfer the base model, save it.*then add LoRA"):
            performer_hf.transfer_attention(model, _batches(), steps=2, progress=False)
    merged = wrapped.merge_and_unload()  # plain weights again: its own save keeps everything
    performer_hf.transfer_attention(merged, _batches(), steps=2, progress=False)
    assert merged.config.performer_learned_attention


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_transfer_trains_under_a_callers_no_grad_and_from_embeddings(mode, tmp_path):
    """Under the caller's no_grad (an evaluation helper) the refusal blamed the inputs ("train on longer inputs");
    batches of inputs_embeds trained a step, then a KeyError on 'input_ids'. Both train as input_ids do outside."""
    _, folder = _source(DECODERS["llama"], tmp_path)
    expected = performer_hf.transfer_attention(
        _load(folder, "performer_hybrid", **SHORT_WINDOW["performer_hybrid"]), _batches(), steps=2, progress=False
    )
    with mode():
        report = performer_hf.transfer_attention(
            _load(folder, "performer_hybrid", **SHORT_WINDOW["performer_hybrid"]), _batches(), steps=2, progress=False
        )
    assert report.error_first == expected.error_first and report.error_last == expected.error_last
    model = _load(folder, "performer_hybrid", **SHORT_WINDOW["performer_hybrid"])
    embedded = [{"inputs_embeds": model.get_input_embeddings()(b["input_ids"]).detach()} for b in _batches()]
    report = performer_hf.transfer_attention(model, embedded, steps=2, progress=False)
    assert report.steps == 2 and report.tokens == expected.tokens


def test_a_refused_transfer_leaves_the_model_as_it_was(tmp_path):
    """Whatever stops a transfer (a model without Performer attention, the sparse method, which has nothing to
    learn, batches that are not dicts of inputs), the model's parameters train and its mode is what it was."""
    source, folder = _source(DECODERS["llama"], tmp_path)
    sparse = _load(folder, "performer_sparse", **SHORT_WINDOW["performer_sparse"])
    cases = [
        (source, _batches(), "runs no Performer attention"),
        (sparse, _batches(), "the 'sparse' method has none: load the model with attn_implementation="),
        (source, [_ids(2, 48)], "each batch is a dict of the model's inputs"),
    ]
    for model, batches, message in cases:
        model.train()
        trainable = [p.requires_grad for p in model.parameters()]
        with pytest.raises(ValueError, match=message):
            performer_hf.transfer_attention(model, batches, steps=2, progress=False)
        assert model.training and [p.requires_grad for p in model.parameters()] == trainable


@pytest.mark.parametrize("implementation", ["performer", "performer_hybrid"])
def test_a_transfer_stopped_midway_leaves_the_model_as_it_was_and_can_be_retried(implementation, tmp_path):
    """A transfer refused after its first forward (inputs the window covers), diverged (a learning rate of 3: NaN
    gains, the model's logits NaN, reported as done) or interrupted had moved the centres and made parameters of
    the learnable tensors: the logits moved (6.5e-4) and the next, correct call failed with KeyError: 'projection'."""
    _, folder = _source(DECODERS["llama"], tmp_path)
    model = _load(folder, implementation, **SHORT_WINDOW[implementation])
    probe = _ids(1, 48, seed=9)
    with torch.no_grad():
        before = model(probe).logits
    stops = [
        ([{"input_ids": _ids(2, 6)}], {}, ValueError, "no layer's approximation was in use"),
        (_batches(), {"learning_rate": 1e6, "steps": 4}, ValueError, "diverged at step .* lower learning_rate"),
        (_batches(), {"learning_rate": -0.01}, ValueError, "learning_rate must be a finite number >= 0"),
        (_batches(), {"steps": 2.5}, ValueError, "steps must be a whole number >= 1"),
    ]
    if implementation == "performer":  # no window, and its projection alone learns (a large step does not
        # diverge): an interruption instead
        stops[:2] = [(_batches(), {"steps": 2, "interrupt": True}, KeyboardInterrupt, None)]  # (no message)
    for batches, options, error, message in stops:
        options = {"steps": 2, **options}
        if options.pop("interrupt", False):
            calls = []

            def interrupt(module, args, output, calls=calls):
                calls.append(1)
                if len(calls) == 3:  # during the second step
                    raise KeyboardInterrupt

            handle = model.model.layers[0].register_forward_hook(interrupt)
        with pytest.raises(error, match=message):
            performer_hf.transfer_attention(model, batches, progress=False, **options)
        if error is KeyboardInterrupt:
            handle.remove()
        with torch.no_grad():
            torch.testing.assert_close(model(probe).logits, before, rtol=0, atol=0)
    report = performer_hf.transfer_attention(model, _batches(), steps=2, progress=False)  # the retry
    assert report.steps == 2


def test_the_transfer_teacher_is_the_sources_attention_within_mistrals_window(tmp_path):
    """The teacher ran softmax over every key where Mistral attends within its window (logits 0.262 from the source
    at 48 tokens and a window of 16): every layer trained towards another model than the source."""
    from performer_hf.modeling.attention_interface import transfer_hooked
    from performer_hf.modeling.method_exact import softmax_attention

    config = type(DECODERS["mistral"])(**{**DECODERS["mistral"].to_dict(), "sliding_window": 16})
    source, folder = _source(config, tmp_path)
    model = _load(folder, "performer_hybrid", **SHORT_WINDOW["performer_hybrid"])
    ids = _ids(1, 48)

    def teacher(state, attend, q, k, v, key_mask, causal, window):
        return softmax_attention(q, k, v, key_mask, causal, window=window)[0]

    with torch.no_grad(), transfer_hooked(teacher):
        taught = model(ids).logits
    with torch.no_grad():
        torch.testing.assert_close(taught, source(ids).logits, rtol=1e-5, atol=1e-5)


def test_transfer_starts_the_centres_at_the_sources_mean_query_and_key(tmp_path):
    """Independent reference: the rotated queries and keys the source's own attention receives, captured by an
    attention function that then runs SDPA."""
    source, folder = _source(DECODERS["llama"], tmp_path)
    captured = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        groups = query.shape[1] // key.shape[1]
        captured[module.layer_idx] = (query, key.repeat_interleave(groups, dim=1))  # (B, H, L, d) each
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("capture_queries_and_keys", capture)
    AttentionMaskInterface.register("capture_queries_and_keys", sdpa_mask)
    ids = _ids(2, 48, seed=5)
    source.set_attn_implementation("capture_queries_and_keys")
    with torch.no_grad():
        source(ids)
    model = _load(folder, "performer_hybrid", **SHORT_WINDOW["performer_hybrid"])
    performer_hf.transfer_attention(model, [{"input_ids": ids}], steps=1, learning_rate=0.0, progress=False)
    for layer, (query, key) in captured.items():
        learned = model.model.layers[layer].self_attn.performer_attention
        scale = query.shape[-1] ** -0.25
        torch.testing.assert_close(learned.query_center, query.mean(dim=(0, 2)) * scale, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(learned.key_center, key.mean(dim=(0, 2)) * scale, atol=1e-5, rtol=1e-5)
    assert len(captured) == 2 and learned.query_center.abs().max() > 0


@pytest.mark.parametrize("root", ["transferred", "untransferred"])
def test_a_favor_transfer_in_a_subfolder_does_not_run_its_roots_tensors(root, tmp_path):
    """FAVOR+ transfer trains the projection alone, and the subfolder check compared the far field's settings: a
    model loaded from a subfolder ran the root's tensors (3.6e-3 from its own logits), or, under an untransferred
    root, was told to save again. Each transfer's config records a digest of its tensors."""
    _, folder = _source(DECODERS["llama"], tmp_path)
    for name, steps in (("root", 2), ("root/later", 6)):
        model = _load(folder, "performer")
        if name == "root/later" or root == "transferred":
            performer_hf.transfer_attention(model, _batches(), steps=steps, learning_rate=1e-2, progress=False)
        performer_hf.ship_remote_code(model).save_pretrained(tmp_path / name)
    with torch.no_grad():  # from its own path, the same model loads its own tensors
        own = AutoModelForCausalLM.from_pretrained(tmp_path / "root/later")(_ids(1, 40)).logits
        remote = AutoModelForCausalLM.from_pretrained(tmp_path / "root", subfolder="later", trust_remote_code=True)
        torch.testing.assert_close(remote(_ids(1, 40)).logits, own, rtol=0, atol=0)
        # the source's class finds the subfolder by the digest its config records
        source = AutoModelForCausalLM.from_pretrained(tmp_path / "root", subfolder="later")
        torch.testing.assert_close(source(_ids(1, 40)).logits, own, rtol=0, atol=0)


def test_trained_tensors_reach_every_copy_and_only_their_own_checkpoints_model(tmp_path, caplog):
    """A transferred model saved before its first forward kept no trained tensors (ship_remote_code, the README's
    fix, and a trust_remote_code load, saved again: the copy failed at its first forward); one loaded from a
    subfolder read the root checkpoint's tensors silently; one loaded with another method failed inside torch."""
    _, folder = _source(DECODERS["llama"], tmp_path)
    trained = {}
    for name, steps in (("root", 2), ("root/later", 6)):  # two transfers, the second in a subfolder of the first
        model = _load(folder, "performer_hybrid", local_window=8)
        performer_hf.transfer_attention(model, _batches(), steps=steps, learning_rate=1e-2, progress=False)
        with torch.no_grad():
            trained[name] = model(_ids(1, 40, seed=4)).logits
        performer_hf.ship_remote_code(model).save_pretrained(tmp_path / name)
    assert not torch.equal(trained["root"], trained["root/later"])

    def logits(model):
        with torch.no_grad():
            return model(_ids(1, 40, seed=4)).logits

    not_run = AutoModelForCausalLM.from_pretrained(tmp_path / "root/later")  # the source's class
    performer_hf.ship_remote_code(not_run).save_pretrained(tmp_path / "shipped")
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "shipped", trust_remote_code=True)
    remote.save_pretrained(tmp_path / "again")  # the folder's class, saved before it runs
    for copy in ("shipped", "again"):
        assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / copy).eval()), trained["root/later"])
    from_subfolder = AutoModelForCausalLM.from_pretrained(tmp_path / "root", subfolder="later", trust_remote_code=True)
    assert torch.equal(logits(from_subfolder.eval()), trained["root/later"])
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "root", subfolder="later").eval()
    assert torch.equal(logits(source), trained["root/later"])
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "root/later", attn_implementation="performer").eval()
    with caplog.at_level("WARNING"):
        assert torch.isfinite(logits(other)).all()
    assert "are another method's than the 'favor' it runs now" in caplog.text


def test_a_transferred_model_in_a_subfolder_of_an_empty_folder_runs_its_own_tensors(tmp_path):
    """transformers records the path alone: a model loaded with subfolder= from a folder holding nothing but that
    subfolder failed at its first forward, saying the folder "cannot be read now" (it was there). It reads its tensors
    from the subfolder whose config records them; with that subfolder gone, the refusal names both fixes."""
    _, folder = _source(DECODERS["llama"], tmp_path)
    model = _load(folder, "performer_hybrid", local_window=8)
    assert not performer_hf.transfer_attention(model, _batches(), steps=4, learning_rate=1e-3, progress=False).restored
    ids = _ids(1, 40, seed=4)
    with torch.no_grad():
        expected = model.eval()(ids).logits
        performer_hf.ship_remote_code(model).save_pretrained(tmp_path / "repo" / "sub")
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="sub").eval()
        assert torch.equal(loaded(ids).logits, expected)
        moved = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="sub").eval()
        (tmp_path / "repo" / "sub").rename(tmp_path / "elsewhere")
        with pytest.raises(ValueError, match="subfolder= .* trust_remote_code=True .* subfolder's own path"):
            moved(ids)


def test_torch_export_of_a_transferred_model_keeps_its_trained_tensors(tmp_path):
    """A reloaded transferred model reads its trained tensors at its first forward: when that forward is the export's
    trace, the program and the model afterwards must run those tensors, not export's fake copies of them (or the
    preset's draw)."""
    _, folder = _source(DECODERS["llama"], tmp_path)
    model = _load(folder, "performer")
    performer_hf.transfer_attention(model, _batches(), steps=3, learning_rate=1e-2, progress=False)
    ids = _ids(1, 40, seed=4)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        preset = _load(folder, "performer")(ids, use_cache=False).logits
    assert (expected - preset).abs().max() > 1e-3  # the trained tensors change the logits
    model.save_pretrained(tmp_path / "transferred")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "transferred").eval()
    program = torch.export.export(Logits(reloaded), (ids,))  # the first forward
    torch.testing.assert_close(program.module()(ids), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, use_cache=False).logits, expected, rtol=1e-5, atol=1e-5)
