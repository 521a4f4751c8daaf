"""hybrid_attention's dense O(L^2) reference (dense support mask, explicit kernel matrix) and the inputs and
settings its test modules share."""

import math

import torch

from performer_hf.favor import FAR_FIELDS, FEATURE_MAPS, draw_projection, exact_attention, feature_map, hybrid_attention
from performer_hf.modeling.favor_optimal import optimal_log_features, optimal_parameter, pair_statistic

# the polynomial far fields, kappa(u, w) = 1 + t + c t^2 with t = u . w: their coefficient c
QUADRATIC = {name: far.quadratic for name, far in FAR_FIELDS.items() if far.quadratic is not None}
# exact-attention supports: windows, global tokens and routed blocks, alone and together
CONFIGS = [
    dict(local_window=5),
    dict(local_window=4, num_global_tokens=2),
    dict(num_global_tokens=3),
    dict(local_window=7, num_global_tokens=1, routed_blocks=2, route_block_size=4, query_block_size=8),
    dict(local_window=3, routed_blocks=3, route_block_size=3, query_block_size=5),
    dict(local_window=1, routed_blocks=20, route_block_size=4, query_block_size=4),  # more blocks than qualify
    dict(routed_blocks=2, route_block_size=4, query_block_size=4),  # no window: the own key block a candidate too
    # routing groups: 15 key blocks in 4 groups of 4 (the last partial), 3 kept; 12 blocks in 4 groups of 3, 2 kept
    dict(local_window=3, routed_blocks=3, route_block_size=3, route_group_size=4, query_block_size=5),
    dict(
        local_window=7, num_global_tokens=1, routed_blocks=2, route_block_size=4, route_group_size=3, query_block_size=8
    ),
]


def random_qkv(batch=2, heads=2, length=45, head_dim=8, scale=1.0, seed=0):
    """Float64 queries, keys and values (batch, heads, length, head_dim) from ``seed``, times ``scale``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, head_dim, generator=g, dtype=torch.float64) * scale for _ in range(3)]


def right_padding(batch, length, real=(45, 31)):
    """(batch, length) bool key mask with ``real`` leading real positions per row, the rest padded."""
    return torch.arange(length)[None, :] < torch.tensor(real)[:, None]


def rows_within_one_window(head_dim=16, own_logit=-30.0, seed=0):
    """Float32 q, k, v (2, 2, 40, head_dim) and a key padding mask (2, 40) whose rows keep few real keys, all
    within 3 of each other (row 0: position 17 alone, its own logit ``own_logit``; row 1: positions
    15-18), and the softmax over each row's real keys (2, 2, 40, head_dim), float64, zero at pads: what hybrid
    attention with ``local_window >= 7`` computes there, its far field holding nothing."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 40, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    own_q, own_k = q[0, :, 17], k[0, :, 17]  # (2, d): move the key along the query to the given logit
    logit = (own_q * own_k).sum(-1, keepdim=True) * head_dim**-0.5
    k[0, :, 17] = own_k + (own_logit - logit) * head_dim**0.5 * own_q / own_q.square().sum(-1, keepdim=True)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, 17], mask[1, 15:19] = True, True
    logits = (q @ k.transpose(-2, -1) * head_dim**-0.5).masked_fill(~mask[:, None, None, :], float("-inf"))
    expected = (logits.softmax(-1) @ v) * mask[:, None, :, None]
    return q.float(), k.float(), v.float(), mask, expected


def assert_rows_within_one_window_are_their_softmax(far_field: str, head_dim: int, own_logit: float) -> None:
    """Bidirectional hybrid attention (window 7) on :func:`rows_within_one_window`: each real row's output and the
    gradients of q, k and v are the softmax's over the row's keys (float32 within 1e-5 / 1e-4)."""
    q, k, v, mask, expected = rows_within_one_window(head_dim, own_logit)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    W = draw_projection(32, head_dim, generator=torch.Generator().manual_seed(1))
    real = mask[:, None, :, None]
    out = hybrid_attention(q, k, v, W, far_field=far_field, local_window=7, key_padding_mask=mask) * real
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    logits = (q @ k.transpose(-2, -1) * head_dim**-0.5).masked_fill(~mask[:, None, None, :], float("-inf"))
    softmax = (logits.softmax(-1).nan_to_num(0.0) @ v) * real
    for ours, theirs in zip(grads, torch.autograd.grad(softmax.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-4)


def _routed_support(x, y, mask, block_q, block_k, left, right, nb_routed, group_size):
    """(B, H, L, L) bool: the key blocks each query block routes to, written with plain loops."""
    B, H, L, _ = x.shape
    nb_blocks = math.ceil(L / block_k)
    support = torch.zeros(B, H, L, L, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for qb in range(math.ceil(L / block_q)):
                q_lo, q_hi = qb * block_q, min(L, (qb + 1) * block_q)
                real_q = [i for i in range(q_lo, q_hi) if mask[b, i]]
                mean_q = x[b, h, real_q].mean(0) if real_q else torch.zeros_like(x[b, h, 0])

                # the query block's window span (right < 0: no window, no span)
                span = (qb * block_q - left, qb * block_q + block_q - 1 + right if right >= 0 else -1)

                def overlaps(kb, span=span):  # the key block meets the span
                    return kb * block_k <= span[1] and (kb + 1) * block_k - 1 >= span[0]

                real_keys = {}  # the key blocks with real keys: their positions
                for kb in range(nb_blocks):
                    real_k = [j for j in range(kb * block_k, min(L, (kb + 1) * block_k)) if mask[b, j]]
                    if real_k:
                        real_keys[kb] = real_k
                candidates = range(nb_blocks)
                if group_size and math.ceil(nb_blocks / group_size) > nb_routed:
                    bounds = []  # (upper bound on the group's best block score, its blocks)
                    for g in range(math.ceil(nb_blocks / group_size)):
                        blocks = range(g * group_size, (g + 1) * group_size)
                        members = [y[b, h, real_keys[kb]].mean(0) for kb in blocks if kb in real_keys]
                        if members and not all(overlaps(kb) for kb in blocks):
                            centre = torch.stack(members).mean(0)
                            radius = max((m - centre).norm() for m in members)
                            bounds.append(((mean_q @ centre + mean_q.norm() * radius).item(), list(blocks)))
                    candidates = [kb for _, blocks in sorted(bounds, reverse=True)[:nb_routed] for kb in blocks]
                scored = []
                for kb in candidates:
                    if kb in real_keys and not overlaps(kb):
                        scored.append(((y[b, h, real_keys[kb]] @ mean_q).mean().item(), kb))
                for _, kb in sorted(scored, reverse=True)[:nb_routed]:
                    support[b, h, q_lo:q_hi, kb * block_k : (kb + 1) * block_k] = True
    return support


def dense_support(
    x,
    y,
    mask,
    causal,
    local_window=0,
    num_global_tokens=0,
    routed_blocks=0,
    route_block_size=8,
    route_group_size=0,
    query_block_size=16,
):
    """(B, H, L, L) bool: the keys each query computes exactly (its window, the global tokens, its routed blocks),
    written densely; x, y: scaled queries and keys (routing reads them)."""
    B, H, L, _ = x.shape
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    support = torch.zeros(B, H, L, L, dtype=torch.bool)
    left, right = 0, -1
    if local_window:
        left, right = (
            (local_window - 1, 0) if causal else ((local_window - 1) // 2, local_window - 1 - (local_window - 1) // 2)
        )
        support |= (i - j <= left) & (i - j >= -right)
    support |= j < num_global_tokens
    if routed_blocks:
        support |= _routed_support(
            x, y, mask, query_block_size, route_block_size, left, right, routed_blocks, route_group_size
        )
    return support


def _features(far_field, x, W, parameter):
    """phi(x) of a registered far field, from its feature function: base * exp(log)."""
    base, log = FAR_FIELDS[far_field].features(x, W, parameter)
    return (1.0 if base is None else base) * (1.0 if log is None else log.exp())


def reference(
    q,
    k,
    v,
    W=None,
    *,
    far_field="softmax",
    causal=False,
    mask=None,
    local_window=0,
    num_global_tokens=0,
    routed_blocks=0,
    route_block_size=8,
    route_group_size=0,
    query_block_size=16,
    center=False,
    far_field_parameter=None,
    far_field_gain=None,
    query_center=None,
    key_center=None,
):
    """sum_j w_ij v_j / sum_j w_ij with w_ij = exp(x_i . y_j) on the support, g kappa(x_i, y_j) elsewhere.

    Centres: the means (``center``), fixed ones (``query_center``, ``key_center``: (H, d), scaled units) or none.
    ``far_field_gain`` g: a float or one per head (H,); None: 1."""
    B, H, L, d = q.shape
    x, y = q * d**-0.25, k * d**-0.25
    mask = torch.ones(B, L, dtype=torch.bool) if mask is None else mask
    keep = mask[:, None, :, None].double()
    if center:
        a = (x * keep).sum(2, keepdim=True) / keep.sum(2, keepdim=True)
        c = (y * keep).sum(2, keepdim=True) / keep.sum(2, keepdim=True)
    elif query_center is not None:
        a, c = (centre.double()[None, :, None, :] for centre in (query_center, key_center))  # (1, H, 1, d)
    else:
        a = c = torch.zeros(1, 1, 1, d, dtype=torch.float64)
    u, w = x - a, y - c
    log_weight = x @ c.transpose(-2, -1) + (y @ a.transpose(-2, -1) - (a * c).sum(-1, keepdim=True)).transpose(-2, -1)
    if far_field in QUADRATIC:
        t = u @ w.transpose(-2, -1)
        kernel = 1 + t + QUADRATIC[far_field] * t * t
    elif far_field == "softmax_opt":
        A = far_field_parameter if far_field_parameter is not None else optimal_parameter(pair_statistic(u, w, mask))
        kernel = optimal_log_features(u, W, A).exp() @ optimal_log_features(w, W, A).exp().transpose(-2, -1)
    elif far_field in FEATURE_MAPS:
        kernel = feature_map(u, W, far_field) @ feature_map(w, W, far_field).transpose(-2, -1)
    else:  # any other registered far field, through its own features
        kernel = _features(far_field, u, W, far_field_parameter) @ _features(far_field, w, W, far_field_parameter).mT
    kernel = kernel * log_weight.exp()  # (B, H, L, L): estimates exp(x . y)
    if far_field_gain is not None:
        kernel = kernel * torch.as_tensor(far_field_gain, dtype=kernel.dtype).reshape(-1, 1, 1)  # (H or 1, 1, 1)

    support = dense_support(
        x,
        y,
        mask,
        causal,
        local_window,
        num_global_tokens,
        routed_blocks,
        route_block_size,
        route_group_size,
        query_block_size,
    )
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    visible = mask[:, None, None, :] & ((j <= i) if causal else torch.ones(L, L, dtype=torch.bool))
    weights = torch.where(support, (x @ y.transpose(-2, -1)).exp(), kernel) * visible
    out = (weights @ v) / weights.sum(-1, keepdim=True)
    if num_global_tokens and not causal:
        g = min(num_global_tokens, L)
        out[:, :, :g] = exact_attention(q[:, :, :g], k, v, key_padding_mask=mask)
    return out
