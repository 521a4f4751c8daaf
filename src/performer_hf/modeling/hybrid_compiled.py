"""The compiled CPU path of bidirectional hybrid attention with a polynomial far field (:mod:`.cpu_kernels`).

Three autograd functions wrap the kernels of ``csrc/hybrid_support.cpp``, each with a compiled backward:

- the support sums (:func:`fused_sums`): exact logits, kernel values and value sums per query block, in one
  pass without (queries x candidates) temporaries; backward recomputes each block instead of storing it;
- the far field's state over all keys and its sums for every query (:func:`compiled_far_state`,
  :func:`compiled_far_apply`), on polynomial features built in registers and never stored.

Each keeps only its (B, H, L, X) inputs for backward, so a training step's memory stays linear in the length.
:mod:`.favor_hybrid` is the PyTorch implementation they are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .cpu_kernels import hybrid_kernels
from .hybrid_keys import (
    Keys,
    group_bounds,
    key_blocks,
    pad_keys,
    query_blocks,
    route_scores,
    route_width,
    window_offsets,
)
from .slabs import slabs

Tensor = torch.Tensor


def support_kernels(q: Tensor, k: Tensor, v: Tensor):
    """The compiled kernels when they apply (CPU tensors, values narrow enough, not traced), else ``None``."""
    if any(t.device.type != "cpu" for t in (q, k, v)):
        return None
    if torch.compiler.is_compiling():  # torch.export / torch.compile trace the PyTorch path; kernels are opaque
        return None
    kernels = hybrid_kernels()
    if kernels is None or v.shape[-1] + 1 > kernels.max_value_width or q.shape[2] >= 1 << 24:
        return None  # wide values / positions beyond float32's exact integers: the PyTorch path
    return kernels


def _routes(kernels, x: Tensor, keys: Keys, spec) -> Tensor:
    """(B, H, N, t) int64: the routed key blocks of each of the N query blocks (as :func:`.route`), -1 for none."""
    B, H, L, d = x.shape
    left, right = window_offsets(spec.local_window, causal=False)
    routed, block_k, block_q = spec.routed_blocks, spec.route_block_size, spec.query_block_size
    N = -(-L // block_q)
    if not routed:
        return torch.empty(B, H, N, 0, dtype=torch.int64, device=x.device)
    blocks = key_blocks(pad_keys(keys, 0, -L % block_k), block_k, spec.route_group_size)
    x_p = F.pad(x.detach(), (0, 0, 0, N * block_q - L)).view(B, H, N, block_q, d)
    q_mask = F.pad(keys.mask, (0, N * block_q - L), value=False).view(B, N, block_q)
    routes = []
    for slab in slabs(N, B * H * route_width(blocks, routed), "blocks", x.device):
        queries = query_blocks(x_p[:, :, slab], q_mask[:, slab], slab.start, left, right)
        bounds = group_bounds(queries, blocks, block_k, routed)
        if bounds is None:
            scores, _ = route_scores(queries, blocks, block_k, None)
            routes.append(kernels.top_blocks(scores.contiguous(), min(routed, scores.shape[-1])))
        else:
            groups = kernels.top_blocks(bounds.contiguous(), routed)  # (B, H, n, routed), -1: none
            routes.append(kernels.routed_candidates(
                queries.means.contiguous(), blocks.means.contiguous(), blocks.has_keys.contiguous(), groups,
                queries.window_lo.flatten(), queries.window_hi.flatten(), block_k, blocks.group_size, routed,
            ))  # fmt: skip
    return torch.cat(routes, dim=2)


def fused_sums(kernels, x: Tensor, far_side, keys: Keys, spec) -> Tensor:
    """What ``favor_hybrid._hybrid_sums`` computes for bidirectional attention with a polynomial far field, in
    one compiled pass over the query blocks: (B, H, L, dv + 1). ``far_side``: a ``favor_hybrid._BidirectionalFar``;
    ``spec``: a ``HybridSpec`` (not imported here: the remote-code bundle's imports stay acyclic)."""
    B, H, L, _ = x.shape
    _, q_scale, _, far_sum = far_side.query_side()  # (B, H, L, 1), (B, H, L, dv + 1)
    left, right = window_offsets(spec.local_window, causal=False)
    nb_global, block_q, block_k = min(spec.num_global_tokens, L), spec.query_block_size, spec.route_block_size
    routes = _routes(kernels, x, keys, spec)
    settings = (left, right, nb_global, block_q, block_k, far_side.quadratic)
    return _SupportSums.apply(
        kernels, settings, x.contiguous(), q_scale.reshape(B, H, L).contiguous(), far_sum.contiguous(),
        far_side.shift.reshape(B, H).contiguous(), keys.y.contiguous(), keys.values1.contiguous(),
        keys.klog.reshape(B, H, L).contiguous(), keys.mask.contiguous(), routes.contiguous(),
    )  # fmt: skip


class _SupportSums(torch.autograd.Function):
    """The compiled support sums; backward recomputes each query block's logits instead of storing them.
    The per-query shift is a constant for autograd: the output is divided by its own last column later,
    which cancels it."""

    @staticmethod
    def forward(ctx, kernels, settings, x, q_scale, far_sum, key_shift, y, values1, klog, mask, routes):
        inputs = (x, q_scale, far_sum, key_shift, y.transpose(-2, -1).contiguous(), values1, klog, mask, routes)
        ctx.save_for_backward(*inputs)
        ctx.kernels, ctx.settings = kernels, settings
        return kernels.hybrid_support_sums(*inputs, *settings)  # (B, H, L, dv + 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        d_x, d_q_scale, d_far_sum, d_y, d_values1, d_klog = ctx.kernels.hybrid_support_sums_backward(
            grad.contiguous(), *ctx.saved_tensors, *ctx.settings
        )
        return None, None, d_x, d_q_scale, d_far_sum, None, d_y, d_values1, d_klog, None, None


class _FarState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernels, w, wv1, quadratic):
        ctx.save_for_backward(w, wv1)
        ctx.kernels, ctx.quadratic = kernels, quadratic
        return kernels.quadratic_far_state(w, wv1, quadratic)  # (B, H, F, dv + 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_state):
        d_w, d_wv1 = ctx.kernels.quadratic_far_state_backward(*ctx.saved_tensors, d_state.contiguous(), ctx.quadratic)
        return None, d_w, d_wv1, None


class _FarApply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernels, u, state):
        ctx.save_for_backward(u, state)
        ctx.kernels = kernels
        return kernels.quadratic_far_apply(u, state)  # (B, H, L, dv + 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_sums):
        d_u, d_state = ctx.kernels.quadratic_far_apply_backward(*ctx.saved_tensors, d_sums.contiguous())
        return None, d_u, d_state


def compiled_far_state(kernels, w: Tensor, wv1: Tensor, quadratic: float) -> Tensor:
    """The polynomial far field's state over all keys, :func:`.quadratic_state` as one (B, H, F, dv + 1) tensor:
    w (B, H, S, d) centred keys, wv1 (B, H, S, dv + 1) their weighted values; both contiguous."""
    return _FarState.apply(kernels, w, wv1, quadratic)


def compiled_far_apply(kernels, u: Tensor, state: Tensor) -> Tensor:
    """u (B, H, L, d) centred queries (contiguous) -> (B, H, L, dv + 1) far sums from :func:`compiled_far_state`."""
    return _FarApply.apply(kernels, u, state)
