"""The compiled CPU backend of bidirectional hybrid attention with a polynomial far field (:mod:`.cpu_kernels`).

Three autograd functions wrap the kernels of ``csrc/``, each with a compiled backward:

- the support sums (:func:`fused_sums`): the exact part and the far field's share on the support per query block,
  merged, in one pass without (queries x candidates) temporaries; backward recomputes each block instead of storing
  it;
- the far field's state over all keys and its sums for every query (:data:`COMPILED_POLYNOMIAL`), on polynomial
  features built in registers and never stored.

Each keeps only its (B, H, L, X) inputs for backward, so a training step's memory stays linear in the length.
The PyTorch backend (:mod:`.hybrid_backends`) is what they are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .hybrid_far_field import FarQueries, complement_floor
from .hybrid_keys import pad_keys
from .hybrid_routing import group_bounds, key_blocks, query_blocks, route_scores, route_width
from .slabs import slabs

Tensor = torch.Tensor


def _routes(kernels, selection) -> Tensor:
    """(B, H, N, t) int64: the routed key blocks of each of the N query blocks (as :func:`.route`), -1 for none."""
    x, keys, spec = selection.x, selection.keys, selection.spec
    B, H, L, d = x.shape
    routed, block_k, block_q = spec.routed_blocks, spec.route_block_size, spec.query_block_size
    N = -(-L // block_q)
    if not routed:
        return torch.empty(B, H, N, 0, dtype=torch.int64, device=x.device)
    blocks = key_blocks(pad_keys(keys, 0, -L % block_k), block_k, spec.route_group_size)
    x_p = F.pad(x.detach(), (0, 0, 0, N * block_q - L)).view(B, H, N, block_q, d)
    q_mask = F.pad(keys.mask, (0, N * block_q - L), value=False).view(B, N, block_q)
    routes = []
    for slab in slabs(N, B * H * route_width(blocks, routed), "blocks", x.device):
        queries = query_blocks(x_p[:, :, slab], q_mask[:, slab], slab.start, selection.left, selection.right)
        bounds = group_bounds(queries, blocks, block_k, routed)
        if bounds is None:
            scores, _ = route_scores(queries, blocks, block_k, None)
            routes.append(kernels.top_blocks(scores.contiguous(), min(routed, scores.shape[-1])))
            continue
        groups = kernels.top_blocks(bounds.contiguous(), routed)  # (B, H, n, routed), -1: none
        tensors = [
            queries.means.contiguous(),
            blocks.means.contiguous(),
            blocks.has_keys.contiguous(),
            groups,
            queries.window_lo.flatten(),
            queries.window_hi.flatten(),
        ]
        routes.append(kernels.routed_candidates(tensors, [block_k, blocks.group_size, routed]))
    return torch.cat(routes, dim=2)


def support_inputs(selection, far: FarQueries) -> tuple[list[Tensor], list[int]]:
    """The fused support sums' inputs (the CPU kernels' and :mod:`.hybrid_triton`'s), routes aside: x, rq, q_scale,
    far_sum, key_shift, y, values1, klog, mask, far_floor (see :class:`_SupportSums`), and the geometry ``[left,
    right, nb_global, block_q, block_k]``. ``selection``: a :class:`.Selection`."""
    x, keys, spec = selection.x, selection.keys, selection.spec
    B, H, L, _ = x.shape
    geometry = [selection.left, selection.right, selection.nb_global, spec.query_block_size, spec.route_block_size]
    rq, q_scale, klog = (t.expand(B, H, L, 1).reshape(B, H, L) for t in (far.rq, far.scale, keys.klog))
    far_floor = complement_floor(far.rounding[..., 0])  # (B, H, L)
    tensors = [x, rq, q_scale, far.far_sum, far.key_shift[:, :, 0, 0], keys.y, keys.values1, klog, keys.mask, far_floor]
    return [t.contiguous() for t in tensors], geometry


def fused_sums(kernels, selection, far: FarQueries, quadratic: float) -> Tensor:
    """What the PyTorch backend's support sums compute for bidirectional attention with a polynomial far field,
    in one compiled pass over the query blocks: (B, H, L, dv + 1). ``selection``: a :class:`.Selection`."""
    tensors, geometry = support_inputs(selection, far)
    routes = _routes(kernels, selection).contiguous()
    return _SupportSums.apply(kernels, (geometry, quadratic), *tensors, routes)


class _SupportSums(torch.autograd.Function):
    """The compiled support sums; backward recomputes each query block's logits instead of storing them.
    The per-query shift is a constant for autograd: the output is divided by its own last column later,
    which cancels it.

    tensors: x (B, H, L, d); rq, q_scale (B, H, L); far_sum (B, H, L, dv + 1); key_shift (B, H); y (B, H, L, d);
    values1 (B, H, L, dv + 1); klog (B, H, L); mask (B, L); far_floor (B, H, L), the far mass at or below which
    the far field outside the support is rounding (:func:`.complement_floor`); routes (B, H, N, t)."""

    @staticmethod
    def forward(ctx, kernels, settings, *tensors):
        x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, far_floor, routes = tensors
        y_t = y.transpose(-2, -1).contiguous()
        inputs = [x, rq, q_scale, far_sum, key_shift, y_t, values1, klog, mask, routes, far_floor]
        ctx.save_for_backward(*inputs)
        ctx.kernels, ctx.settings = kernels, settings
        return kernels.hybrid_support_sums(inputs, *settings)  # (B, H, L, dv + 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        d_x, d_rq, d_q_scale, d_far_sum, d_y, d_values1, d_klog = ctx.kernels.hybrid_support_sums_backward(
            grad.contiguous(), list(ctx.saved_tensors), *ctx.settings
        )
        return None, None, d_x, d_rq, d_q_scale, d_far_sum, None, d_y, d_values1, d_klog, None, None, None


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


def compiled_polynomial(kernels):
    """The polynomial far field's (state, apply) pair (as :func:`.quadratic_state`, :func:`.quadratic_apply`), compiled:
    state(w (B, H, S, d), wv1 (B, H, S, dv + 1), c2) -> (B, H, F, dv + 1); apply(u (B, H, L, d), state) ->
    (B, H, L, dv + 1)."""

    def state(w: Tensor, wv1: Tensor, quadratic: float) -> Tensor:
        return _FarState.apply(kernels, w.contiguous(), wv1.contiguous(), quadratic)

    def apply(u: Tensor, far_state: Tensor) -> Tensor:
        return _FarApply.apply(kernels, u.contiguous(), far_state)

    return state, apply
