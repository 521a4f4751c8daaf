"""Routing with groups (:func:`.hybrid_routing.route`) in one Triton kernel, for CUDA devices.

In PyTorch each step of routing is a kernel whose result goes to memory: the groups' bounds (B, H, n, Ng), their
top-k, the candidates' scores (every block's, (B, H, n, Nk), or their gathered means), masks, the blocks' top-k. On
an H200 at 32K tokens (12 heads, 24 groups of 16 blocks of 8 keys per 16 queries; run 6's profile), the two top-k took
0.84 ms of each call's forward and the candidates' scores 1.0 ms: 1.8 of some 5 ms. PyTorch's ``topk`` reads its 24.5K
rows of 256 and 384 scores at a few percent of the memory's bandwidth.

Here a program takes :data:`QUERY_BLOCKS` query blocks of one head and routes them in registers: the groups' bounds
a tile of :data:`GROUP_TILE` groups at a time (one product each), merged into the best ``t`` so far; then the scores
of the chosen groups' blocks, their means gathered by the program (a head's block means, 512 KB at 32K, stay in the
GPU's L2 cache), and the best ``t`` of those. Only the choices go to memory. A choice is the largest score left, taken
``t`` times (``t`` is a few dozen): no sort.

The scores and choices are PyTorch's, in IEEE float32 (no TF32: a bound off by TF32's rounding could trade one group
for another), the same but for ties, where PyTorch's ``topk`` takes any of the equal scores and this kernel the first.
A candidate that does not qualify (its block overlaps the query block's window span, or holds no real key) scores
:data:`UNREAL`: chosen only where fewer than ``t`` qualify, as a choice that is not real (block 0), as PyTorch's
``-inf`` scores are. Tested on the CPU through Triton's interpreter against :func:`.hybrid_routing.route`'s PyTorch
steps; :func:`serves` says where it runs.
"""

from __future__ import annotations

import torch

from .far_field_triton import contiguous_rows, tiles_serve, tl, triton

Tensor = torch.Tensor
QUERY_BLOCKS = 16  # query blocks per program: the rows of its products
MAX_GROUP_TILE = 256  # groups bounded per step of a program: all of them up to 32K tokens (8 keys x 16 blocks)
UNREAL = -3.0e38  # the score of a candidate that does not qualify (finite: below every real score, above -inf)
# the largest (padded choices) x (padded group size): a program holds QUERY_BLOCKS times as many scores in registers
MAX_CANDIDATES = 512
WARPS = 8

if triton is not None:  # defined at import, when Triton reads TRITON_INTERPRET (its interpreter: the tests on a CPU)
    _UNREAL = tl.constexpr(UNREAL)  # (a kernel reads only constexpr globals)

    @triton.jit
    def _merge_best(best, best_ids, scores, first, T: tl.constexpr, TP: tl.constexpr, W: tl.constexpr):
        # The T largest of each row of the best so far (QB, TP) (ids best_ids) and of scores (QB, W) (ids first +
        # column): (values, ids), each (QB, TP), slots from T on -inf. A value taken is set to -inf in its tensor.
        slots, cols = tl.arange(0, TP), tl.arange(0, W)
        merged = tl.full(best.shape, float("-inf"), tl.float32)
        merged_ids = tl.zeros(best_ids.shape, tl.int32)
        for s in range(T):
            kept, kept_at = tl.max(best, axis=1, return_indices=True)
            new, new_at = tl.max(scores, axis=1, return_indices=True)
            old = kept >= new
            kept_id = tl.sum(tl.where(slots[None, :] == kept_at[:, None], best_ids, 0), axis=1)
            here = slots[None, :] == s
            merged = tl.where(here, tl.where(old, kept, new)[:, None], merged)
            merged_ids = tl.where(here, tl.where(old, kept_id, first + new_at)[:, None], merged_ids)
            best = tl.where((slots[None, :] == kept_at[:, None]) & old[:, None], float("-inf"), best)
            scores = tl.where((cols[None, :] == new_at[:, None]) & ~old[:, None], float("-inf"), scores)
        return merged, merged_ids

    @triton.jit
    def _best_groups(
        QMEANS, GMEANS, GRADII, GKEYS, bh, b, query_rows, live, q_norm, lo, hi, Ng, group_size, block_k,
        D: tl.constexpr, DC: tl.constexpr, QB: tl.constexpr, GT: tl.constexpr, T: tl.constexpr, TP: tl.constexpr,
    ):  # fmt: skip
        # The T groups of the best bounds q . c + |q| r for each query block (QB,), (QB, TP) ids (slots from T on 0);
        # groups whose every block overlaps the query block's window span (lo to hi), or without keys, do not qualify
        best = tl.full((QB, TP), float("-inf"), tl.float32)
        best_ids = tl.zeros((QB, TP), tl.int32)
        for first in range(0, Ng, GT):
            groups = first + tl.arange(0, GT)
            exists = groups < Ng
            rows = (bh * Ng + groups).to(tl.int64)
            bound = tl.zeros((QB, GT), tl.float32)
            for c in tl.static_range(0, D, DC):  # the products a slice of the dimensions at a time
                dims = c + tl.arange(0, DC)
                q = tl.load(QMEANS + query_rows[:, None] * D + dims[None, :], mask=live[:, None], other=0.0)
                centres = tl.load(GMEANS + rows[:, None] * D + dims[None, :], mask=exists[:, None], other=0.0)
                bound += tl.dot(q, tl.trans(centres), input_precision="ieee")  # (QB, GT)
            radii = tl.load(GRADII + rows, mask=exists, other=0.0)
            has_keys = tl.load(GKEYS + b * Ng + groups, mask=exists, other=0) != 0
            bound += q_norm[:, None] * radii[None, :]
            start = groups * group_size * block_k  # each group's first key
            inside = (start + block_k - 1 >= lo[:, None]) & (start + (group_size - 1) * block_k <= hi[:, None])
            bound = tl.where(inside | ~has_keys[None, :], _UNREAL, bound)
            bound = tl.where(exists[None, :], bound, float("-inf"))
            best, best_ids = _merge_best(best, best_ids, bound, first, T, TP, GT)
        return best_ids

    @triton.jit
    def _candidate_scores(
        QMEANS, BMEANS, BKEYS, bh, b, rows, live, n, groups, lo, hi, Nk, group_size, block_k,
        D: tl.constexpr, DC: tl.constexpr, QB: tl.constexpr, T: tl.constexpr, TP: tl.constexpr, GP: tl.constexpr,
    ):  # fmt: skip
        # The scores (QB, TP, GP) of the blocks of each query block's groups (QB, TP): slot s, column w is block
        # groups[s] * group_size + w; -inf past T groups or the group size, UNREAL where a block does not qualify
        slots, within = tl.arange(0, TP), tl.arange(0, GP)
        scores = tl.full((QB, TP, GP), float("-inf"), tl.float32)
        query_rows = (bh * n + rows).to(tl.int64)
        for s in range(T):
            group = tl.sum(tl.where(slots[None, :] == s, groups, 0), axis=1)  # (QB,)
            blocks = group[:, None] * group_size + within[None, :]  # (QB, GP)
            exists = (within < group_size)[None, :] & (blocks < Nk)
            block_rows = (bh * Nk + blocks).to(tl.int64)
            score = tl.zeros((QB, GP), tl.float32)
            for c in tl.static_range(0, D, DC):  # the dot products a slice of the dimensions at a time
                dims = c + tl.arange(0, DC)
                q = tl.load(QMEANS + query_rows[:, None] * D + dims[None, :], mask=live[:, None], other=0.0)
                means = tl.load(
                    BMEANS + block_rows[:, :, None] * D + dims[None, None, :], mask=exists[:, :, None], other=0.0
                )  # (QB, GP, DC)
                score += tl.sum(q[:, None, :] * means, axis=2)
            start = blocks * block_k
            overlaps = (start <= hi[:, None]) & (start + block_k - 1 >= lo[:, None])
            has_keys = tl.load(BKEYS + b * Nk + blocks, mask=exists, other=0) != 0
            score = tl.where(exists, tl.where(overlaps | ~has_keys, _UNREAL, score), float("-inf"))
            scores = tl.where((slots == s)[None, :, None], score[:, None, :], scores)
        return scores

    @triton.jit
    def _route_kernel(
        QMEANS, GMEANS, GRADII, GKEYS, BMEANS, BKEYS, CHOSEN, REAL,
        H, n, Ng, Nk, group_size, first_block, block_q, block_k, left, right,
        D: tl.constexpr, DC: tl.constexpr, QB: tl.constexpr, GT: tl.constexpr, T: tl.constexpr, TP: tl.constexpr,
        GP: tl.constexpr,
    ):  # fmt: skip
        # Program (tile, bh): query blocks tile * QB, ... of batch and head bh (the slab's blocks, the first one
        # first_block of the call); their T routed key blocks and whether each is real, into CHOSEN and REAL (bh, n, T)
        tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
        b = bh // H
        rows = tile * QB + tl.arange(0, QB)
        live = rows < n
        query_rows = (bh * n + rows).to(tl.int64)
        q = tl.load(QMEANS + query_rows[:, None] * D + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)
        q_norm = tl.sqrt(tl.sum(q * q, axis=1))
        start = (rows + first_block) * block_q
        # the query block's window span; without a window (right < 0) none, which no key block meets
        lo, hi = start - left, tl.where(right >= 0, start + block_q - 1 + right, -1)
        groups = _best_groups(
            QMEANS, GMEANS, GRADII, GKEYS, bh, b, query_rows, live, q_norm, lo, hi, Ng, group_size, block_k,
            D, DC, QB, GT, T, TP,
        )  # fmt: skip
        scores = _candidate_scores(
            QMEANS, BMEANS, BKEYS, bh, b, rows, live, n, groups, lo, hi, Nk, group_size, block_k, D, DC, QB, T, TP, GP
        )
        flat = tl.reshape(scores, (QB, TP * GP))
        cols, slots = tl.arange(0, TP * GP), tl.arange(0, TP)
        out = query_rows[:, None] * T + slots[None, :]
        chosen = tl.zeros((QB, TP), tl.int64)
        real = tl.zeros((QB, TP), tl.int1)
        for s in range(T):
            value, at = tl.max(flat, axis=1, return_indices=True)
            group = tl.sum(tl.where(slots[None, :] == (at // GP)[:, None], groups, 0), axis=1)
            is_real = value > _UNREAL
            here = slots[None, :] == s
            chosen = tl.where(here, tl.where(is_real, group * group_size + at % GP, 0).to(tl.int64)[:, None], chosen)
            real = tl.where(here, is_real[:, None], real)
            flat = tl.where(cols[None, :] == at[:, None], float("-inf"), flat)
        keep = live[:, None] & (slots < T)[None, :]
        tl.store(CHOSEN + out, chosen, mask=keep)
        tl.store(REAL + out, real, mask=keep)


def serves(query_means: Tensor, nb_routed: int, group_size: int) -> bool:
    """Whether the kernel routes query blocks of means ``query_means`` (B, H, n, d) to ``nb_routed`` blocks through
    groups of ``group_size`` blocks: as :func:`.far_field_triton.tiles_serve` says of the means (CUDA, float32, d a
    power of two from 16 to 128), at most 65,535 (batch, head) pairs, and the candidates' scores within
    :data:`MAX_CANDIDATES` per query block."""
    B, H = query_means.shape[:2]
    padded = triton.next_power_of_2(nb_routed) * triton.next_power_of_2(group_size) if triton is not None else 0
    return tiles_serve(query_means, 1, 128) and B * H <= 65535 and padded <= MAX_CANDIDATES


def group_tile(groups: int) -> int:
    """Groups a program bounds per step: all of them, up to :data:`MAX_GROUP_TILE` (a power of two, at least 16)."""
    return min(MAX_GROUP_TILE, max(16, triton.next_power_of_2(groups)))


def _route(
    query_means: Tensor, group_means: Tensor, group_radii: Tensor, group_has_keys: Tensor, block_means: Tensor,
    has_keys: Tensor, geometry: list[int], nb_routed: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    first_block, block_q, block_k, left, right = geometry
    tensors = (query_means, group_means, group_radii, group_has_keys, block_means, has_keys)
    query_means, group_means, group_radii, group_has_keys, block_means, has_keys = contiguous_rows(*tensors)
    B, H, n, d = query_means.shape
    Ng, Nk = group_means.shape[2], block_means.shape[2]
    chosen = torch.empty(B, H, n, nb_routed, dtype=torch.int64, device=query_means.device)
    real = torch.empty(B, H, n, nb_routed, dtype=torch.bool, device=query_means.device)
    grid = (triton.cdiv(n, QUERY_BLOCKS), B * H)
    _route_kernel[grid](
        query_means, group_means, group_radii, group_has_keys, block_means, has_keys, chosen, real,
        H, n, Ng, Nk, Nk // Ng, first_block, block_q, block_k, left, right,
        D=d, DC=min(d, 32), QB=QUERY_BLOCKS, GT=group_tile(Ng), T=nb_routed, TP=triton.next_power_of_2(nb_routed),
        GP=triton.next_power_of_2(Nk // Ng), num_warps=WARPS,
    )  # fmt: skip
    return chosen, real


def _register() -> None:
    """The kernel as a custom operator (opaque to ``torch.compile``), with its shapes for tracing."""
    if hasattr(torch.ops.performer_hf, "route_blocks"):
        return
    operator = torch.library.custom_op("performer_hf::route_blocks", mutates_args=())(_route)

    @operator.register_fake
    def _(query_means, group_means, group_radii, group_has_keys, block_means, has_keys, geometry, nb_routed):
        shape = (*query_means.shape[:3], nb_routed)
        return query_means.new_empty(shape, dtype=torch.int64), query_means.new_empty(shape, dtype=torch.bool)


if triton is not None:
    _register()


def route_blocks(
    query_means: Tensor, group_means: Tensor, group_radii: Tensor, group_has_keys: Tensor, block_means: Tensor,
    has_keys: Tensor, geometry: list[int], nb_routed: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The ``nb_routed`` key blocks of each of n query blocks, as :func:`.hybrid_routing.route` chooses them with
    routing groups: query_means (B, H, n, d); group_means (B, H, Ng, d), group_radii (B, H, Ng) and group_has_keys
    (B, Ng) bool; block_means (B, H, Nk, d) and has_keys (B, Nk) bool, Nk a multiple of Ng (the group size);
    geometry ``[first_block, block_q, block_k, left, right]`` (the first query block's index in the call, the window's
    offsets). Float32. -> (chosen (B, H, n, t) int64, 0 where not real; real (B, H, n, t) bool)."""
    return torch.ops.performer_hf.route_blocks(
        query_means, group_means, group_radii, group_has_keys, block_means, has_keys,
        [int(g) for g in geometry], int(nb_routed),
    )  # fmt: skip
