"""Attention calls compiled on CUDA (``device_compile``), checked on the CPU: the same calls captured by dynamo and run
through AOTAutograd's graphs (``aot_eager``, no code generation) give the eager outputs and gradients at two lengths
(the second recompiles with dynamic shapes), for FAVOR+ (bidirectional and causal) and for the bidirectional hybrid on
the backend it takes on CUDA (FlexAttention's, its attention calls in plain PyTorch); cached calls, the causal hybrid,
the CPU by default and ``PERFORMER_HF_COMPILE=0`` stay eager. The token loss's chunks too."""

import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from performer_hf import CACHE_KEYWORD, PerformerForCausalLM, PerformerForMaskedLM
from performer_hf.modeling import device_compile, favor_hybrid
from performer_hf.modeling.hybrid_flex import FlexBackend

from ..flex_reference import dense_attend
from ..tiny_models import HYBRID_BIDIRECTIONAL, random_centres, random_ids, tiny_model

HYBRID = dict(HYBRID_BIDIRECTIONAL, attention_method="hybrid", exact_max_length=0)
# the calls compiled on CUDA: bidirectional FAVOR+ and hybrid, causal FAVOR+ (the causal hybrid stays eager)
MODELS = {
    "encoder, favor": (PerformerForMaskedLM, dict(attention_method="favor")),
    "decoder, favor": (PerformerForCausalLM, dict(attention_method="favor")),
    "encoder, hybrid": (PerformerForMaskedLM, HYBRID),
}


@pytest.fixture
def counter(monkeypatch):
    """Compile for the CPU with a counting ``aot_eager`` backend; dynamo's caches cleared around the test."""
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(device_compile, "COMPILED_DEVICES", ("cpu",))
    monkeypatch.setattr(device_compile, "BACKEND", backend)
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")  # FlexAttention's eager calls warn
        yield backend
    torch._dynamo.reset()


def _flex_backend(monkeypatch):
    """The hybrid's CUDA backend on every device, its FlexAttention calls in plain PyTorch (``dense_attend``: a
    CPU has no FlexAttention backward)."""
    monkeypatch.setattr(
        favor_hybrid,
        "choose_backend",
        lambda call, causal, continues=False: FlexBackend(
            (call.ctx.a, call.ctx.c), call.k.dtype, dense_attend, key_padding=call.key_padding
        ),
    )


def _step(model, length: int, device: str = "cpu"):
    """Logits and the gradients of every parameter for a right-padded batch of ``length`` tokens."""
    ids = random_ids(batch=2, length=length, seed=length).to(device)
    mask = torch.ones_like(ids)
    mask[1, length - 7 :] = 0
    model.zero_grad()
    extra = {"use_cache": False} if isinstance(model, PerformerForCausalLM) else {}  # as training does (eval: a cache)
    logits = model(input_ids=ids, attention_mask=mask, **extra).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1], device=device)).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_compiled_calls_match_eager_forward_and_backward(monkeypatch, counter, name):
    """A tiny model's logits and gradients, its attention compiled against eager, at 40 then 72 tokens."""
    if "hybrid" in name:
        _flex_backend(monkeypatch)
    model_class, settings = MODELS[name]
    model = random_centres(tiny_model(model_class, max_position_embeddings=80, **settings))
    for length in (40, 72):
        monkeypatch.setenv("PERFORMER_HF_COMPILE", "0")
        want_logits, want_grads = _step(model, length)
        monkeypatch.setenv("PERFORMER_HF_COMPILE", "1")
        got_logits, got_grads = _step(model, length)
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert counter.frame_count >= 2  # compiled for the first length, and again (dynamic) for the second


def test_cached_calls_and_the_cpu_by_default_stay_eager(monkeypatch, counter):
    """A FAVOR+ decoder's prefill with a cache and its next step compile nothing, nor does the causal hybrid; neither
    does an encoder on the CPU by default, nor with ``PERFORMER_HF_COMPILE=0``."""
    hybrid_decoder = random_centres(tiny_model(PerformerForCausalLM, attention_method="hybrid", exact_max_length=0))
    with torch.no_grad():
        hybrid_decoder(input_ids=random_ids(length=12))
    decoder = tiny_model(PerformerForCausalLM, attention_method="favor")
    with torch.no_grad():
        out = decoder(input_ids=random_ids(length=12), use_cache=True)
        decoder(input_ids=out.logits[:, -1:].argmax(-1), **{CACHE_KEYWORD: out.past_key_values})
    assert counter.frame_count == 0
    encoder = tiny_model(PerformerForMaskedLM, max_position_embeddings=80, attention_method="favor")
    monkeypatch.setenv("PERFORMER_HF_COMPILE", "0")
    with torch.no_grad():
        encoder(input_ids=random_ids(length=40))
    assert counter.frame_count == 0
    monkeypatch.setenv("PERFORMER_HF_COMPILE", "1")
    monkeypatch.setattr(device_compile, "COMPILED_DEVICES", ("cuda",))
    with torch.no_grad():
        encoder(input_ids=random_ids(length=40))
    assert counter.frame_count == 0


def test_a_torch_without_the_compile_settings_runs_eagerly(monkeypatch, counter):
    """torch < 2.7 lacks ``recompile_limit`` and ``fail_on_recompile_limit_hit``: nothing is compiled there (patching
    a setting torch lacks would raise)."""
    monkeypatch.setattr(device_compile, "_has_settings", lambda: False)
    encoder = tiny_model(PerformerForMaskedLM, max_position_embeddings=80, attention_method="favor")
    with torch.no_grad():
        logits = encoder(input_ids=random_ids(length=40)).logits
    assert counter.frame_count == 0 and bool(logits.isfinite().all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: inductor's kernels for it")
@pytest.mark.parametrize("name", MODELS)
def test_cuda_compiled_calls_match_eager(monkeypatch, name):
    """On CUDA, as shipped (inductor, FlexAttention for the hybrid), float32: logits and gradients against the same
    model with ``PERFORMER_HF_COMPILE=0``, at two lengths."""
    torch._dynamo.reset()
    model_class, settings = MODELS[name]
    model = random_centres(tiny_model(model_class, max_position_embeddings=80, **settings)).cuda()
    for length in (40, 72):
        monkeypatch.setenv("PERFORMER_HF_COMPILE", "0")
        want_logits, want_grads = _step(model, length, "cuda")
        monkeypatch.setenv("PERFORMER_HF_COMPILE", "1")
        got_logits, got_grads = _step(model, length, "cuda")
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)


def test_compiled_token_loss_matches_eager(monkeypatch, counter):
    """The token loss's chunks compiled (forward: the labels' log-probabilities; backward: softmax minus the label):
    the loss and the gradient of bfloat16 logits against eager, several chunks, unscored rows among them."""
    from performer_hf.modeling import token_loss

    monkeypatch.setattr(token_loss, "_chunks", lambda logits: [slice(0, 20), slice(20, 50), slice(50, 64)])
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 37, generator=generator).bfloat16().requires_grad_()
    labels = torch.randint(0, 37, (64,), generator=generator)
    labels[::5] = token_loss.IGNORE_INDEX

    def loss_and_grad():
        logits.grad = None
        loss = token_loss.token_cross_entropy(logits, labels)
        loss.backward()
        return loss.detach(), logits.grad.clone()

    monkeypatch.setenv("PERFORMER_HF_COMPILE", "0")
    want = loss_and_grad()
    monkeypatch.setenv("PERFORMER_HF_COMPILE", "1")
    got = loss_and_grad()
    assert counter.frame_count >= 2  # the forward and the backward chunk (then the last chunk's shape)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: inductor's kernels for it")
def test_cuda_compiled_token_loss_matches_eager(monkeypatch):
    """On CUDA (inductor): the token loss of bfloat16 logits, 3,000 tokens of BERT's vocabulary, against eager."""
    from performer_hf.modeling import token_loss

    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3000, 30522, generator=generator).bfloat16().cuda().requires_grad_()
    labels = torch.randint(0, 30522, (3000,), generator=generator).cuda()
    labels[::5] = token_loss.IGNORE_INDEX
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("PERFORMER_HF_COMPILE", flag)
        logits.grad = None
        loss = token_loss.token_cross_entropy(logits, labels)
        loss.backward()
        results.append((loss.detach(), logits.grad.clone()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-2, atol=1e-6)
