"""Sparse attention (``attention_method="sparse"``): each query's output against a one-query-at-a-time reference
(window, global tokens, per-query block selection, the bounded pool), cached decoding against a full forward, no
future leak, a state that stops growing with a budget, gradients, and the settings' checks."""

import dataclasses

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError

import performer_hf.modeling.sparse_attention as sparse_attention_module
import performer_hf.modeling.sparse_backward as sparse_backward
from performer_hf import PerformerConfig
from performer_hf.modeling.cache_performer import held_bytes
from performer_hf.modeling.sparse_attention import sparse_attention
from performer_hf.modeling.sparse_spec import SparseSpec
from tests.sparse_reference import reference_sparse

INVALID = (ValueError, StrictDataclassClassValidationError)

SPECS = {
    "window+globals+select": SparseSpec(local_window=8, num_global_tokens=2, block_size=4, select_blocks=2),
    "bounded pool": SparseSpec(local_window=8, num_global_tokens=2, block_size=4, select_blocks=2, budget=3),
    "own block only": SparseSpec(local_window=0, num_global_tokens=0, block_size=5, select_blocks=1),
    "globals beyond a block": SparseSpec(local_window=12, num_global_tokens=6, block_size=4, select_blocks=3, budget=4),
    "select everything": SparseSpec(local_window=4, num_global_tokens=1, block_size=4, select_blocks=50),
    "window and globals only": SparseSpec(local_window=8, num_global_tokens=2, block_size=4, select_blocks=0),
}


def _inputs(batch=2, heads=4, kv_heads=2, length=70, dim=8, seed=0):
    """Float64 q (B, H, L, D), k, v (B, Hkv, L, D) and a (B, L) mask with row 1 right-padded by 9."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64) * 2
    k = torch.randn(batch, kv_heads, length, dim, generator=g, dtype=torch.float64) * 2
    v = torch.randn(batch, kv_heads, length, dim, generator=g, dtype=torch.float64)
    mask = torch.arange(length)[None] < torch.tensor([[length], [length - 9]])
    return q, k, v, mask


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS)
def test_every_query_matches_the_reference(spec):
    q, k, v, mask = _inputs()
    expected = reference_sparse(q, k, v, spec, mask)
    real = mask[:, None, :, None]
    torch.testing.assert_close(sparse_attention(q, k, v, spec, mask) * real, expected * real)


@pytest.mark.parametrize("ranking", ["latest", "window"])
def test_the_queries_that_read_every_earlier_key_are_exact_attention_in_one_call(monkeypatch, ranking):
    """From the first token, the queries before ``covered_length`` select nothing yet: one exact attention call gives
    theirs, and only the later key blocks are walked (every block with the "window" ranking, which weighs the window's
    attention block by block); the outputs are the reference's either way."""
    spec = SparseSpec(local_window=8, num_global_tokens=2, block_size=4, select_blocks=2, budget=3, ranking=ranking)
    walk = sparse_attention_module._BlockWalk._query_block
    walked = []

    def counted(self, q, q_lo):
        walked.append(q_lo // spec.block_size)
        return walk(self, q, q_lo)

    monkeypatch.setattr(sparse_attention_module._BlockWalk, "_query_block", counted)
    q, k, v, mask = _inputs()  # 70 tokens: key blocks 0 ... 17
    mask[0, :3] = False  # left padding too, in the exact part
    out = sparse_attention(q, k, v, spec, mask)
    first = spec.covered_length // spec.block_size if ranking == "latest" else 0
    assert spec.covered_length == 20 and walked == list(range(first, 18))
    # within one call the "latest" ranking selects among every earlier block (its budget prunes the pool after it)
    within_call = spec if ranking == "window" else dataclasses.replace(spec, budget=0)
    real = mask[:, None, :, None]
    torch.testing.assert_close(out * real, reference_sparse(q, k, v, within_call, mask) * real)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS)
def test_prefill_then_decoding_equals_one_forward(spec):
    """A prefill of 37 tokens, a chunk of 6, then one token at a time: the same outputs as one call."""
    q, k, v, mask = _inputs()
    full = sparse_attention(q, k, v, spec, mask)
    pieces, state = [], None
    for lo, hi in [(0, 37), (37, 43), *((t, t + 1) for t in range(43, 70))]:
        out, state = sparse_attention(
            q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], spec, mask[:, lo:hi], state, return_state=True
        )
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=2), full, rtol=1e-12, atol=1e-12)
    assert state.length == 70


def test_a_key_value_cache_is_read_in_place():
    """Keys and values of earlier tokens given before the new ones (a plain key/value cache, every block kept)."""
    spec = SPECS["window+globals+select"]
    q, k, v, mask = _inputs()
    full = sparse_attention(q, k, v, spec, mask)
    for new in (1, 7):
        out = sparse_attention(q[:, :, -new:], k, v, spec, mask)
        torch.testing.assert_close(out, full[:, :, -new:], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="without a budget"):
        sparse_attention(q[:, :, -1:], k, v, SPECS["bounded pool"], mask)


KEEP_ALL = {name: spec for name, spec in SPECS.items() if not spec.bounded}


@pytest.mark.parametrize("spec", KEEP_ALL.values(), ids=KEEP_ALL)
def test_one_decoding_step_matches_the_reference_and_the_block_walk(spec):
    """A single new query over a left-padded key/value cache (the one-pass decoding step): its output against the
    reference, its gradients against the block-by-block path that two new queries take."""
    q, k, v, _ = _inputs()
    mask = torch.arange(70)[None] >= torch.tensor([[0], [11]])  # row 1 left-padded by 11
    expected = reference_sparse(q, k, v, spec, mask)[:, :, -1:]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    weight = torch.randn_like(expected)
    step = sparse_attention(q[:, :, -1:], k, v, spec, mask)
    torch.testing.assert_close(step, expected)
    walked = sparse_attention(q[:, :, -2:], k, v, spec, mask)[:, :, -1:]
    grads = [torch.autograd.grad((out * weight).sum(), (q, k, v)) for out in (step, walked)]
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", KEEP_ALL.values(), ids=KEEP_ALL)
def test_a_decoding_step_reads_strided_queries(spec):
    """GPT-2's queries are a strided view of its fused projection: the compiled float32 step refused a batch of two
    ("takes a contiguous float32 q") in generate() with select_budget=0."""
    q, k, v, _ = (t.float() for t in _inputs())
    mask = torch.arange(70)[None] >= torch.tensor([[0], [11]])
    fused = torch.cat([q, q], dim=-1)  # (B, H, L, 2D): q is every other block of columns of it
    strided = fused[:, :, -1:, : q.shape[-1]]
    assert not strided.reshape(2, 2, 2, -1).is_contiguous()
    expected = reference_sparse(q.double(), k.double(), v.double(), spec, mask)[:, :, -1:]
    torch.testing.assert_close(sparse_attention(strided, k, v, spec, mask).double(), expected, rtol=1e-5, atol=1e-5)


def test_the_window_ranking_counts_the_attention_of_real_queries_only():
    """A left-padded row's pads see only themselves: each padding block received a block's worth of attention and
    won places in a bounded pool ranked by the window (2 of 3 in this row, |diff| 4.10 to the row alone). Padded by
    whole blocks, without global tokens (which go by position), the row now equals itself alone."""
    spec = SparseSpec(local_window=4, num_global_tokens=0, block_size=4, select_blocks=2, budget=3, ranking="window")
    q, k, v, _ = _inputs(batch=1, heads=2, kv_heads=1, length=80, dim=16)
    pads = 24
    padded = [torch.cat([torch.randn_like(t[:, :, :pads]), t], dim=2) for t in (q, k, v)]
    mask = torch.arange(80 + pads)[None] >= pads
    alone, alone_state = sparse_attention(q, k, v, spec, return_state=True)
    context, state = sparse_attention(*padded, spec, mask, return_state=True)
    torch.testing.assert_close(context[:, :, pads:], alone)
    assert bool(state.pool_mask.any(dim=-1).all()) and torch.equal(state.pool_keys, alone_state.pool_keys)


LATEST = SparseSpec(local_window=8, num_global_tokens=2, block_size=4, select_blocks=2, budget=3, ranking="latest")
LATEST_KEEP_ALL = SparseSpec(local_window=8, num_global_tokens=2, block_size=4, select_blocks=2)


def _kept_blocks(state, k, block):
    """The block indices of k (B, 1, L, D) whose keys the state's pool holds, per batch row."""
    blocks = k[:, 0, : k.shape[2] // block * block].unflatten(1, (-1, block))  # (B, N, block, D)
    pool = state.pool_keys[:, 0]  # (B, U, block, D)
    same = (blocks[:, :, None] == pool[:, None]).all(dim=(-1, -2))  # (B, N, U)
    return [set(same[b].any(dim=1).nonzero().flatten().tolist()) for b in range(k.shape[0])]


def test_latest_ranking_keeps_what_the_last_queries_attend_to_and_decodes_over_it():
    """select_ranking="latest": a prefill computes what keeping every block does; its pool keeps the budget blocks
    that its last block of queries attends to most (softmax over the earlier blocks' keys, summed over queries and
    heads, computed here independently); each decoding step then equals the reference with the dropped blocks'
    keys hidden."""
    q, k, v, _ = _inputs(batch=2, heads=2, kv_heads=1, length=70)
    mask = torch.arange(70)[None] >= torch.tensor([[0], [5]])  # row 1 left-padded by 5
    prompt = 50
    out, state = sparse_attention(
        q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], LATEST, mask[:, :prompt], return_state=True
    )
    torch.testing.assert_close(
        out,
        sparse_attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], LATEST_KEEP_ALL, mask[:, :prompt]),
        rtol=0,
        atol=0,
    )
    # the pool after the prefill: blocks before the next query's window, ranked by the last 4 queries (46 ... 49)
    pool_blocks = prompt // 4 - LATEST.window_blocks  # blocks 0 ... 3 (the next query, 50, is in block 12)
    keys = k[:, 0, : pool_blocks * 4]  # (B, 16, D)
    selectable = mask[:, : pool_blocks * 4] & (torch.arange(pool_blocks * 4) >= 2)
    logits = (q[:, :, prompt - 4 : prompt] @ keys[:, None].transpose(-1, -2)) * 8**-0.5  # (B, H, 4, 16)
    probs = logits.masked_fill(~selectable[:, None, None], float("-inf")).softmax(-1)
    ranked = probs.unflatten(-1, (pool_blocks, 4)).sum(dim=(1, 2, 4)).topk(3).indices
    assert _kept_blocks(state, k, 4) == [set(row.tolist()) for row in ranked]
    for position in range(prompt, 56):  # decoding reads the kept blocks (and the ones that leave the window since)
        hidden = mask.clone()
        for b, kept in enumerate(_kept_blocks(state, k, 4)):
            for block in set(range(pool_blocks)) - kept:
                hidden[b, max(2, block * 4) : block * 4 + 4] = False  # global tokens stay
        pool_blocks = max(pool_blocks, (position // 4 - LATEST.window_blocks))
        expected = reference_sparse(
            q[:, :, : position + 1],
            k[:, :, : position + 1],
            v[:, :, : position + 1],
            LATEST_KEEP_ALL,
            hidden[:, : position + 1],
        )[:, :, -1:]
        step, state = sparse_attention(
            q[:, :, position : position + 1],
            k[:, :, position : position + 1],
            v[:, :, position : position + 1],
            LATEST,
            mask[:, position : position + 1],
            state,
            return_state=True,
        )
        torch.testing.assert_close(step, expected)
        assert state.pool_keys.shape[2] == LATEST.budget


def test_latest_ranking_keeps_a_block_only_the_prompt_end_asks_for():
    """A key block that nothing attends to while it is in the window, and that the prompt's last queries match:
    ranking by the window drops it, ranking by the latest queries keeps it."""
    q, k, v, _ = _inputs(batch=1, heads=2, kv_heads=1, length=64)
    needle = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    k[:, :, 8:12] = needle * 3  # block 2
    q[:, :, 12:24] = -needle * 3  # the queries of its window look away from it
    q[:, :, 60:64] = needle * 3  # the prompt's end asks for it
    by_window = SparseSpec(local_window=8, num_global_tokens=2, block_size=4, select_blocks=2, budget=3)
    kept = {}
    for name, spec in {"window": by_window, "latest": LATEST}.items():
        _, state = sparse_attention(q, k, v, spec, return_state=True)
        kept[name] = _kept_blocks(state, k, 4)[0]
    assert 2 in kept["latest"] and 2 not in kept["window"]


def test_no_future_leak():
    spec = SPECS["bounded pool"]
    q, k, v, _ = _inputs(batch=1)
    out = sparse_attention(q, k, v, spec)
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    k2[:, :, 40:] += 5.0
    v2[:, :, 40:] -= 3.0
    q2[:, :, 40:] *= -1
    torch.testing.assert_close(sparse_attention(q2, k2, v2, spec)[:, :, :40], out[:, :, :40], rtol=0, atol=0)


def test_a_budget_bounds_the_state_and_keeping_every_block_does_not():
    q, k, v, _ = _inputs(batch=1, length=200)
    sizes = {}
    for budget in (0, 3):
        spec = SparseSpec(local_window=8, num_global_tokens=2, block_size=4, select_blocks=2, budget=budget)
        _, short = sparse_attention(q[:, :, :100], k[:, :, :100], v[:, :, :100], spec, return_state=True)
        _, long = sparse_attention(q, k, v, spec, return_state=True)
        sizes[budget] = held_bytes(short), held_bytes(long)
    assert sizes[3][0] == sizes[3][1]
    assert sizes[0][1] > 1.8 * sizes[0][0]
    assert sizes[3][1] < sizes[0][1] / 5
    # no selection: nothing is kept beyond the window and the global tokens
    spec = SPECS["window and globals only"]
    states = [sparse_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], spec, return_state=True)[1] for n in (100, 200)]
    assert held_bytes(states[0]) == held_bytes(states[1]) < sizes[3][1] and states[1].pool_keys.shape[2] == 0


def _gradients(function, spec, q, k, v, mask):
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    (function(*inputs, spec, mask) * mask[:, None, :, None]).pow(2).sum().backward()
    return [t.grad for t in inputs]


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS)
def test_gradients_match_the_reference(spec):
    q, k, v, mask = _inputs(length=46)
    ours, expected = (_gradients(f, spec, q, k, v, mask) for f in (sparse_attention, reference_sparse))
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_gradients_of_a_long_walk_match_the_reference(monkeypatch):
    """From the first token the walked queries' gradients are computed all at once (each candidate block once, with
    every query that chose it, their rows gathered a few blocks at a time; the windows a chunk of query blocks at a
    time): against the reference where blocks are chosen by many queries, over more than one chunk and gathering, with
    a partial last block and a padded row."""
    spec = SparseSpec(local_window=8, num_global_tokens=3, block_size=4, select_blocks=3)
    q, k, v, mask = _inputs(length=150, seed=5)
    monkeypatch.setattr(sparse_backward, "BAND_CHUNK", 7)
    monkeypatch.setattr(sparse_backward, "PAIRS_AT_ONCE", 100)
    walked = []
    walk_gradients = sparse_attention_module.walk_gradients

    def spied(q, *args):
        walked.append(q.shape[2])
        return walk_gradients(q, *args)

    monkeypatch.setattr(sparse_attention_module, "walk_gradients", spied)
    ours, expected = (_gradients(f, spec, q, k, v, mask) for f in (sparse_attention, reference_sparse))
    assert walked == [150 - spec.covered_length]
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_gradients_through_every_candidate_block_equal_those_through_the_chosen_ones(monkeypatch):
    """Off the CPU the backward reads every candidate block (those no query chose hidden) where the CPU reads the
    chosen ones: the same gradients."""
    spec = SPECS["window+globals+select"]
    q, k, v, mask = _inputs(length=90, seed=3)
    monkeypatch.setattr(sparse_attention_module, "GATHERED_SHARE", 1.0)  # the chosen blocks alone, always
    union, gathered = sparse_attention_module._union, []

    def spied(chosen):
        gathered.append(union(chosen))
        return gathered[-1]

    monkeypatch.setattr(sparse_attention_module, "_union", spied)
    through_chosen = _gradients(sparse_attention, spec, q, k, v, mask)
    assert any(blocks is not None for blocks in gathered)  # the chosen blocks alone, somewhere
    monkeypatch.setattr(sparse_attention_module, "_union", lambda chosen: None)
    through_every = _gradients(sparse_attention, spec, q, k, v, mask)
    for got, want in zip(through_every, through_chosen, strict=True):
        torch.testing.assert_close(got, want)


def _saved_bytes(spec, q, k, v) -> int:
    """What a forward with a gradient saves for its backward, beyond views of its inputs (and runs the backward)."""
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = {t.untyped_storage().data_ptr() for t in inputs}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in theirs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sparse_attention(*inputs, spec)
    out.sum().backward()
    assert all(t.grad is not None and bool(t.grad.abs().sum() > 0) for t in inputs)
    return sum(saved.values())


def test_a_gradient_keeps_no_logits():
    """What the call saves for its backward, beyond views of its inputs, is a small share of the (queries x keys)
    logits that attention over every earlier key would keep: the backward recomputes each query's support. A budget
    ranked by the call's last queries saves no more: without a state to return, no pool is built."""
    spec = SparseSpec(local_window=16, num_global_tokens=2, block_size=8, select_blocks=2)
    q, k, v, _ = _inputs(batch=1, length=512)
    saved = _saved_bytes(spec, q, k, v)
    logits = q.shape[1] * q.shape[2] ** 2 / 2 * q.element_size()  # causal (queries x keys), float64
    assert saved < 0.05 * logits
    assert _saved_bytes(dataclasses.replace(spec, budget=4, ranking="latest"), q, k, v) == saved


def test_bfloat16_runs_and_stays_close_to_float32():
    spec = SPECS["select everything"]  # no selection that rounding could tip
    q, k, v, _ = _inputs(batch=1)
    expected = sparse_attention(*(t.float() for t in (q, k, v)), spec)
    out = sparse_attention(*(t.bfloat16() for t in (q, k, v)), spec)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "pytorch"])
def test_float32_with_logits_hundreds_apart_matches_the_reference(monkeypatch, compiled):
    """Logits about 100 apart from head to head (|q . k| / sqrt(d) up to ~400): a head whose largest logit lies in a
    block its group did not choose had every exponential of its support under that logit vanish (0 / 0: NaN, and
    NaN gradients), and a group ranked under one shift lost the blocks of its lower head (another head's blocks
    6.2 apart in a decoding step). Float32, in the compiled kernels and in PyTorch: a whole call, one decoding step
    on a key/value cache, a prefill then decoding with a state, and the gradients, against the float64 reference."""
    if not compiled:
        monkeypatch.setattr(sparse_attention_module, "_cpu_kernels", lambda *tensors: None)
    spec = SPECS["window+globals+select"]
    q, k, v, mask = _inputs()
    q, k, v = (q * 5).float(), (k * 5).float(), v.float()
    expected = reference_sparse(q.double(), k.double(), v.double(), spec, mask).float()
    real = mask[:, None, :, None]
    close = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(sparse_attention(q, k, v, spec, mask) * real, expected * real, **close)
    steps = [sparse_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], spec, mask[:, : t + 1])
             for t in range(40, 61)]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, dim=2) * real[:, :, 40:61], expected[:, :, 40:61] * real[:, :, 40:61])
    contexts, state = [], None
    for lo, hi in [(0, 30), *((t, t + 1) for t in range(30, 61))]:
        part = (t[:, :, lo:hi] for t in (q, k, v))
        context, state = sparse_attention(*part, spec, mask[:, lo:hi], state=state, return_state=True)
        contexts.append(context)
    torch.testing.assert_close(torch.cat(contexts, dim=2) * real[:, :, :61], expected[:, :, :61] * real[:, :, :61])
    ours, theirs = (_gradients(f, spec, q, k, v, mask) for f in (sparse_attention, reference_sparse))
    for got, want in zip(ours, theirs, strict=True):
        scale = want.abs().max()
        torch.testing.assert_close(got / scale, want / scale, **close)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(local_window=10, select_block_size=4), "multiple of select_block_size"),
        (dict(select_blocks=4, select_budget=2), "fewer key blocks"),
        (dict(select_blocks=-1), "select_blocks must be an integer >= 0"),
    ],
)
def test_bad_settings_name_the_fix(settings, message):
    with pytest.raises(INVALID, match=message):
        PerformerConfig(attention_method="sparse", is_decoder=True, **settings)


def test_a_hybrid_config_with_selection_fields_is_refused():
    with pytest.raises(INVALID, match="attention_method='sparse'"):
        PerformerConfig(attention_method="hybrid", attention_kernel="poly2", local_window=8, select_blocks=4)


def test_bidirectional_calls_are_refused():
    from performer_hf import PerformerModel

    config = PerformerConfig(
        attention_method="sparse", hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=37
    )
    with pytest.raises(ValueError, match="causal only"):
        PerformerModel(config)(torch.ones(1, 5, dtype=torch.long))


@pytest.mark.parametrize("spec", [LATEST, SPECS["window+globals+select"]], ids=["latest ranking", "every block"])
def test_growing_in_place_decodes_the_same_and_never_writes_the_callers_tensors(spec):
    """grow_in_place (what the cache layer asks for): the same outputs and states as concatenating, one token at a
    time after a prefill; new keys go into the spare rows of the state's buffer (its storage is reused between
    steps); the caller's tensors, whose slices the prefill's state starts from, are never written; and the state
    never keeps the prompt's keys alive."""
    q, k, v, mask = _inputs(length=150)
    inputs = [t.clone() for t in (q, k, v, mask)]
    prompt = 40
    with torch.no_grad():
        _, grown = sparse_attention(
            q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], spec, mask[:, :prompt], return_state=True
        )
        copied, storages = grown, set()
        callers = {x.untyped_storage().data_ptr() for x in (q, k, v, mask)}
        assert not callers & {t.untyped_storage().data_ptr() for t in grown if torch.is_tensor(t)}
        for t in range(prompt, 150):
            args = [x[:, :, t : t + 1] for x in (q, k, v)]
            out, grown = sparse_attention(*args, spec, mask[:, t : t + 1], grown, return_state=True, grow_in_place=True)
            expected, copied = sparse_attention(*args, spec, mask[:, t : t + 1], copied, return_state=True)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            for ours, theirs in zip(grown, copied, strict=True):
                assert torch.equal(ours, theirs) if torch.is_tensor(ours) else ours == theirs
            storages.add(grown.keys.untyped_storage().data_ptr())
    assert 2 <= len(storages) <= 3  # 110 new rows: a new buffer only when the 64 spare rows are used up
    for before, after in zip(inputs, (q, k, v, mask), strict=True):
        assert torch.equal(before, after)


@pytest.mark.parametrize("spec", [LATEST, SPECS["bounded pool"]], ids=["latest ranking", "window ranking"])
def test_a_sequence_that_starts_with_one_token_decodes_as_one_call(spec):
    """A bounded state's first call holding one token (generate() from a one-token prompt): its keys and values, a
    transposed (B, 1, Hkv, D) projection as models give them, stopped the compiled step ("takes keys and values
    with contiguous rows"). The first output is that key's value (softmax over one key), and decoding on from it
    equals a prefill of the first tokens (float32 on the CPU: the compiled kernels)."""
    q, k, v, mask = (t.float() if t.is_floating_point() else t for t in _inputs(length=30))
    mask = torch.ones_like(mask)
    first = [t[:, :, :1].transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # (B, 1, H, D) memory
    assert first[1].is_contiguous() and first[1].stride(2) != first[1].shape[3]
    out, state = sparse_attention(*first, spec, mask[:, :1], return_state=True)
    torch.testing.assert_close(out, v[:, :, :1].repeat_interleave(2, dim=1), rtol=0, atol=0)
    prefill, steps = 2, []
    for t in range(1, 30):
        step, state = sparse_attention(*(x[:, :, t : t + 1] for x in (q, k, v)), spec, mask[:, t : t + 1], state, True)
        steps.append(step)
    _, reference = sparse_attention(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], spec, return_state=True)
    for t in range(prefill, 30):
        step, reference = sparse_attention(*(x[:, :, t : t + 1] for x in (q, k, v)), spec, None, reference, True)
        torch.testing.assert_close(steps[t - 1], step, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ranking", ["window", "latest"])
def test_a_state_continues_in_the_dtype_its_model_was_cast_to(ranking):
    """A float32 prefill's state continued by the model cast to bfloat16 (as FAVOR+ and the hybrid continue) stopped
    inside torch ("expected scalar type Float but found BFloat16"). The state takes the new tokens' dtype: the steps
    are bfloat16 and stay close to float32 decoding of the same (bfloat16-exact) inputs."""
    spec = SparseSpec(local_window=8, num_global_tokens=2, block_size=4, select_blocks=3, budget=3, ranking=ranking)
    q, k, v = (t.bfloat16().float() for t in _inputs(batch=1, length=60)[:3])  # values bfloat16 holds exactly
    prompt = 40
    with torch.no_grad():
        _, state = sparse_attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], spec, return_state=True)
        expected = state
        for t in range(prompt, 60):
            new = [x[:, :, t : t + 1] for x in (q, k, v)]
            step, state = sparse_attention(*(x.bfloat16() for x in new), spec, None, state, True, grow_in_place=True)
            reference, expected = sparse_attention(*new, spec, None, expected, True)
            assert step.dtype == state.keys.dtype == state.pool_values.dtype == torch.bfloat16
            torch.testing.assert_close(step.float(), reference, rtol=0.05, atol=0.05)


def test_the_window_ranking_gives_a_global_tokens_attention_to_no_block():
    """A left-padded row's global token moves in front of its pads (:func:`.sinks_first`): a block of it and pads
    collected its window attention and took a place of the budget without a key to select, and the block it shares
    with real keys when the row is alone lost that attention (|diff| 0.144 in a Llama's logits). A global token's
    attention is its block's no more: the row padded by whole blocks equals itself alone."""
    spec = SparseSpec(local_window=4, num_global_tokens=1, block_size=4, select_blocks=1, budget=2, ranking="window")
    q, k, v, _ = _inputs(batch=1, heads=2, kv_heads=1, length=80, dim=16)
    sink = torch.randn(16, dtype=q.dtype, generator=torch.Generator().manual_seed(5))
    q, k[:, :, 0] = q + sink, sink * 2  # the global token draws attention, as a sink does
    pads = 8
    # the global token first, then the pads, then the rest of the row
    padded = [torch.cat([t[:, :, :1], torch.randn_like(t[:, :, :pads]), t[:, :, 1:]], dim=2) for t in (q, k, v)]
    mask = torch.arange(80 + pads)[None] > pads
    mask[:, 0] = True
    alone = sparse_attention(q, k, v, spec)
    context = sparse_attention(*padded, spec, mask)
    torch.testing.assert_close(torch.cat([context[:, :, :1], context[:, :, pads + 1 :]], dim=2), alone)
