"""The FlexAttention backend of hybrid attention (CUDA's) on the CPU: FlexAttention's eager forward against the dense
O(L^2) reference and the PyTorch backend; gradients through ``dense_attend`` (FlexAttention's contract in
PyTorch, as FlexAttention has no backward on a CPU); which calls the backend serves on CUDA. The last tests run on a
CUDA device only: the compiled kernels, forward and backward, against the float32 CPU reference."""

import warnings

import pytest
import torch

from performer_hf import CACHE_KEYWORD, PerformerForCausalLM, PerformerForMaskedLM
from performer_hf.favor import draw_projection, hybrid_attention
from performer_hf.modeling import favor_hybrid, hybrid_backends, hybrid_flex
from performer_hf.modeling.attention_methods import ATTENTION_METHODS
from performer_hf.modeling.hybrid_flex import FlexBackend, flex_attend
from performer_hf.modeling.hybrid_spec import HybridSpec

from ..flex_reference import bfloat16_tolerances, dense_attend, sdpa_bfloat16_errors
from ..hybrid_reference import random_qkv, reference, right_padding
from ..tiny_models import random_centres, random_ids, tiny_model

# supports the backend serves (its query and key blocks divide the 128-position tile)
CONFIGS = [
    dict(local_window=5),
    dict(local_window=4, num_global_tokens=2),
    dict(num_global_tokens=3),
    dict(local_window=7, num_global_tokens=1, routed_blocks=2, route_block_size=4, query_block_size=8),
    dict(local_window=1, routed_blocks=20, route_block_size=4, query_block_size=4),  # more blocks than qualify
    dict(
        local_window=7, num_global_tokens=1, routed_blocks=2, route_block_size=4, route_group_size=4, query_block_size=8
    ),
]
# the converter's bidirectional default (its preset, as hybrid_attention's settings), at a length where it approximates
DEFAULT = {
    setting: ATTENTION_METHODS["hybrid"].presets["bidirectional"][field]
    for setting, field in HybridSpec.config_fields().items()
    if field in ATTENTION_METHODS["hybrid"].presets["bidirectional"]
}


@pytest.fixture(autouse=True)
def quiet_eager_flex():
    """FlexAttention warns at each eager (unfused) call, which is how it runs on a CPU."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        yield


def _flex(monkeypatch, attend=flex_attend):
    """Make every hybrid call use the FlexAttention backend, whatever its device."""
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    monkeypatch.setattr(
        favor_hybrid,
        "choose_backend",
        lambda call, causal: FlexBackend((call.ctx.a, call.ctx.c), call.k.dtype, attend, key_padding=call.key_padding),
    )


def _close_to_float64(out, ref, mask):
    """The backend runs in float32 (FlexAttention's log-sum-exp is float32 whatever its inputs): against the float64
    reference, float32's tolerance."""
    torch.testing.assert_close(_masked(out.double(), mask), _masked(ref, mask), rtol=1e-4, atol=1e-5)


def _masked(out, mask):
    """Padded queries' outputs are unspecified (the dense reference's are NaN where a query sees no real key)."""
    return out if mask is None else torch.where(mask[:, None, :, None], out, 0.0)


def _causal_kwargs(far_field):
    kwargs = dict(far_field=far_field, causal=True, query_center=torch.zeros(2, 8), key_center=torch.zeros(2, 8))
    if far_field == "softmax_opt":
        kwargs["far_field_parameter"] = -0.05
    return kwargs


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("far_field", ["poly2", "taylor2"])
@pytest.mark.parametrize("padded", [False, True])
def test_bidirectional_matches_the_dense_reference(monkeypatch, config, far_field, padded):
    q, k, v = random_qkv()
    mask = right_padding(2, 45) if padded else None
    _flex(monkeypatch)
    with torch.no_grad():
        out = hybrid_attention(
            *(t.float() for t in (q, k, v)), far_field=far_field, center=True, key_padding_mask=mask, **config
        )
    ref = reference(q, k, v, far_field=far_field, center=True, mask=mask, **config)
    _close_to_float64(out, ref, mask)


@pytest.mark.parametrize("config", [c for c in CONFIGS if "routed_blocks" not in c], ids=str)
@pytest.mark.parametrize("far_field", ["softmax_opt", "poly2"])
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_causal_from_the_first_token_matches_the_dense_reference(monkeypatch, config, far_field, padding):
    """Left padding is what batched generate() feeds a causal model."""
    q, k, v = random_qkv()
    W = draw_projection(24, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = {"none": None, "right": right_padding(2, 45), "left": right_padding(2, 45).flip(-1)}[padding]
    kwargs = {**_causal_kwargs(far_field), **config}
    _flex(monkeypatch)
    with torch.no_grad():
        out = hybrid_attention(
            *(t.float() for t in (q, k, v)), W.float(), key_padding_mask=mask, chunk_size=8, **kwargs
        )
    ref = reference(q, k, v, W, mask=mask, **kwargs)
    _close_to_float64(out, ref, mask)


@pytest.mark.parametrize(
    "config",
    [
        *(c for c in CONFIGS if "routed_blocks" not in c),
        dict(local_window=1, num_global_tokens=2),
        dict(local_window=150),
    ],
    ids=str,
)
@pytest.mark.parametrize("splits", [[3, 297], [140, 1, 159], [257, 43]], ids=str)
@pytest.mark.parametrize("padding", ["none", "left"])
def test_causal_after_a_state_matches_the_dense_reference(monkeypatch, config, splits, padding):
    """Calls after a state (a prefill in chunks; the queries after an exact prefix) read the state's global keys
    and window buffer before their own: offsets below and above the window and the global tokens, windows narrower
    and wider than a tile, a call that starts inside the global tokens."""
    length = sum(splits)
    q, k, v = random_qkv(length=length, seed=3)
    W = draw_projection(24, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = right_padding(2, length, real=(length, 250)).flip(-1) if padding == "left" else None
    kwargs = {**_causal_kwargs("softmax_opt"), **config}
    ref = reference(q, k, v, W, mask=mask, **kwargs)
    _flex(monkeypatch)
    state, outs, start = None, [], 0
    with torch.no_grad():
        for n in splits:
            part = [t[:, :, start : start + n].float() for t in (q, k, v)]
            part_mask = None if mask is None else mask[:, start : start + n]
            out, state = hybrid_attention(
                *part, W.float(), key_padding_mask=part_mask, initial_state=state, return_state=True, **kwargs
            )
            outs.append(out)
            start += n
    _close_to_float64(torch.cat(outs, dim=2), ref, mask)


# routing by blocks of 128 queries (one tile), one block of 64 keys each: most of a tile row holds no support
COARSE = dict(DEFAULT, routed_blocks=1, route_block_size=64, route_group_size=0, query_block_size=128)
# a support that tiles hold whole: a window of 257 fills each diagonal tile, a routed block of 128 keys its tile, two
# routed blocks of 64 keys a tile when both fall in it
TILED = dict(DEFAULT, local_window=257, routed_blocks=2, route_block_size=128, route_group_size=0, query_block_size=128)
HALF_TILED = dict(TILED, routed_blocks=4, route_block_size=64)
SUPPORTS = {"default": DEFAULT, "coarse": COARSE, "tiled": TILED, "half tiled": HALF_TILED}


@pytest.mark.parametrize("name", SUPPORTS)
@pytest.mark.parametrize("padded", [False, True])
def test_1k_tokens_match_the_pytorch_backend(monkeypatch, name, padded):
    """1,024 tokens: 8 x 8 tiles. With coarse routing the support leaves tiles empty, so the block mask's tiles,
    not only its mask_mod, decide what FlexAttention reads; the default's routed blocks of 8 keys for blocks of 16
    queries reach into every tile here. Tiles the support fills are read whole (no mask_mod): every pair of each is
    in the support, as the mask_mod says pair by pair (with the default too: the padded queries of a row all route to
    the same first blocks, which fill a tile)."""
    from torch.nn.attention.flex_attention import create_mask

    settings = SUPPORTS[name]
    q, k, v = (t.float() for t in random_qkv(batch=2, heads=2, length=1024, head_dim=32, seed=3))
    mask = right_padding(2, 1024, real=(1024, 700)) if padded else None
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    ref = hybrid_attention(q, k, v, key_padding_mask=mask, **settings)

    masks = []
    support_mask = hybrid_flex.support_mask
    record = lambda selection, *args: masks.append(support_mask(selection, *args)) or masks[-1]  # noqa: E731
    monkeypatch.setattr(hybrid_flex, "support_mask", record)
    _flex(monkeypatch)
    with torch.no_grad():
        out = hybrid_attention(q, k, v, key_padding_mask=mask, **settings)
    torch.testing.assert_close(_masked(out, mask), _masked(ref, mask), rtol=1e-5, atol=1e-6)
    block_mask = masks[0]
    full = block_mask.full_kv_num_blocks  # (B, H, 8): key tiles read whole per query tile
    tiles = block_mask.kv_num_blocks + full  # key tiles read per query tile
    assert tiles.shape[-1] == 8 and int(tiles.min()) >= 1
    if settings is COARSE:  # at most the window's 3 tiles, the global token's and the routed block's
        assert int(tiles.max()) <= 5
    if settings in (TILED, HALF_TILED):
        assert int(full.min()) >= 1  # the diagonal tile at least
    pairs = create_mask(block_mask.mask_mod, 2, 2, 1024, 1024, device="cpu").view(2, 2, 8, 128, 8, 128)
    for b, h, i in torch.cartesian_prod(*(torch.arange(n) for n in (2, 2, 8))).tolist():
        for j in block_mask.full_kv_indices[b, h, i, : full[b, h, i]].tolist():
            assert bool(pairs[b, h, i, :, j].all()), (name, b, h, i, j)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_the_pytorch_backend(monkeypatch, causal):
    """FlexAttention's own backward runs on CUDA only; here its contract in PyTorch (dense_attend) carries the
    gradient through the backend's merge, log-sum-exps and far-field complement."""
    q, k, v = (t.float() for t in random_qkv(batch=2, heads=2, length=200, head_dim=16, seed=5))
    mask = right_padding(2, 200, real=(200, 150))
    if causal:
        settings = dict(_causal_kwargs("softmax_opt"), local_window=9, num_global_tokens=1)
        settings.update(query_center=torch.zeros(2, 16), key_center=torch.zeros(2, 16))
        projection = draw_projection(32, 16, generator=torch.Generator().manual_seed(2))
    else:
        settings = dict(DEFAULT, routed_blocks=4, route_group_size=4)
        projection = None
    grad = torch.randn(2, 2, 200, 16, generator=torch.Generator().manual_seed(6)) * mask[:, None, :, None]

    def gradients():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        (hybrid_attention(*inputs, projection, key_padding_mask=mask, **settings) * grad).sum().backward()
        return [t.grad for t in inputs]

    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    expected = gradients()
    _flex(monkeypatch, dense_attend)
    for got, want in zip(gradients(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bfloat16_runs_the_attention_in_bfloat16_within_its_tolerance(monkeypatch):
    """A bfloat16 model: the attention calls get bfloat16 tensors (as flash attention does), the far field and the
    merge stay in float32. Against float32, the output's error is that of rounding the inputs to bfloat16 (the PyTorch
    backend's, which computes in float32 from the same inputs; 1.5% here), plus at most 0.2%."""
    q, k, v = (t.float() for t in random_qkv(batch=1, heads=2, length=512, head_dim=32, seed=7))
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    ref = hybrid_attention(q, k, v, **DEFAULT)
    inputs = [t.bfloat16() for t in (q, k, v)]
    error = lambda out: float((out.float() - ref).norm() / ref.norm())  # noqa: E731
    rounding = error(hybrid_attention(*inputs, **DEFAULT))
    dtypes = []

    def recording(q, k, v, block_mask, score_mod=None):
        dtypes.append((q.dtype, k.dtype, v.dtype))
        return dense_attend(q, k, v, block_mask, score_mod)

    _flex(monkeypatch, recording)
    out = hybrid_attention(*inputs, **DEFAULT)
    assert out.dtype == torch.bfloat16 and set(dtypes) == {(torch.bfloat16,) * 3}
    assert error(out) < rounding + 2e-3, (error(out), rounding)


def _call(far_field="poly2", causal=False, dtype=torch.float32, **settings):
    """A prepared call (:class:`.HybridCall`) of tiny inputs, to ask which backend serves it."""
    q, k, v = (t.to(dtype) for t in random_qkv(batch=1, heads=2, length=40, head_dim=8))
    spec = HybridSpec(far_field=far_field, local_window=5, **settings)
    kwargs = dict.fromkeys(("scaling", "key_padding_mask", "far_field_parameter", "far_field_gain"))
    if causal:
        kwargs.update(query_center=torch.zeros(2, 8), key_center=torch.zeros(2, 8), far_field_parameter=-0.05)
    else:
        kwargs.update(query_center=None, key_center=None)
    W = draw_projection(16, 8, generator=torch.Generator().manual_seed(0))
    return favor_hybrid._prepare(q, k, v, W, spec, causal, kwargs)


def test_what_a_mask_mod_reads_passes_through_memory_unchanged():
    """``in_memory`` (the tensors a ``mask_mod`` captures, as a reduction's output: on CUDA inductor otherwise inlined
    a concatenation into the mask, which FlexAttention's template could not render) changes no value: masks of both
    values, positions below zero, in eager and compiled."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 200, generator=generator) > 0.5
    positions = torch.randint(-5, 300, (200,), generator=generator)
    padded = lambda m: hybrid_flex.in_memory(torch.nn.functional.pad(torch.cat([m, ~m], dim=-1), (0, 56)))  # noqa: E731
    for tensor in (mask, positions):
        assert torch.equal(hybrid_flex.in_memory(tensor), tensor)
    want = torch.nn.functional.pad(torch.cat([mask, ~mask], dim=-1), (0, 56))
    assert torch.equal(torch.compile(padded, backend="aot_eager", fullgraph=True)(mask), want)


def test_which_calls_flex_attention_serves_on_cuda(monkeypatch):
    monkeypatch.setattr(hybrid_backends, "flex_available", lambda: True)
    serves = lambda call, causal=False: isinstance(hybrid_backends._cuda_backend(call, causal), FlexBackend)  # noqa: E731
    assert serves(_call("poly2")) and serves(_call("taylor2", dtype=torch.bfloat16))
    assert serves(_call("softmax_opt", causal=True), causal=True)
    assert not serves(_call("softmax_opt"))  # bidirectional random features: their complement needs features
    assert not serves(_call("poly2", dtype=torch.float64))
    assert not serves(_call("poly2", routed_blocks=2, route_block_size=3, query_block_size=6))  # blocks vs tiles
    monkeypatch.setenv("PERFORMER_HF_FLEX", "0")
    assert not serves(_call("poly2"))
    monkeypatch.setattr(hybrid_backends, "flex_available", lambda: False)
    monkeypatch.delenv("PERFORMER_HF_FLEX")
    assert not serves(_call("poly2"))


def test_heads_narrower_than_flex_attention_takes_reach_it_padded_with_zeros(monkeypatch):
    """FlexAttention's CUDA kernels take queries, keys and values of 16 columns or more (narrower ones fail to
    compile, deep in inductor): ``flex_attend`` pads them with zero columns, and its output and log-sum-exp equal the
    dense reference on the unpadded heads."""
    from torch.nn.attention import flex_attention as flex_module

    real, widths = flex_module.flex_attention, []

    def recording(q, k, v, **kwargs):
        widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(flex_module, "flex_attention", recording)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, width, generator=g) for width in (8, 8, 5))
    mask = flex_module.create_block_mask(lambda b, h, i, j: j <= i, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    out, lse = flex_attend(q, k, v, mask)
    want_out, want_lse = dense_attend(q, k, v, mask)
    assert widths == [(16, 16, 16)] and out.shape == want_out.shape
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_compiled_kernels_match_the_cpu_in_float32_and_bfloat16(monkeypatch, causal):
    """On a GPU: forward and backward of the compiled backend at 4K tokens against the float32 CPU path."""
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")  # the reference: the PyTorch backend (no C++ build there)
    monkeypatch.setenv("PERFORMER_HF_TRITON", "0")  # bidirectional calls: FlexAttention, not the Triton support sums
    assert hybrid_flex.flex_available(), "a CUDA device without Triton / FlexAttention's log-sum-exp"
    q, k, v = (t.float() for t in random_qkv(batch=2, heads=4, length=4096, head_dim=32, seed=11))
    if causal:
        settings = dict(_causal_kwargs("softmax_opt"), local_window=64, num_global_tokens=1)
        settings.update(query_center=torch.zeros(4, 32), key_center=torch.zeros(4, 32))
        projection = draw_projection(64, 32, generator=torch.Generator().manual_seed(2))
    else:
        settings, projection = DEFAULT, None
    grad = torch.randn(2, 4, 4096, 32, generator=torch.Generator().manual_seed(12))

    def run(device, dtype, inputs=(q, k, v)):
        inputs = [t.detach().to(device, dtype).requires_grad_() for t in inputs]  # leaves on every device
        W = None if projection is None else projection.to(device)
        out = hybrid_attention(*inputs, W, **settings)
        (out.float() * grad.to(device)).sum().backward()
        return [t.detach().float().cpu() for t in (out, *(i.grad for i in inputs))]

    reference_cpu = run("cpu", torch.float32)
    rounded_cpu = run("cpu", torch.float32, [t.bfloat16().float() for t in (q, k, v)])
    bfloat16 = bfloat16_tolerances(rounded_cpu, reference_cpu, sdpa_bfloat16_errors(q, k, v, grad, causal))
    masks = []
    support_mask = hybrid_flex.support_mask
    monkeypatch.setattr(
        hybrid_flex, "support_mask", lambda selection, *args: masks.append(1) or support_mask(selection, *args)
    )
    for dtype, tolerances in ((torch.float32, [1e-4] * 4), (torch.bfloat16, bfloat16)):
        for got, want, tolerance in zip(run("cuda", dtype), reference_cpu, tolerances, strict=True):
            assert torch.isfinite(got).all()
            assert (got - want).norm() / want.norm() < tolerance, dtype
    assert len(masks) == 2  # the FlexAttention backend served both


MODELS = {
    "encoder": (
        PerformerForMaskedLM,
        dict(DEFAULT, routed_blocks=4, route_group_size=4),
    ),
    "decoder": (
        PerformerForCausalLM,
        dict(far_field="softmax_opt", center=True, local_window=8, num_global_tokens=1, far_field_parameter=-0.05),
    ),
}


@pytest.mark.parametrize("kind", MODELS)
def test_models_on_the_flex_backend_match_their_default_path(monkeypatch, kind):
    """Whole tiny models past their exact dispatch, with padding: the FlexAttention backend (eager, forward) gives the
    logits of the default path; the decoder's prefill state, built beside it, then decodes the same next token."""
    model_class, settings = MODELS[kind]
    names = {"far_field": "attention_kernel", "center": "center_features"}
    fields = {names.get(key, key): value for key, value in settings.items()}
    model = random_centres(
        tiny_model(model_class, attention_method="hybrid", max_position_embeddings=320, exact_max_length=16, **fields)
    )
    ids = random_ids(batch=2, length=300, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0 if kind == "decoder" else 1  # left padding for the decoder (batched generation) ...
    mask[1, 260:] = 1 if kind == "decoder" else 0  # ... right padding for the encoder

    def logits():
        with torch.no_grad():
            if kind == "encoder":
                return model(input_ids=ids, attention_mask=mask).logits, None
            prefill = model(input_ids=ids, attention_mask=mask, use_cache=True)
            step = model(
                input_ids=prefill.logits[:, -1:].argmax(-1),
                attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1),
                **{CACHE_KEYWORD: prefill.past_key_values},
            )
            return prefill.logits, step.logits

    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    expected = logits()
    _flex(monkeypatch)
    for got, want in zip(logits(), expected, strict=True):
        if want is not None:
            real = mask.bool()[..., None] if got.shape[1] == mask.shape[1] else torch.tensor(True)
            torch.testing.assert_close(torch.where(real, got, 0.0), torch.where(real, want, 0.0), rtol=1e-4, atol=1e-5)


def test_calls_whose_tiles_exceed_shared_memory_retry_with_small_ones_once(monkeypatch):
    """Triton's "out of resource" for the default tiles: the call runs with small tiles, and later calls of its kind
    start with them (a failed compilation is not cached: retrying the default tiles would compile again each time);
    other errors are raised."""
    monkeypatch.setattr(hybrid_flex, "_compiled_flex", lambda: "compiled")
    monkeypatch.setattr(hybrid_flex, "_NEEDS_SMALL_TILES", set())
    tried = []

    def attend(function, kernel_options=None):
        tried.append(kernel_options)
        if kernel_options is None:
            raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: Required: 311296")
        return function

    assert hybrid_flex.compiled_call(("a",), attend) == "compiled"
    assert hybrid_flex.compiled_call(("a",), attend) == "compiled"
    assert tried == [None, hybrid_flex._SMALL_TILES, hybrid_flex._SMALL_TILES]

    def broken(function, kernel_options=None):
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        hybrid_flex.compiled_call(("b",), broken)
    assert ("b",) not in hybrid_flex._NEEDS_SMALL_TILES
