"""The chunked causal scan of linear attention, shared by FAVOR+ and by hybrid attention's far field.

Query ``i`` reads ``sum_{j <= i} (qf_i . kf_j) [v_j, 1]``. A naive prefix sum stores an ``(m, d + 1)``
state per position (``L x m x d`` memory). Here the ``L`` positions are cut into chunks of ``C``: inside a
chunk the products are exact and masked (``C x C``), across chunks a running ``(m, d + 1)`` state
carries the sum, so memory is linear in ``L`` and no per-position state is stored for backward.

Features with an exponential are kept relative to a running log-scale ``s_j`` (non-decreasing over
positions, so it never looks at later keys): key ``j`` contributes ``exp(s_j - s_i) <= 1`` times its
stored features to query ``i``, and the state carries its own scale.
"""

from __future__ import annotations

import torch

from .compiled_lengths import chunking, needs_padding, padded, spans

Tensor = torch.Tensor

EMPTY_SHIFT = -1e30  # the log-scale of "no key seen yet": finite, so that differences of shifts stay defined
SCAN_GROUP = 16  # chunks whose start states one matrix product gives (its cost: SCAN_GROUP m (d + 1) per chunk)


def causal_scan(
    qf: Tensor,
    kf: Tensor,
    v1: Tensor,
    shifts: Tensor | None,
    chunk_size: int,
    kv: Tensor | None,
    shift: Tensor | None,
    chunks: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked causal sums of feature products.

    Args:
        qf, kf: (B, H, L, m) query and key features; ``kf[j]`` relative to ``exp(shifts[j])``.
        v1: (B, H, L, d1) values (with a ones column for the normaliser).
        shifts: (B, H, L) the keys' non-decreasing log-scales (detached), or None for features without
            an exponential (a plain prefix sum).
        chunk_size: positions per chunk; the tail is padded with zero keys.
        kv, shift: the state before position 0, (B, H, m, d1) relative to ``exp(shift)`` (B, H); None: empty.
        chunks: the chunk count where the caller padded ``L`` to ``chunks * chunk_size`` itself (:func:`.chunking`);
            None: the scan's own.

    Returns:
        The sums (B, H, L, d1), query ``i``'s relative to ``exp(shifts[i])``, and the state after the last
        position: kv (B, H, m, d1) and its shift (B, H).
    """
    B, H, L, m = qf.shape
    d1 = v1.shape[-1]
    kv = qf.new_zeros(B, H, m, d1) if kv is None else kv.to(qf.dtype)
    shift = qf.new_full((B, H), EMPTY_SHIFT) if shift is None else shift.to(qf.dtype)
    C, N = chunking(L, chunk_size) if chunks is None else (chunk_size, chunks)
    if needs_padding(pad := N * C - L):
        qf, kf, v1 = (padded(t, (0, 0, 0, pad)) for t in (qf, kf, v1))
        shifts = None if shifts is None else padded(shifts, (0, pad), mode="replicate")
    qc, kc, vc = qf.view(B, H, N, C, m), kf.view(B, H, N, C, m), v1.view(B, H, N, C, d1)

    # Inside each chunk: exact masked products (autograd does not save the product's output, so it
    # can be masked in place).
    causal_mask = torch.ones(C, C, dtype=torch.bool, device=qf.device).tril()  # (C, C)
    scores = qc @ kc.transpose(-2, -1)  # (B, H, N, C, C)
    if shifts is None:
        scores = scores.masked_fill_(~causal_mask, 0.0)
        chunk_kv = kc.transpose(-2, -1) @ vc  # (B, H, N, m, d1)
        # Exclusive scan over chunks: the state each chunk starts from.
        start_kv = torch.cat([kv.unsqueeze(2), chunk_kv[:, :, :-1]], dim=2).cumsum(dim=2)  # (B, H, N, m, d1)
        out = scores @ vc + qc @ start_kv  # (B, H, N, C, d1)
        return out.reshape(B, H, N * C, d1)[:, :, :L], start_kv[:, :, -1] + chunk_kv[:, :, -1], shift

    # Key j is rescaled to query i's scale by exp(s_j - s_i) <= 1 (a constant for autograd).
    sc = shifts.view(B, H, N, C)
    decay = torch.exp((sc.unsqueeze(-2) - sc.unsqueeze(-1)).masked_fill_(~causal_mask, float("-inf")))
    out = scores.mul_(decay) @ vc  # (B, H, N, C, d1)

    # Per-chunk summaries, relative to the scale at the chunk's last position.
    chunk_shift = sc[..., -1]  # (B, H, N)
    to_chunk_end = torch.exp(sc - chunk_shift.unsqueeze(-1)).unsqueeze(-1)  # (B, H, N, C, 1)
    chunk_kv = kc.transpose(-2, -1) @ (vc * to_chunk_end)  # (B, H, N, m, d1)

    # Exclusive scan over chunks: the state each chunk starts from, and its scale (the scale at the end of the
    # chunk before). A group of SCAN_GROUP chunks at a time, each one (G + 1) x (G + 1) matrix product
    # (scan_weights): a Python loop over the chunks would pin a compiled graph to one length and launch
    # a few kernels per chunk. (split, not indexing: the backward of each slice would write a full-size zero
    # gradient)
    start_shift = torch.cat([shift.unsqueeze(-1), chunk_shift[..., :-1]], dim=-1)  # (B, H, N)
    groups = [stop - begin for begin, stop in spans(N, SCAN_GROUP)]
    starts = []
    for group_kv, group_shift in zip(chunk_kv.split(groups, dim=2), chunk_shift.split(groups, dim=2), strict=True):
        weights = scan_weights(torch.cat([shift.unsqueeze(-1), group_shift], dim=-1))  # (B, H, G + 1, G + 1)
        group_starts, kv = scan_forward(weights, kv, group_kv)  # (B, H, G, m, d1), (B, H, m, d1)
        starts.append(group_starts)
        shift = group_shift[..., -1]
    start_kv = torch.cat(starts, dim=2)  # (B, H, N, m, d1)

    # Across chunks: each query reads its chunk's start state, rescaled to its own scale.
    to_query = torch.exp(start_shift.unsqueeze(-1) - sc).unsqueeze(-1)  # (B, H, N, C, 1)
    out = out + (qc @ start_kv) * to_query
    return out.reshape(B, H, N * C, d1)[:, :, :L], kv, shift


def scan_weights(shifts: Tensor) -> Tensor:
    """The chunk scan of a slab as a (G + 1) x (G + 1) lower-triangular matrix per (batch, head).

    ``shifts`` (B, H, G + 1): p_0 = the shift of the state entering the slab, p_r (r >= 1) = the
    shift at the end of chunk r - 1. Entry [r, c] = exp(p_c - p_r) for c <= r (<= 1: shifts only
    grow), 0 above the diagonal. Column 0 weighs the entering state, column c >= 1 the summary
    of chunk c - 1; row r < G gives the state before chunk r, row G the state after the slab.
    """
    G1 = shifts.shape[-1]
    future = ~torch.ones(G1, G1, dtype=torch.bool, device=shifts.device).tril()
    return (shifts.unsqueeze(-2) - shifts.unsqueeze(-1)).masked_fill_(future, float("-inf")).exp_()


def scan_forward(weights: Tensor, state: Tensor, summaries: Tensor) -> tuple[Tensor, Tensor]:
    """state (B, H, m', d + 1), summaries (B, H, G, m', d + 1) -> (start of each chunk, state after)."""
    B, H, G = summaries.shape[:3]
    flat, state_flat = summaries.view(B, H, G, -1), state.reshape(B, H, 1, -1)
    # (rows by their place from the end, not by G: an index of a compiled graph's dynamic size pins it)
    starts = (weights[:, :, :-1, 1:] @ flat).addcmul_(weights[:, :, :-1, :1], state_flat)
    after = (weights[:, :, -1:, 1:] @ flat).addcmul_(weights[:, :, -1:, :1], state_flat)
    return starts.view(summaries.shape), after.view(state.shape)


def scan_backward(weights: Tensor, start_grads: Tensor, after_grad: Tensor) -> tuple[Tensor, Tensor]:
    """The adjoint of scan_forward: -> (gradients of the summaries, gradient of the entering state)."""
    B, H, G = start_grads.shape[:3]
    flat, after_flat = start_grads.view(B, H, G, -1), after_grad.reshape(B, H, 1, -1)
    summary_grads = (weights[:, :, :-1, 1:].transpose(-2, -1) @ flat).addcmul_(
        weights[:, :, -1, 1:].unsqueeze(-1), after_flat
    )
    state_grad = (weights[:, :, :-1, 0].unsqueeze(-2) @ flat).addcmul_(weights[:, :, -1:, 0:1], after_flat)
    return summary_grads.view(start_grads.shape), state_grad.view(after_grad.shape)
