"""The parts of hybrid attention against dense float64 references, each on its own: the selection (every query's
exact support) and the exact part with the merge. (The whole, far field included, is tested against the dense
reference of tests/hybrid_reference.py in test_favor_hybrid.py and test_cpu_kernels.py.)"""

import pytest
import torch

from performer_hf.favor import HybridSpec
from performer_hf.modeling.favor_hybrid import _prepare
from performer_hf.modeling.hybrid_causal import extra_keys
from performer_hf.modeling.hybrid_exact import CandidateSet, PartialSums, divide, exact_logits, exact_sums, merge
from performer_hf.modeling.hybrid_keys import slice_keys
from performer_hf.modeling.hybrid_selection import ExtraKeys, Selection

from ..hybrid_reference import CONFIGS, dense_support, random_qkv, right_padding

CASES = [(False, config) for config in CONFIGS] + [
    (True, config) for config in CONFIGS if "routed_blocks" not in config
]


@pytest.mark.parametrize("causal,config", CASES, ids=[f"causal{c}-{i}" for i, (c, _) in enumerate(CASES)])
@pytest.mark.parametrize("padded", [False, True])
def test_the_selection_is_each_querys_exact_support_once(causal, config, padded, monkeypatch):
    # values = the identity: a candidate set's support times its values counts, per query, how often each key is in
    # its exact support. Every key of the dense reference's support exactly once, no other; one slab or many.
    import performer_hf.modeling.slabs as slabs_module

    q, k, _ = random_qkv()
    B, H, L, _ = q.shape
    v = torch.eye(L, dtype=torch.float64).expand(B, H, L, L)  # key j's value: the one-hot of j
    mask = right_padding(B, L) if padded else torch.ones(B, L, dtype=torch.bool)
    spec = HybridSpec(far_field="poly2", **config)
    options = {
        "scaling": None,
        "key_padding_mask": mask,
        "query_center": None,
        "key_center": None,
        "far_field_parameter": None,
        "far_field_gain": None,
    }
    call = _prepare(q, k, v, None, spec, causal, options)
    if causal:
        extra = extra_keys(call, None)
    else:
        globals_ = slice_keys(call.keys, 0, min(spec.num_global_tokens, L)) if spec.num_global_tokens else None
        extra = ExtraKeys(None, globals_)
    expected = dense_support(call.x, call.keys.y, mask, causal, **config) & mask[:, None, None, :]
    expected = expected & torch.ones(L, L, dtype=torch.bool).tril() if causal else expected
    real_queries = mask[:, None, :, None]
    for slab_elements in (1, 1 << 24):
        monkeypatch.setitem(slabs_module.SLAB_ELEMENTS["cpu"], "blocks", slab_elements)
        selection = Selection(call.x, call.keys, extra, spec, causal, 0, with_feats=False)
        counts = [sum(s.support.double() @ s.keys[1][..., :-1] for s in sets) for sets in selection.candidate_sets()]
        counts = selection.blocking.unblocked(counts)  # (B, H, L, L)
        torch.testing.assert_close(counts * real_queries, (expected * real_queries).double(), rtol=0, atol=0)


def test_the_exact_part_and_the_merge_are_one_softmax_over_the_parts():
    # two candidate sets and a far part with its own shift: the merged, divided sums are the softmax-weighted
    # average over the union, the far part's mass included; and the gradients agree with the dense formula
    g = torch.Generator().manual_seed(0)
    B, H, n, bq, d, dv, C = 2, 3, 2, 4, 5, 6, 7

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    xq, values = rand(B, H, n, bq, d, scale=2.0), rand(B, H, n, 2 * C, dv)
    y = rand(B, H, n, 2 * C, d, scale=2.0)
    support = torch.rand(B, H, n, bq, 2 * C, generator=g) < 0.5
    support[..., 0] = True  # no empty support
    values1 = torch.cat([values, torch.ones_like(values[..., :1])], dim=-1)
    sets = [
        CandidateSet([y[..., :C, :], values1[..., :C, :]], support[..., :C]),
        CandidateSet([y[..., C:, :], values1[..., C:, :]], support[..., C:]),
    ]
    far_sums, far_shift = rand(B, H, n, bq, dv + 1).abs(), torch.full((B, H, n, bq, 1), 30.0, dtype=torch.float64)
    out = divide(merge(exact_sums(exact_logits(xq, sets), sets), PartialSums(far_sums, far_shift)))

    logits = (xq @ y.transpose(-2, -1)).masked_fill(~support, float("-inf"))  # (B, H, n, bq, 2C)
    weights = torch.exp(logits)
    numerator = weights @ values + far_sums[..., :-1] * torch.exp(far_shift)
    expected = numerator / (weights.sum(-1, keepdim=True) + far_sums[..., -1:] * torch.exp(far_shift))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    probe = torch.randn(out.shape, generator=g, dtype=torch.float64)
    inputs = (xq, values, y, far_sums)
    fast = torch.autograd.grad((out * probe).sum(), inputs)
    dense = torch.autograd.grad((expected * probe).sum(), inputs)
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
