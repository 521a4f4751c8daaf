"""sparse_attention's reference: one query at a time, its support built from positions with plain Python (blocks
ranked by the log-sum-exp of its logits over their keys), then a dense softmax over it (float64)."""

import torch


def reference_sparse(q, k, v, spec, key_mask=None):
    """q (B, H, L, D), k, v (B, Hkv, L, D) -> (B, H, L, D): each query's support as the spec defines it."""
    B, H, L, D = q.shape
    Hkv, block = k.shape[1], spec.block_size
    G = H // Hkv
    real = torch.ones(B, L, dtype=torch.bool) if key_mask is None else key_mask
    out = torch.zeros(B, H, L, v.shape[-1], dtype=q.dtype)
    mass = torch.zeros(B, Hkv, -(-L // block), dtype=torch.float64)  # attention received while in the window
    for p in range(L):
        own = p // block
        window_start = max(0, own - spec.window_blocks) * block
        pool = list(range(window_start // block))  # blocks that left the window
        for b in range(B):
            for h in range(Hkv):
                blocks = pool
                if spec.budget and len(blocks) > spec.budget:
                    blocks = sorted(blocks, key=lambda j: -float(mass[b, h, j].detach()))[: spec.budget]
                visible = torch.zeros(L, dtype=torch.bool)
                visible[window_start : p + 1] = real[b, window_start : p + 1]
                sinks = min(spec.num_global_tokens, window_start)
                visible[:sinks] = real[b, :sinks]
                scored = []
                for j in blocks:
                    keys = [i for i in range(j * block, (j + 1) * block) if real[b, i] and i >= spec.num_global_tokens]
                    if not keys:
                        continue
                    heads = q[b, h * G : (h + 1) * G, p]  # (G, D): the query heads sharing key/value head h
                    bound = ((heads @ k[b, h, keys].T) * D**-0.5).logsumexp(dim=(0, 1))  # the attention it holds
                    scored.append((float(bound.detach()), j, keys))  # the ranking: no gradient
                scored.sort(key=lambda t: -t[0])
                for _, _, keys in scored[: spec.select_blocks]:
                    visible[keys] = True
                visible[p] = True
                for g in range(G):
                    head = h * G + g
                    logits = (k[b, h] @ q[b, head, p]) * D**-0.5
                    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
                    out[b, head, p] = probs @ v[b, h]
                    if not real[b, p]:  # a pad's attention (to itself) ranks nothing
                        continue
                    window = probs[window_start : p + 1]
                    for offset, prob in enumerate(window):
                        if window_start + offset >= spec.num_global_tokens:  # a global token's is not its block's
                            mass[b, h, (window_start + offset) // block] += prob
    return out
