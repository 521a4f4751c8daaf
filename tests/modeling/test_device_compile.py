"""Attention calls compiled on CUDA (``device_compile``), checked on the CPU: the same calls captured by dynamo and run
through AOTAutograd's graphs (``aot_eager``, no code generation) give the eager outputs and gradients at two lengths,
for FAVOR+ and the hybrid, bidirectional and causal, each on the backend it takes on CUDA (the routed hybrid:
PyTorch's; a window and global keys: FlexAttention's, its attention calls in plain PyTorch). Lengths share a graph per
bucket, their padding invisible; layers share one graph. A decoder's prefill and decoding steps compile and decode as
eager; the CPU by default and ``PERFORMER_HF_COMPILE=0`` stay eager. The token loss's chunks too."""

import types
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from performer_hf import PerformerForCausalLM, PerformerForMaskedLM
from performer_hf.favor import draw_projection, favor_attention
from performer_hf.modeling import device_compile, far_field_polynomial, favor_hybrid, hybrid_backends, slabs
from performer_hf.modeling.hybrid_flex import TILE, FlexBackend

from ..flex_reference import dense_attend
from ..tiny_models import HYBRID_BIDIRECTIONAL, random_centres, random_ids, tiny_model

HYBRID = dict(HYBRID_BIDIRECTIONAL, attention_method="hybrid", exact_max_length=0)
WINDOWED = dict(HYBRID, routed_blocks=0)  # a window and a global key: FlexAttention's mask compares positions only
# the calls compiled on CUDA, and whether the hybrid's backend there is FlexAttention's (else PyTorch's)
MODELS = {
    "encoder, favor": (PerformerForMaskedLM, dict(attention_method="favor"), False),
    "decoder, favor": (PerformerForCausalLM, dict(attention_method="favor"), False),
    "encoder, hybrid": (PerformerForMaskedLM, HYBRID, False),
    "encoder, hybrid, no routing": (PerformerForMaskedLM, WINDOWED, True),
    "decoder, hybrid": (PerformerForCausalLM, dict(attention_method="hybrid", exact_max_length=0), True),
    # the hybrid after the state of 4 exact positions (the rest of 37 to 39 tokens shares the bucket of 36)
    "decoder, exact prefix then hybrid": (
        PerformerForCausalLM,
        dict(attention_method="hybrid", exact_max_length=4),
        True,
    ),
}


# graphs of a model's exact prefix's state, beside its attention call's (the prefix has the same length every time)
PREFIX_STATE_GRAPHS = {name: int("exact prefix" in name) for name in MODELS}


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
    """The hybrid's FlexAttention backend on every device, its attention calls in plain PyTorch (``dense_attend``: a
    CPU has no FlexAttention backward)."""
    monkeypatch.setattr(
        favor_hybrid,
        "choose_backend",
        lambda call, causal: FlexBackend(
            (call.ctx.a, call.ctx.c), call.k.dtype, dense_attend, key_padding=call.key_padding
        ),
    )


def _model(monkeypatch, name: str, device: str = "cpu"):
    model_class, settings, flex = MODELS[name]
    if flex and device == "cpu":
        _flex_backend(monkeypatch)
    return random_centres(tiny_model(model_class, max_position_embeddings=80, **settings)).to(device)


def _step(model, length: int, device: str = "cpu", padded: bool = True):
    """Logits and the gradients of every parameter for a batch of ``length`` tokens, right-padded or not."""
    ids = random_ids(batch=2, length=length, seed=length).to(device)
    mask = torch.ones_like(ids)
    mask[1, length - 7 :] = 0
    model.zero_grad()
    extra = {"use_cache": False} if isinstance(model, PerformerForCausalLM) else {}  # as training does (eval: a cache)
    logits = model(input_ids=ids, attention_mask=mask if padded else None, **extra).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1], device=device)).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_matches_eager(monkeypatch, model, length: int, device: str = "cpu", padded: bool = True, tol=1e-5):
    monkeypatch.setenv("PERFORMER_HF_COMPILE", "0")
    want_logits, want_grads = _step(model, length, device, padded)
    monkeypatch.setenv("PERFORMER_HF_COMPILE", "1")
    got_logits, got_grads = _step(model, length, device, padded)
    torch.testing.assert_close(got_logits, want_logits, rtol=tol, atol=tol)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=10 * tol, atol=tol, msg=name)


@pytest.mark.parametrize("name", MODELS)
def test_compiled_calls_match_eager_forward_and_backward(monkeypatch, counter, name):
    """A tiny model's logits and gradients, its attention compiled against eager, at 40 then 72 tokens (bucket
    lengths: no padding)."""
    model = _model(monkeypatch, name)
    for length in (40, 72):
        _assert_matches_eager(monkeypatch, model, length)
    assert counter.frame_count >= 2  # a graph for each length


@pytest.mark.parametrize("name", MODELS)
def test_lengths_of_one_bucket_share_a_graph_and_see_no_padding(monkeypatch, counter, name):
    """37, 38 and 39 tokens run in the graph of 40 (padded at the end, the padding masked out): with and without a
    padding mask of their own, logits and gradients equal eager's; one graph per kind of call, not per length."""
    model = _model(monkeypatch, name)
    _assert_matches_eager(monkeypatch, model, 37)
    graphs = counter.frame_count
    assert graphs >= 1
    for length in (38, 39):
        _assert_matches_eager(monkeypatch, model, length)
    assert counter.frame_count == graphs  # the bucket's graph served every length
    _assert_matches_eager(monkeypatch, model, 39, padded=False)
    # with or without a mask (the exact prefix's state: a graph of each)
    assert counter.frame_count == graphs + PREFIX_STATE_GRAPHS[name]


def test_the_far_field_built_from_features_compiles_as_on_cuda(monkeypatch, counter):
    """On CUDA the polynomial far field's state is built from explicit features (``from_features``, its pair products
    a custom autograd function): compiled, it gives eager's logits and gradients, every layer in one graph."""
    monkeypatch.setattr(far_field_polynomial, "from_features", lambda device: True)
    model = _model(monkeypatch, "encoder, hybrid")
    _assert_matches_eager(monkeypatch, model, 40)
    assert counter.frame_count == 1


def test_layers_with_their_own_far_field_settings_share_one_graph(monkeypatch, counter):
    """A decoder as conversion leaves it (FAVOR++'s A calibrated per layer and head) with gains per layer and head: its
    two layers run one graph without breaks (as numbers, each layer's values were constants of a graph of its own,
    and the gain's check broke it), matching eager."""
    settings = dict(attention_kernel="softmax_opt", far_field_parameter=[[-0.01] * 4, [-0.03] * 4])
    settings["far_field_gain"] = [[1.0, 1.1, 1.2, 1.3], [0.9] * 4]
    model = random_centres(tiny_model(PerformerForCausalLM, attention_method="hybrid", exact_max_length=0, **settings))
    _flex_backend(monkeypatch)
    _assert_matches_eager(monkeypatch, model, 40)
    assert counter.frame_count == 1


def test_a_traced_hybrid_cuts_its_queries_into_fewer_slabs(monkeypatch, counter):
    """Each slab is a copy of the traced graph: traced, the slab budget counts a slab's logits and its candidates'
    fields, not their product as eagerly. With a budget that cuts 72 tokens into 3 slabs eagerly, the compiled graph
    is the one-slab graph (as many operations as under the default budget), and its logits and gradients are
    eager's."""
    from performer_hf.modeling import hybrid_selection, slabs

    model = _model(monkeypatch, "encoder, hybrid")
    _assert_matches_eager(monkeypatch, model, 72)
    one_slab_ops = counter.op_count
    eager_slabs = []

    def recorded(length, per_row, use, device):
        sizes = slabs.slab_sizes(length, per_row, use, device)
        if not torch.compiler.is_compiling():
            eager_slabs.append(len(sizes))
        return sizes

    monkeypatch.setattr(hybrid_selection, "slab_sizes", recorded)
    monkeypatch.setitem(slabs.SLAB_ELEMENTS["cpu"], "blocks", 1 << 15)
    small_budget = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(device_compile, "BACKEND", small_budget)
    _assert_matches_eager(monkeypatch, model, 72)
    assert max(eager_slabs) == 3 and small_budget.op_count == one_slab_ops


@pytest.mark.parametrize("name", [name for name, (_, _, flex) in MODELS.items() if flex])
def test_flex_attention_itself_traces_into_the_graph(monkeypatch, counter, name):
    """The FlexAttention backend with torch's own ``flex_attention`` (not its plain-PyTorch contract): traced whole
    into the compiled graph, block mask and ``mask_mod`` built inside it, the logits of a padded batch in its bucket
    equal eager's (forward only: a CPU runs FlexAttention's forward alone)."""
    monkeypatch.setattr(
        favor_hybrid,
        "choose_backend",
        lambda call, causal: FlexBackend((call.ctx.a, call.ctx.c), call.k.dtype, key_padding=call.key_padding),
    )
    model_class, settings, _ = MODELS[name]
    model = random_centres(tiny_model(model_class, max_position_embeddings=80, **settings))
    ids = random_ids(batch=2, length=69, seed=0)
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    extra = {"use_cache": False} if model_class is PerformerForCausalLM else {}
    logits = {}
    with torch.no_grad():
        for flag in ("0", "1"):
            monkeypatch.setenv("PERFORMER_HF_COMPILE", flag)
            logits[flag] = model(input_ids=ids, attention_mask=mask, **extra).logits
    assert counter.frame_count == 1 + PREFIX_STATE_GRAPHS[name]
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-5, atol=1e-5)


def test_a_graph_beyond_the_gpus_shared_memory_runs_eagerly_from_then_on(monkeypatch, counter, caplog):
    """Triton's "out of resource" while compiling an attention call (seen for FlexAttention's default tiles on an
    H200): that kind of call runs eagerly from then on, with a warning, where it would fail (and, not cached, be
    compiled again at every call); other errors are raised."""
    attempts = []

    def out_of_resource(graph, example_inputs):
        attempts.append(1)
        raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_0")

    monkeypatch.setattr(device_compile, "BACKEND", out_of_resource)
    monkeypatch.setattr(device_compile, "_EAGER_KINDS", set())
    model = _model(monkeypatch, "encoder, favor")
    with caplog.at_level("WARNING", logger=device_compile.__name__):
        _assert_matches_eager(monkeypatch, model, 37)
        _assert_matches_eager(monkeypatch, model, 70)
    assert len(attempts) == 1 and "runs eagerly" in caplog.text

    def broken(graph, example_inputs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(device_compile, "BACKEND", broken)
    monkeypatch.setattr(device_compile, "_EAGER_KINDS", set())
    with pytest.raises(Exception, match="a bug"):
        _step(model, 37)


def test_bucket_lengths():
    """At most 12.5% longer, powers of two and multiples of their eighth unchanged, eight per octave."""
    lengths = range(1, 5000)
    buckets = [device_compile.bucket_length(n) for n in lengths]
    assert all(n <= b <= n * 1.125 for n, b in zip(lengths, buckets, strict=True))
    assert all(device_compile.bucket_length(1 << p) == 1 << p for p in range(20))
    assert device_compile.bucket_length(8193) == 9216 and device_compile.bucket_length(9216) == 9216
    assert len({b for n, b in zip(lengths, buckets, strict=True) if 2048 < n <= 4096}) == 8


def test_traced_hybrid_takes_flex_only_where_its_mask_looks_little_up(monkeypatch):
    """Traced on CUDA: FlexAttention without routed blocks (its mask_mod compares positions) or with blocks routed
    per tile of queries, PyTorch with finer routing (the default's: FlexAttention's lookups measured slower than
    the compiled gathers), unless the Triton support sums take it; PyTorch on other devices."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    flex = FlexBackend((None, None), torch.float32)
    chosen = {"cuda": flex, "triton": None}
    monkeypatch.setattr(hybrid_backends, "_cuda_backend", lambda call, causal: chosen["cuda"])
    monkeypatch.setattr(hybrid_backends, "_triton_backend", lambda call, causal: chosen["triton"])

    def backend(device: str, routed_blocks: int, query_block_size: int = 16):
        call = types.SimpleNamespace(
            x=types.SimpleNamespace(device=torch.device(device)),
            spec=types.SimpleNamespace(routed_blocks=routed_blocks, query_block_size=query_block_size),
            ctx=types.SimpleNamespace(far=None),
        )
        return hybrid_backends.choose_backend(call, causal=False)

    assert backend("cuda", 0) is flex
    assert backend("cuda", 16, query_block_size=TILE) is flex
    assert backend("cuda", 24) is hybrid_backends.PYTORCH
    assert backend("cuda", 4, query_block_size=TILE // 2) is hybrid_backends.PYTORCH
    assert backend("cpu", 0) is hybrid_backends.PYTORCH
    chosen["triton"] = triton = hybrid_backends.TritonBackend("pytorch")  # custom operators: traced as they are
    assert backend("cuda", 24) is triton


def test_the_cpu_by_default_and_compile_off_stay_eager(monkeypatch, counter):
    """An encoder on the CPU by default (compiled devices: CUDA) and with ``PERFORMER_HF_COMPILE=0`` compiles
    nothing. (Decoding steps compile nothing either: below.)"""
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


@pytest.mark.parametrize(
    "settings",
    [
        dict(attention_method="hybrid", exact_max_length=0),
        dict(attention_method="hybrid", exact_max_length=16),
        dict(attention_method="hybrid", exact_max_length=0, attention_kernel="poly2"),
        dict(attention_method="favor"),
    ],
    ids=["hybrid", "exact prefix then hybrid", "hybrid, polynomial far field", "favor"],
)
def test_a_prefill_and_its_decoding_steps_compile_and_decode_as_eager(monkeypatch, counter, settings):
    """A decoder's prefill with a cache: its output from the compiled call (bucketed: 37 tokens run as 40), FAVOR+'s
    state with it, the hybrid's computed alone (``hybrid_prefill_state``); then its decoding steps, compiled
    (``decode_step``); greedy generation of a left-padded batch gives eager's tokens and step logits, and a longer
    generation compiles nothing more (no graph per step or per length of the past)."""
    _flex_backend(monkeypatch)
    model = random_centres(tiny_model(PerformerForCausalLM, max_position_embeddings=80, **settings))
    generated = _eager_and_compiled_generations(monkeypatch, model)
    hybrid, prefix = settings["attention_method"] == "hybrid", settings.get("exact_max_length", 0) > 0
    # the prefill's graph (its layers share it), the hybrid's state's, the exact prefix's state's, and the steps':
    # the hybrid's state carries the past's length, specialised at the first step and dynamic from the second (the
    # first step after an exact prefix: dynamic at once, the attention call having met another length before)
    steps = 1 + (hybrid and not prefix)
    assert counter.frame_count == 1 + hybrid + prefix + steps
    assert torch.equal(generated["1"][0], generated["0"][0])
    torch.testing.assert_close(generated["1"][1], generated["0"][1], rtol=1e-5, atol=1e-5)
    longer = _eager_and_compiled_generations(monkeypatch, model, new_tokens=12)
    assert counter.frame_count == 1 + hybrid + prefix + steps
    assert torch.equal(longer["1"][0], longer["0"][0])
    torch.testing.assert_close(longer["1"][1], longer["0"][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
@pytest.mark.parametrize("left_padded", [False, True], ids=["no mask", "left-padded"])
def test_a_favor_prefill_compiled_with_its_state_holds_no_padding(counter, kernel, left_padded):
    """FAVOR+'s prefill compiled with its state at a bucketed length (37 tokens run as 40): the keys that pad it have
    no features, so its output and state are the eager call's on the 37 tokens alone."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g) for _ in range(3))
    projection = draw_projection(32, 16, generator=g)
    mask = None
    if left_padded:
        mask = torch.ones(2, 37, dtype=torch.bool)
        mask[1, :5] = False
    settings = dict(causal=True, kernel=kernel, key_padding_mask=mask, return_state=True)
    out, state = device_compile.call_compiled_attention(favor_attention, q, k, v, projection, **settings)
    want, want_state = favor_attention(q, k, v, projection, **settings)
    assert counter.frame_count == 1
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.shift, want_state.shift, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state.kv, want_state.kv, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exact_max_length", [0, 16], ids=["hybrid", "exact prefix then hybrid"])
def test_a_prefills_state_compiles_once_for_every_later_prompt_length(monkeypatch, counter, exact_max_length):
    """Prompts of three lengths: the hybrid's prefill state compiles for a first length and then once with dynamic
    lengths (its inputs copied contiguous: views of the sequence would guard on its length), not once per length,
    and so do the decoding steps (the state's window buffer a tensor of its own, whatever the prompt's length); each
    prompt generates eager's tokens and step logits."""
    _flex_backend(monkeypatch)
    settings = dict(attention_method="hybrid", exact_max_length=exact_max_length)
    model = random_centres(tiny_model(PerformerForCausalLM, max_position_embeddings=80, **settings))
    lengths = (37, 29, 21)  # attention buckets 40, 30, 22: a graph each
    for length in lengths:
        generated = _eager_and_compiled_generations(monkeypatch, model, length=length)
        assert torch.equal(generated["1"][0], generated["0"][0])
        torch.testing.assert_close(generated["1"][1], generated["0"][1], rtol=1e-5, atol=1e-5)
    # the state's: one static graph (the first prompt's, or the exact prefix's, always 16 long), then one dynamic; the
    # steps': as in test_a_prefill_and_its_decoding_steps_compile_and_decode_as_eager
    assert counter.frame_count == len(lengths) + 2 + (1 if exact_max_length else 2)


def _eager_and_compiled_generations(
    monkeypatch, model, device: str = "cpu", length: int = 37, new_tokens: int = 5
) -> dict:
    """Greedy generation of ``new_tokens`` after a left-padded batch of ``length``, with ``PERFORMER_HF_COMPILE``
    "0" and "1": ``{flag: (sequences, step logits)}``."""
    ids = random_ids(batch=2, length=length, seed=3).to(device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    generated = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PERFORMER_HF_COMPILE", flag)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        generated[flag] = out.sequences, torch.stack(out.logits)
    return generated


def test_a_torch_without_the_compile_settings_runs_eagerly(monkeypatch, counter):
    """torch < 2.7 lacks ``recompile_limit`` and ``fail_on_recompile_limit_hit``: nothing is compiled there (patching
    a setting torch lacks would raise)."""
    monkeypatch.setattr(device_compile, "compile_settings", lambda: {})  # the limits such a torch has
    device_compile._has_settings.cache_clear()
    try:
        encoder = tiny_model(PerformerForMaskedLM, max_position_embeddings=80, attention_method="favor")
        with torch.no_grad():
            logits = encoder(input_ids=random_ids(length=37)).logits
    finally:
        device_compile._has_settings.cache_clear()
    assert counter.frame_count == 0 and logits.shape[1] == 37 and bool(logits.isfinite().all())


@pytest.mark.cuda
@pytest.mark.parametrize("name", MODELS)
def test_cuda_compiled_calls_match_eager(monkeypatch, name):
    """On CUDA, as shipped (inductor; the hybrid on its backend there), float32: logits and gradients against the same
    model with ``PERFORMER_HF_COMPILE=0``, for a padded batch of 69 tokens in the bucket of 72 (one graph per model:
    inductor's compilations are the slow part of the GPU check)."""
    torch._dynamo.reset()
    model = _model(monkeypatch, name, "cuda")
    _assert_matches_eager(monkeypatch, model, 69, "cuda", tol=1e-4)


DECODERS = {"hybrid": dict(attention_method="hybrid", exact_max_length=0), "favor": dict(attention_method="favor")}


@pytest.mark.cuda
@pytest.mark.parametrize("name", DECODERS)
def test_cuda_prefill_decodes_as_eager(monkeypatch, name):
    """On CUDA, float32: a decoder's compiled prefill and its compiled decoding steps generate eager's tokens (whose
    state comes from the causal scan's kernels), step logits within the kernels' float32 rounding. The hybrid's
    prefill computes its cache's state apart, in the Triton kernels of ``exp_key_state``; FAVOR+'s returns it with its
    output (the compiled scan's), and launches none of them."""
    from performer_hf.modeling import favor_exp

    torch._dynamo.reset()
    launched = []
    kernels = favor_exp.triton_exp_key_state
    monkeypatch.setattr(favor_exp, "triton_exp_key_state", lambda *args: launched.append(1) or kernels(*args))
    # heads of 16 dimensions, the kernels' narrowest
    settings = dict(max_position_embeddings=80, hidden_size=64, **DECODERS[name])
    model = random_centres(tiny_model(PerformerForCausalLM, **settings)).cuda()
    generated = _eager_and_compiled_generations(monkeypatch, model, "cuda")
    assert bool(launched) == (name == "hybrid")  # the hybrid's compiled prefill state
    assert torch.equal(generated["1"][0], generated["0"][0])
    torch.testing.assert_close(generated["1"][1], generated["0"][1], rtol=1e-4, atol=1e-4)


def _eager_and_compiled_loss(monkeypatch, logits, labels) -> tuple[tuple, tuple]:
    """The token loss of ``logits`` against ``labels`` and its gradient, eager then compiled: ((loss, grad), (loss,
    grad))."""
    from performer_hf.modeling import token_loss

    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("PERFORMER_HF_COMPILE", flag)
        logits.grad = None
        loss = token_loss.token_cross_entropy(logits, labels)
        loss.backward()
        results.append((loss.detach(), logits.grad.clone()))
    return results[0], results[1]


def test_compiled_token_loss_matches_eager(monkeypatch, counter):
    """The token loss's chunks compiled (forward: the labels' log-probabilities; backward: softmax minus the label):
    the loss and the gradient of bfloat16 logits against eager, several chunks, unscored rows among them."""
    from performer_hf.modeling import token_loss

    monkeypatch.setattr(token_loss, "_chunks", lambda logits: [slice(0, 20), slice(20, 50), slice(50, 64)])
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 37, generator=generator).bfloat16().requires_grad_()
    labels = torch.randint(0, 37, (64,), generator=generator)
    labels[::5] = token_loss.IGNORE_INDEX

    want, got = _eager_and_compiled_loss(monkeypatch, logits, labels)
    assert counter.frame_count >= 2  # the forward and the backward chunk (then the last chunk's shape)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_compiled_token_loss_takes_all_rows_at_once_without_a_scatter(monkeypatch, counter):
    """Compiled, the loss runs as one chunk of all rows each way (no gradient copied into place), and backward's graph
    subtracts the label without an in-place scatter into the softmax (inductor would have to write the softmax out
    first); the gradient is eager's, to the bit."""
    from performer_hf.modeling import token_loss

    graphs = []

    def capturing(graph_module, example_inputs):
        graphs.append(graph_module)
        return counter(graph_module, example_inputs)

    monkeypatch.setattr(device_compile, "BACKEND", capturing)
    monkeypatch.setitem(slabs.SLAB_ELEMENTS["cpu"], "loss", 37 * 16)  # eagerly: chunks of 16 rows, the last of 6
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, 37, generator=generator).bfloat16().requires_grad_()
    labels = torch.randint(0, 37, (3, 50), generator=generator)
    labels[:, ::4] = token_loss.IGNORE_INDEX

    want, got = _eager_and_compiled_loss(monkeypatch, logits, labels)
    assert counter.frame_count == 2  # one forward chunk, one backward chunk
    called = [str(node.target) for graph in graphs for node in graph.graph.nodes if node.op.startswith("call")]
    assert any("softmax" in name for name in called) and not any("scatter" in name for name in called)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_compiled_token_loss_of_logits_in_padded_rows(monkeypatch, counter):
    """The heads' logits are the first columns of rows padded for the matrix kernels (vocabulary_projection): compiled
    on such a view, the loss and the padded rows' gradient are eager's, to the bit, both F.cross_entropy's on the
    logits alone, and nothing reaches the padding."""
    from performer_hf.modeling import token_loss

    generator = torch.Generator().manual_seed(2)
    padded = torch.randn(3, 50, 64, generator=generator).bfloat16().requires_grad_()  # 37 words in rows of 64
    labels = torch.randint(0, 37, (3, 50), generator=generator)
    labels[:, ::4] = token_loss.IGNORE_INDEX
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("PERFORMER_HF_COMPILE", flag)
        padded.grad = None
        loss = token_loss.token_cross_entropy(padded[..., :37], labels)
        loss.backward()
        results.append((loss.detach(), padded.grad.clone()))
    assert counter.frame_count == 2  # one forward chunk, one backward chunk
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)
    assert not results[1][1][..., 37:].any()
    plain = padded.detach()[..., :37].float().requires_grad_()
    want = torch.nn.functional.cross_entropy(plain.reshape(-1, 37), labels.reshape(-1))
    want.backward()
    torch.testing.assert_close(results[1][0], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1][..., :37].float(), plain.grad, rtol=1e-2, atol=1e-4)


@pytest.mark.cuda
def test_cuda_compiled_token_loss_matches_eager(monkeypatch):
    """On CUDA (inductor): the token loss of bfloat16 logits, 3,000 tokens of BERT's vocabulary, against eager;
    compiled, its forward and backward make nothing of the logits' size but their gradient (no float32 softmax)."""
    from performer_hf.modeling import token_loss

    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3000, 30522, generator=generator).bfloat16().cuda().requires_grad_()
    labels = torch.randint(0, 30522, (3000,), generator=generator).cuda()
    labels[::5] = token_loss.IGNORE_INDEX
    results, peaks = [], []
    for flag in ("0", "1", "1"):  # eager, compiled (compiling), compiled again
        monkeypatch.setenv("PERFORMER_HF_COMPILE", flag)
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = token_loss.token_cross_entropy(logits, labels)
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        results.append((loss.detach(), logits.grad.clone()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-2, atol=1e-6)
    assert peaks[2] < 1.25 * logits.numel() * logits.element_size()  # the gradient and per-row vectors
