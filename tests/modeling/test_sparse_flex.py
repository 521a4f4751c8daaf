"""Causal sparse attention's FlexAttention prefill (CUDA's) on the CPU: FlexAttention's eager forward against the
block walk, context and state; gradients through FlexAttention's contract in PyTorch (``tests/flex_reference.py``);
which calls it serves. The last test runs on a CUDA device only: the compiled kernels, forward and backward."""

import types
import warnings

import pytest
import torch

from performer_hf.modeling import sparse_attention, sparse_flex
from performer_hf.modeling.sparse_spec import SparseSpec

from ..flex_reference import bfloat16_tolerances, dense_attend, sdpa_bfloat16_errors

SPECS = {
    "budget, latest": SparseSpec(
        local_window=64, num_global_tokens=4, block_size=16, select_blocks=3, budget=5, ranking="latest"
    ),
    "every block kept": SparseSpec(local_window=64, num_global_tokens=2, block_size=16, select_blocks=4, budget=0),
    "no selection": SparseSpec(local_window=32, num_global_tokens=1, block_size=32, select_blocks=0, budget=0),
    "more blocks selected than there are": SparseSpec(local_window=16, block_size=16, select_blocks=40, budget=0),
}


@pytest.fixture(autouse=True)
def quiet_eager_flex():
    """FlexAttention warns at each eager (unfused) call, which is how it runs on a CPU."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        yield


def _inputs(length=500, heads=6, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, length, dim, generator=g)
    k, v = (torch.randn(2, kv_heads, length, dim, generator=g) for _ in range(2))
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :37] = False  # left padding, as batched generation feeds a causal model
    return q, k, v, mask


def _real(t, mask):
    return torch.where(mask[:, None, :, None], t, 0.0)  # padded queries' outputs are unspecified


@pytest.mark.parametrize("name", SPECS)
def test_the_prefill_gives_the_block_walks_context_and_state(monkeypatch, name):
    spec = SPECS[name]
    q, k, v, mask = _inputs()
    with torch.no_grad():
        expected, expected_state = sparse_attention.sparse_attention(q, k, v, spec, mask, return_state=True)
        monkeypatch.setattr(sparse_attention, "flex_prefill_serves", lambda q, spec: True)
        got, state = sparse_attention.sparse_attention(q, k, v, spec, mask, return_state=True)
    torch.testing.assert_close(_real(got, mask), _real(expected, mask), rtol=1e-5, atol=1e-5)
    for field, value in expected_state._asdict().items():
        assert torch.equal(getattr(state, field), value) if torch.is_tensor(value) else getattr(state, field) == value


def test_gradients_match_the_block_walk(monkeypatch):
    """FlexAttention's own backward runs on CUDA only; here its contract in PyTorch carries the gradients."""
    spec = SPECS["budget, latest"]
    q, k, v, mask = _inputs(length=300, seed=1)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)) * mask[:, None, :, None]

    def gradients():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        (sparse_attention.sparse_attention(*inputs, spec, mask) * grad).sum().backward()
        return [t.grad for t in inputs]

    expected = gradients()
    monkeypatch.setattr(sparse_attention, "flex_prefill_serves", lambda q, spec: True)
    monkeypatch.setattr(sparse_flex, "flex_attend", dense_attend)
    for got, want in zip(gradients(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_block_mask_reads_a_part_of_the_tiles(monkeypatch):
    """2,048 tokens, 16 x 16 tiles: the window, the global tokens and 4 selected blocks of 64 reach few of them."""
    spec = SparseSpec(local_window=128, num_global_tokens=4, block_size=64, select_blocks=4, budget=0)
    q, k, v, mask = _inputs(length=2048, heads=4, kv_heads=2, dim=16, seed=3)
    masks = []
    real_attend = sparse_flex.flex_attend
    monkeypatch.setattr(sparse_flex, "flex_attend", lambda *a: masks.append(a[3]) or real_attend(*a))
    monkeypatch.setattr(sparse_attention, "flex_prefill_serves", lambda q, spec: True)
    with torch.no_grad():
        got = sparse_attention.sparse_attention(q, k, v, spec, mask)
    monkeypatch.undo()
    with torch.no_grad():
        expected = sparse_attention.sparse_attention(q, k, v, spec, mask)
    torch.testing.assert_close(_real(got, mask), _real(expected, mask), rtol=1e-5, atol=1e-5)
    tiles = masks[0].kv_num_blocks  # (B, H, 16)
    assert int(tiles.min()) >= 1 and float(tiles.float().mean()) < 16 * 0.75


def test_keeping_every_candidate_block_as_on_a_gpu_gives_the_same_context_and_decoding(monkeypatch):
    """On a GPU the walk keeps every candidate block (their weights zero where no query chose them) rather than read
    the chosen blocks' count on the host, once per layer and token: the context and the next decoding step agree."""
    spec = SPECS["budget, latest"]
    q, k, v, mask = _inputs(length=400, seed=6)
    step = [t[:, :, -1:] * 0.5 for t in (q, k, v)]

    def prefill_and_step():
        with torch.no_grad():
            context, state = sparse_attention.sparse_attention(q, k, v, spec, mask, return_state=True)
            decoded = sparse_attention.sparse_attention(*step, spec, None, state, return_state=False)
        return context, decoded

    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")  # the walk's PyTorch decoding step, not the compiled one
    monkeypatch.setattr(sparse_attention, "GATHERED_SHARE", 1.0)  # on the CPU: the chosen blocks alone, always
    expected = prefill_and_step()
    monkeypatch.setattr(sparse_attention, "_union", lambda chosen: None)  # every block kept, as off the CPU
    for got, want in zip(prefill_and_step(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_which_calls_it_serves(monkeypatch):
    monkeypatch.setattr(sparse_flex, "flex_available", lambda: True)
    on = lambda device="cuda", dtype=torch.bfloat16: types.SimpleNamespace(  # noqa: E731
        device=torch.device(device), dtype=dtype
    )
    spec = SPECS["budget, latest"]
    assert sparse_flex.flex_prefill_serves(on(), spec)
    assert sparse_flex.flex_prefill_serves(on(dtype=torch.float32), spec)
    assert not sparse_flex.flex_prefill_serves(on("cpu"), spec)
    assert not sparse_flex.flex_prefill_serves(on(dtype=torch.float64), spec)
    assert not sparse_flex.flex_prefill_serves(on(), SparseSpec(local_window=48, block_size=48, select_blocks=2))
    window_ranked = SparseSpec(local_window=64, block_size=16, select_blocks=3, budget=5, ranking="window")
    assert not sparse_flex.flex_prefill_serves(on(), window_ranked)  # its pool ranks by the walk's window mass
    monkeypatch.setenv("PERFORMER_HF_FLEX", "0")
    assert not sparse_flex.flex_prefill_serves(on(), spec)


@pytest.mark.cuda
def test_cuda_compiled_prefill_matches_the_cpu_walk(monkeypatch):
    """On a GPU: the compiled prefill at 4K tokens, forward and backward, against the float32 walk on the CPU."""
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    spec = SparseSpec(
        local_window=512, num_global_tokens=4, block_size=64, select_blocks=8, budget=16, ranking="latest"
    )
    q, k, v, mask = _inputs(length=4096, heads=9, kv_heads=3, dim=64, seed=4)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)) * mask[:, None, :, None]

    def run(device, dtype, inputs=(q, k, v)):
        inputs = [t.detach().to(device, dtype).requires_grad_() for t in inputs]  # leaves on every device
        out = sparse_attention.sparse_attention(*inputs, spec, mask.to(device))
        (out.float() * grad.to(device)).sum().backward()
        outputs = [t.detach().float().cpu() for t in (out, *(i.grad for i in inputs))]
        return [_real(t, mask) if t.shape == q.shape else t for t in outputs]  # the context and dq: real queries only

    reference = run("cpu", torch.float32)
    rounded = run("cpu", torch.float32, [t.bfloat16().float() for t in (q, k, v)])
    bfloat16 = bfloat16_tolerances(rounded, reference, sdpa_bfloat16_errors(q, k, v, grad, True))
    served = []
    prefill = sparse_attention.flex_prefill
    monkeypatch.setattr(sparse_attention, "flex_prefill", lambda *args: served.append(1) or prefill(*args))
    for dtype, tolerances in ((torch.float32, [1e-4] * 4), (torch.bfloat16, bfloat16)):
        for got, want, tolerance in zip(run("cuda", dtype), reference, tolerances, strict=True):
            assert torch.isfinite(got).all()
            assert (got - want).norm() / want.norm() < tolerance, dtype
    assert len(served) == 2  # the FlexAttention prefill served both
