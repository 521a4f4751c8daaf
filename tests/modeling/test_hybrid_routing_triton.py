"""Routing with groups in one Triton kernel (``hybrid_routing_triton``) against routing's PyTorch steps
(``hybrid_routing.route``): on a CPU through Triton's interpreter (``tests/conftest.py``), on CUDA compiled."""

from types import SimpleNamespace

import pytest
import torch

from performer_hf.modeling import hybrid_routing, hybrid_routing_triton
from performer_hf.modeling.favor_hybrid import hybrid_attention

from ..compiled_check import assert_strides_do_not_matter
from ..hybrid_reference import random_qkv, right_padding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (length, head dim, query block, key block, group size, routed blocks, left, right, first query block, padded from)
CASES = {
    "groups of 4, a padded row": (512, 16, 16, 8, 4, 3, 8, 8, 0, 412),
    "fewer qualifying blocks than choices": (256, 16, 16, 8, 2, 6, 8, 8, 0, 40),
    # groups of 2 blocks, some inside a window span, which starts on a block's last key and ends on one's first
    "groups inside the window, its ends on blocks' ends": (512, 16, 16, 8, 2, 4, 9, 9, 0, 412),
    "groups of 5 (the last partial), a later slab, an asymmetric window": (1200, 32, 16, 8, 5, 6, 4, 3, 3, 1100),
    "no window: each query block's own key blocks candidates too": (256, 16, 16, 8, 2, 3, 0, -1, 0, 200),
}


def _route_both(length, d, block_q, block_k, group_size, routed, left, right, first, padded_from, seed=0):
    """Routes of the query blocks from ``first`` on: (the kernel's on DEVICE, PyTorch's on the CPU from the same
    statistics, which query blocks have real queries)."""
    g = torch.Generator().manual_seed(seed)
    B, H = 2, 2
    y, x = (torch.randn(B, H, length, d, generator=g) for _ in range(2))
    mask = torch.ones(B, length, dtype=torch.bool)
    mask[1, padded_from:] = False
    blocks = hybrid_routing.key_blocks(SimpleNamespace(y=y, mask=mask), block_k, group_size)
    N = length // block_q
    xq = x[:, :, : N * block_q].view(B, H, N, block_q, d)[:, :, first:]
    q_mask = mask[:, : N * block_q].view(B, N, block_q)[:, first:]
    want = hybrid_routing.route(xq, q_mask, blocks, first, block_k, left, right, routed)  # (on a CPU: PyTorch)
    queries = hybrid_routing.query_blocks(xq, q_mask, first, left, right)
    stats = (blocks.group_means, blocks.group_radii, blocks.group_has_keys, blocks.means, blocks.has_keys)
    inputs = [t.to(DEVICE) for t in (queries.means, *stats)]
    got = hybrid_routing_triton.route_blocks(*inputs, [first, block_q, block_k, left, right], routed)
    return [t.cpu() for t in got], want, q_mask.any(-1)[:, None, :].expand(B, H, -1)


def _assert_same_routes(got, want, real_queries):
    """The same blocks chosen (in any order) and real for every query block with real queries; a choice that is not
    real names block 0."""
    got_blocks, got_real = got
    assert got_blocks.dtype == torch.int64 and got_real.dtype == torch.bool
    assert (got_blocks[~got_real] == 0).all()
    named = lambda blocks, real: torch.where(real, blocks, -1).sort(-1).values  # noqa: E731
    torch.testing.assert_close(named(*got)[real_queries], named(*want)[real_queries], rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_kernel_routes_as_pytorch(case):
    got, want, real_queries = _route_both(*case)
    _assert_same_routes(got, want, real_queries)
    assert want[1].any()
    if case == CASES["fewer qualifying blocks than choices"]:
        assert not want[1][real_queries].all()  # some choices are not real


def test_the_kernel_bounds_its_groups_in_several_tiles(monkeypatch):
    # 64 groups of 2 blocks, bounded 16 at a time: each tile merged into the best so far
    monkeypatch.setattr(hybrid_routing_triton, "MAX_GROUP_TILE", 16)
    assert hybrid_routing_triton.group_tile(64) == 16
    got, want, real_queries = _route_both(1024, 32, 16, 8, 2, 5, 8, 8, 0, 900)
    _assert_same_routes(got, want, real_queries)


def test_the_operator_takes_rows_of_any_strides():
    """The custom operator gives the same routes for rows that are not contiguous, and its fake implementation (what
    ``torch.compile`` traces) the real outputs' shapes, dtypes and strides."""
    g = torch.Generator().manual_seed(0)
    y, x = (torch.randn(2, 2, 256, 16, generator=g) for _ in range(2))
    mask = torch.ones(2, 256, dtype=torch.bool)
    mask[1, 200:] = False
    blocks = hybrid_routing.key_blocks(SimpleNamespace(y=y, mask=mask), 8, 2)
    queries = hybrid_routing.query_blocks(x.view(2, 2, 16, 16, 16), mask.view(2, 16, 16), 0, 8, 8)
    stats = (blocks.group_means, blocks.group_radii, blocks.group_has_keys, blocks.means, blocks.has_keys)
    args = [t.to(DEVICE) for t in (queries.means, *stats)]
    assert_strides_do_not_matter(torch.ops.performer_hf.route_blocks.default, [*args, [0, 16, 8, 8, 8], 3])


def test_hybrid_attention_through_the_kernel_as_through_pytorch(monkeypatch):
    """Where the kernel serves (made to on a CPU), routing takes it: the same outputs as through PyTorch's steps."""
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")  # on a CPU the PyTorch backend, which reads the routes
    q, k, v = (t.float().to(DEVICE) for t in random_qkv(head_dim=16))
    mask = right_padding(2, 45).to(DEVICE)
    # 15 key blocks of 3 in 4 groups of 4 (the last partial), 3 kept
    config = dict(
        far_field="poly2", local_window=3, routed_blocks=3, route_block_size=3, route_group_size=4, query_block_size=5
    )
    monkeypatch.setattr(hybrid_routing, "kernel_serves", lambda *args: False)
    want = hybrid_attention(q, k, v, key_padding_mask=mask, **config)
    calls, kernel = [], hybrid_routing_triton.route_blocks
    monkeypatch.setattr(hybrid_routing, "kernel_serves", lambda *args: True)
    monkeypatch.setattr(hybrid_routing, "routes_in_kernel", lambda *args: calls.append(args) or kernel(*args))
    got = hybrid_attention(q, k, v, key_padding_mask=mask, **config)
    assert calls
    keep = mask[:, None, :, None]
    torch.testing.assert_close(got * keep, want * keep, rtol=0, atol=1e-6)


@pytest.mark.cuda
def test_cuda_routes_as_pytorch_at_the_defaults(monkeypatch):
    """On a GPU at the converter's defaults (8K tokens, 24 groups of 16 blocks of 8 keys per 16 queries, a window of
    8 each side), through ``route``: the kernel's routes and PyTorch's on the same device. Sums in another order may
    swap two blocks of equal score to float32's rounding: at most 1 query block in 1,000 (PyTorch's products in IEEE
    float32, as by default: TF32's rounding would swap more)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        _cuda_routes_as_pytorch(monkeypatch)
    finally:
        torch.set_float32_matmul_precision(precision)


def _cuda_routes_as_pytorch(monkeypatch):
    g = torch.Generator().manual_seed(0)
    B, H, L, d = 1, 4, 8192, 32
    y, x = (torch.randn(B, H, L, d, generator=g).cuda() for _ in range(2))
    mask = torch.ones(B, L, dtype=torch.bool, device="cuda")
    blocks = hybrid_routing.key_blocks(SimpleNamespace(y=y, mask=mask), 8, 16)
    xq, q_mask = x.view(B, H, L // 16, 16, d), mask.view(B, L // 16, 16)
    assert hybrid_routing._in_kernel(blocks, 24)
    got = hybrid_routing.route(xq, q_mask, blocks, 0, 8, 8, 8, 24)
    monkeypatch.setattr(hybrid_routing, "kernel_serves", lambda *args: False)
    want = hybrid_routing.route(xq, q_mask, blocks, 0, 8, 8, 8, 24)
    assert got[1].all() and want[1].all()
    same = (got[0].sort(-1).values == want[0].sort(-1).values).all(-1)
    assert same.float().mean() >= 0.999, f"{(~same).sum().item()} of {same.numel()} query blocks routed otherwise"
