"""Bidirectional hybrid attention's support sums in Triton kernels, for CUDA devices.

The PyTorch backend gathers each query block's candidate keys into (blocks x candidates x fields) tensors and writes
its (queries x candidates) logits, weights and their gradients to memory: under ``torch.compile`` 4.3 of the hybrid's
4.45 GB read and written forward and backward at 12 heads x 4K tokens (``benchmarks/compiled_traffic.py``), which is
what a GPU's time follows. FlexAttention reads only the support, but the default's routed blocks (8 keys, chosen per
16 queries) cost it a bitmap lookup per score (81 ms on an H200 at 32K, where flash attention takes 27 ms).

Here, as in the CPU kernels of :mod:`.hybrid_compiled` (the same contract, tensor for tensor), one program takes a
block of queries and walks its candidates (the window span, the global keys, the routed key blocks) in chunks whose
keys it loads by position: nothing of size (queries x candidates) goes to memory, and no score looks anything up
(which candidates a query keeps follows from positions and the candidate's kind). Each chunk gives the exact
logits, the softmax's sums (online, relative to a running shift) and the polynomial far field's values on the
support, which the far field over all keys already counted: their difference is what the query's sums need.

- forward: per query, the sums ``[numerator, mass]`` relative to its shift ``m = max(far-field scale, largest exact
  logit)``, with ``m`` and the kernel's mass on the support kept for backward;
- backward: each query block recomputes its chunks and writes its queries' gradients, and adds its window and global
  candidates' shares of theirs (keys, values, key log-weights) atomically, a key being a candidate of several blocks;
  the routed blocks' keys take theirs key-major (``_routed_backward_kernel``): each routed key block walks the query
  blocks that chose it (the routes inverted by a sort, :func:`routed_pieces`), in pieces of a few, and adds once per
  piece. Added per query block, the routed keys' gradients were 85% of some 390M atomic additions at 12 heads x 32K
  (24 blocks of 8 routed per block of 16 queries), and the backward took 7.1 ms of each call's 8.3 on an H200.

The values' last column (the ones whose sums are the masses) stays out of the others' tile, in reductions beside each
product: 33 columns take a tile of 32, not 64 (on Hopper, compiled ahead of time with the walks pipelined: 27 / 30 KB of
shared memory forward / backward where 36 / 46 KB were; unpipelined, :data:`STAGES`, 18 / 32 KB), and the masses need
no picking out of a tile.

Matrix products take float32 as :func:`.far_field_triton.float32_precision` says (by default as PyTorch's do, TF32
for bfloat16 and float16 attention). Tested on the CPU
through Triton's interpreter against the CPU kernels and the dense reference; :func:`serves` says where they run.
"""

from __future__ import annotations

import torch

# Triton and its language come from the far field's module, which imports them where they are (remote code's import
# check requires every module a file imports outside a try block)
from .far_field_triton import contiguous_rows, input_precision, launch_fitting, padded_width, tiles_serve, tl, triton

Tensor = torch.Tensor
CHUNK = 64  # candidate keys per step of a query block's walk (fewer where the tiles exceed the GPU's shared memory)
# warps per program of backward: compiled for Hopper (ptxas) at head dim 32 and 33 value columns, 194 registers and no
# spill, where 4 warps spilled 272 bytes
BACKWARD_WARPS = 8
# the walks' software pipelining (Triton's num_stages) is off: a chunk's rows load beside its key mask, not after it,
# and pipelined the compiler holds the next chunks' rows in shared memory and registers. Compiled for Hopper at head
# dim 32, 3 stages spill 512 / 332 bytes (forward / backward), 2 stages 32 / 64, 1 none (149 / 194 registers): 3
# forward programs fit an SM's registers, where 2 did when the rows loaded after the mask (255 registers)
STAGES = 1
# query blocks per program of the routed blocks' gradients (a key block chosen by more takes more programs: a popular
# block, such as one of the first tokens', is no long chain)
CHOOSERS_PER_PROGRAM = 16
_SMALLER_CHUNKS = (32, 16)

if triton is not None:  # defined at import, when Triton reads TRITON_INTERPRET (its interpreter: the tests on a CPU)

    @triton.jit
    def _candidates(
        step, n, bh, b, ROUTES, MASK, L, N, R, width, nb_global, q_start, left, BLOCK_K: tl.constexpr, CH: tl.constexpr
    ):
        # The chunk of candidate slots from `step`: the window span (width keys from q_start - left), the global keys,
        # then each routed block's BLOCK_K keys. -> positions (CH,), whether each is a position of the call, whether
        # it is a real candidate (a real key besides), whether it is a window slot (a window slot counts for the
        # queries whose window holds it, the others for the rest), whether it is a routed block's.
        slot = step + tl.arange(0, CH)
        routed_slot = slot - width - nb_global
        is_window, is_global = slot < width, (slot >= width) & (routed_slot < 0)
        is_routed = (routed_slot >= 0) & (routed_slot < R * BLOCK_K)
        block = tl.load(ROUTES + (bh * N + n) * R + routed_slot // BLOCK_K, mask=is_routed, other=-1)
        pos = tl.where(is_window, q_start - left + slot, tl.where(is_global, slot - width, 0))
        pos = tl.where(is_routed, block * BLOCK_K + routed_slot % BLOCK_K, pos)
        valid = (is_window | is_global | (is_routed & (block >= 0))) & (pos >= 0) & (pos < L)
        valid = valid & ~(is_routed & (pos < nb_global))  # a global key in a routed block is counted once
        real = tl.load(MASK + b * L + pos, mask=valid, other=0) != 0
        return pos, valid, valid & real, is_window, is_routed

    @triton.jit
    def _chunk(
        x, rows, rq, pos, valid, candidate, is_window, bh, Y, V1, KLOG, key_shift, L, D1, left, right, c2,
        D: tl.constexpr, EP: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # One chunk's keys (CH, D), values (CH, EP) and their last column (CH,) (the ones of the mass) apart, key
        # log-weights, the logits (BQ, CH), which pairs are in the support, t = (x_i - a) . (y_j - c) there and the
        # far field's values there, pair = (1 + t + c2 t^2) kexp_j. The rows load at every valid position, beside the
        # key mask (not after it: one wait for memory less per chunk), and are zero where no real candidate is.
        dims, cols = tl.arange(0, D), tl.arange(0, EP)
        key_rows = bh * L + pos
        y = tl.load(Y + key_rows[:, None] * D + dims[None, :], mask=valid[:, None], other=0.0)
        in_values = valid[:, None] & (cols < D1 - 1)[None, :]
        v = tl.load(V1 + key_rows[:, None] * D1 + cols[None, :], mask=in_values, other=0.0)
        v_mass = tl.load(V1 + key_rows * D1 + D1 - 1, mask=valid, other=0.0)
        klog = tl.load(KLOG + key_rows, mask=valid, other=0.0)
        y, v = tl.where(candidate[:, None], y, 0.0), tl.where(candidate[:, None], v, 0.0)
        v_mass, klog = tl.where(candidate, v_mass, 0.0), tl.where(candidate, klog, 0.0)
        kexp = tl.where(candidate, tl.exp(klog - key_shift), 0.0)
        logits = tl.dot(x, tl.trans(y), input_precision=PRECISION)  # (BQ, CH)
        gap = rows[:, None] - pos[None, :]
        inside = (gap >= -right) & (gap <= left)
        active = candidate[None, :] & (inside == is_window[None, :])
        t = tl.where(active, logits - rq[:, None] - klog[None, :], 0.0)
        pair = tl.where(active, (1.0 + t + c2 * t * t) * kexp[None, :], 0.0)
        return y, v, v_mass, logits, active, t, pair, kexp

    @triton.jit
    def _query_rows(X, RQ, QSCALE, KSHIFT, n, bh, L, block_q, D: tl.constexpr, BQ: tl.constexpr):
        # Query block n of batch and head bh: its rows (BQ,), which are real queries, their scaled queries (BQ, D),
        # centering log-weights and far-field scales (plus the key shift). int64 offsets: B H L d passes 2^31.
        q_start = n * block_q
        rows = q_start + tl.arange(0, BQ)
        live = (tl.arange(0, BQ) < block_q) & (rows < L)
        x = tl.load(X + (bh * L + rows)[:, None] * D + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)
        rq = tl.load(RQ + bh * L + rows, mask=live, other=0.0)
        key_shift = tl.load(KSHIFT + bh)
        far_scale = tl.load(QSCALE + bh * L + rows, mask=live, other=0.0) + key_shift
        return q_start, rows, live, x, rq, key_shift, far_scale

    @triton.jit
    def _query_block(X, RQ, QSCALE, KSHIFT, H, L, block_q, D: tl.constexpr, BQ: tl.constexpr):
        # The program's query block: program (n, bh) takes block n of batch and head bh (neighbouring blocks, which
        # share window keys, run together; the first grid axis takes more than 65,535 blocks), as _query_rows reads it.
        n, bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        q_start, rows, live, x, rq, key_shift, far_scale = _query_rows(X, RQ, QSCALE, KSHIFT, n, bh, L, block_q, D, BQ)
        return n, bh, bh // H, q_start, rows, live, x, rq, key_shift, far_scale

    @triton.jit
    def _outside(FAR, FLOOR, kernel_mass, bh, rows, live, L, D1):
        # Whether each query's far field outside its support counts: its sums over every key minus the kernel's mass
        # on the support (BQ,) above the floor of rounding (hybrid_far_field.complement_floor); the far mass (BQ,)
        far_mass = tl.load(FAR + (bh * L + rows) * D1 + D1 - 1, mask=live, other=0.0)
        floor = tl.load(FLOOR + bh * L + rows, mask=live, other=0.0)
        return live & (far_mass - kernel_mass > floor), far_mass

    @triton.jit
    def _backward_terms(GRAD, FAR, FLOOR, SHIFT, KMASS, bh, rows, live, far_scale, L, D1, EP: tl.constexpr):
        # What a query block's backward reads besides its queries: the gradient of its sums (BQ, EP) and of its mass
        # (BQ,), its shift, the far field's weight exp(far scale - shift) (0 where it does not count), and the far
        # field's sums and mass
        cols = tl.arange(0, EP)
        shift = tl.load(SHIFT + bh * L + rows, mask=live, other=0.0)
        kernel_mass = tl.load(KMASS + bh * L + rows, mask=live, other=0.0)
        outside, far_mass = _outside(FAR, FLOOR, kernel_mass, bh, rows, live, L, D1)
        far_weight = tl.where(outside, tl.exp(far_scale - shift), 0.0)
        row_base = (bh * L + rows) * D1
        out_rows = row_base[:, None] + cols[None, :]
        keep = live[:, None] & (cols < D1 - 1)[None, :]
        grad = tl.load(GRAD + out_rows, mask=keep, other=0.0)  # (BQ, EP), and the mass's (BQ,) apart
        grad_mass = tl.load(GRAD + row_base + D1 - 1, mask=live, other=0.0)
        far = tl.load(FAR + out_rows, mask=keep, other=0.0)
        return shift, far_weight, grad, grad_mass, far, far_mass

    @triton.jit
    def _pair_gradients(
        logits, active, t, pair, kexp, v, v_mass, shift, far_weight, grad, grad_mass, c2, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # For a chunk's (query, candidate) pairs, with the per-query shift held constant (it cancels in the division):
        # the weights the sums applied to the values, the gradients of those weights, of the logits, of the far
        # field's values on the support (d_pair) and of t = logit - rq - klog (each (BQ, CH))
        pair = tl.where(active, pair, 0.0)
        exact = tl.where(active, tl.exp(tl.minimum(logits - shift[:, None], 0.0)), 0.0)
        weights = exact - far_weight[:, None] * pair  # (BQ, CH): what the sums applied to the values
        d_weights = tl.dot(grad, tl.trans(v), input_precision=PRECISION) + grad_mass[:, None] * v_mass[None, :]
        d_pair = -far_weight[:, None] * d_weights
        d_t = tl.where(active, d_pair * kexp[None, :] * (1.0 + 2.0 * c2 * t), 0.0)
        d_logits = d_weights * exact + d_t
        return pair, weights, d_weights, d_logits, d_pair, d_t

    @triton.jit
    def _backward_step(
        x, rows, live, rq, pos, valid, candidate, is_window, bh, Y, V1, KLOG, key_shift, L, D1, left, right, c2,
        shift, far_weight, grad, grad_mass, D: tl.constexpr, EP: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # A chunk of candidates for a query block in backward: its keys (CH, D), the far field's values on the
        # support, and :func:`_pair_gradients`'
        y, v, v_mass, logits, active, t, pair, kexp = _chunk(
            x, rows, rq, pos, valid, candidate, is_window, bh, Y, V1, KLOG, key_shift, L, D1, left, right, c2,
            D, EP, PRECISION,
        )  # fmt: skip
        pair, weights, d_weights, d_logits, d_pair, d_t = _pair_gradients(
            logits, active & live[:, None], t, pair, kexp, v, v_mass, shift, far_weight, grad, grad_mass, c2,
            PRECISION,
        )  # fmt: skip
        return y, pair, weights, d_weights, d_logits, d_pair, d_t

    @triton.jit
    def _key_shares(x, grad, grad_mass, pair, weights, d_logits, d_pair, d_t, PRECISION: tl.constexpr):
        # a query block's shares of a chunk's candidates' gradients: their key log-weights' (CH,), keys' (CH, D),
        # values' (CH, EP) and the values' last column's (CH,) (pair is proportional to exp(klog))
        d_klog = tl.sum(d_pair * pair - d_t, axis=0)
        d_y = tl.dot(tl.trans(d_logits), x, input_precision=PRECISION)
        d_v = tl.dot(tl.trans(weights), grad, input_precision=PRECISION)
        return d_klog, d_y, d_v, tl.sum(weights * grad_mass[:, None], axis=0)

    @triton.jit
    def _add_key_grads(
        DY, DV1, DKLOG, key_rows, here, d_klog, d_y, d_v, d_v_mass, D1, D: tl.constexpr, EP: tl.constexpr
    ):
        # adds the keys' (rows key_rows where `here`) gradients atomically: a key is a candidate of several programs
        cols = tl.arange(0, EP)
        tl.atomic_add(DKLOG + key_rows, d_klog, mask=here)
        tl.atomic_add(DY + key_rows[:, None] * D + tl.arange(0, D)[None, :], d_y, mask=here[:, None])
        tl.atomic_add(DV1 + key_rows[:, None] * D1 + cols[None, :], d_v, mask=here[:, None] & (cols < D1 - 1)[None, :])
        tl.atomic_add(DV1 + key_rows * D1 + D1 - 1, d_v_mass, mask=here)

    @triton.jit
    def _forward_kernel(
        X, RQ, QSCALE, FAR, KSHIFT, Y, V1, KLOG, MASK, ROUTES, FLOOR, OUT, SHIFT, KMASS,
        H, L, N, R, D1, block_q, width, nb_global, left, right, c2,
        D: tl.constexpr, EP: tl.constexpr, BQ: tl.constexpr, BLOCK_K: tl.constexpr, CH: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        n, bh, b, q_start, rows, live, x, rq, key_shift, far_scale = _query_block(
            X, RQ, QSCALE, KSHIFT, H, L, block_q, D, BQ
        )
        cols = tl.arange(0, EP)
        shift = tl.full((BQ,), -3.0e38, tl.float32)  # the running shift: the largest exact logit so far (finite)
        exact = tl.zeros((BQ, EP), dtype=tl.float32)  # softmax's sums [numerator, mass], relative to shift
        exact_mass = tl.zeros((BQ,), dtype=tl.float32)
        kernel = tl.zeros((BQ, EP), dtype=tl.float32)  # the far field's sums on the support, relative to its scale
        kernel_mass = tl.zeros((BQ,), dtype=tl.float32)
        for step in range(0, width + nb_global + R * BLOCK_K, CH):
            pos, valid, candidate, is_window, _ = _candidates(
                step, n, bh, b, ROUTES, MASK, L, N, R, width, nb_global, q_start, left, BLOCK_K, CH
            )
            y, v, v_mass, logits, active, t, pair, kexp = _chunk(
                x, rows, rq, pos, valid, candidate, is_window, bh, Y, V1, KLOG, key_shift, L, D1, left, right, c2,
                D, EP, PRECISION,
            )  # fmt: skip
            active = active & live[:, None]
            new_shift = tl.maximum(shift, tl.max(tl.where(active, logits, float("-inf")), axis=1))
            weights = tl.where(active, tl.exp(tl.minimum(logits - new_shift[:, None], 0.0)), 0.0)
            decay = tl.exp(shift - new_shift)
            exact = exact * decay[:, None] + tl.dot(weights, v, input_precision=PRECISION)
            exact_mass = exact_mass * decay + tl.sum(weights * v_mass[None, :], axis=1)
            kernel += tl.dot(pair, v, input_precision=PRECISION)
            kernel_mass += tl.sum(pair * v_mass[None, :], axis=1)
            shift = new_shift
        tl.store(KMASS + bh * L + rows, kernel_mass, mask=live)
        # the far field counts where what remains outside the support is above rounding: then the shift takes its
        # scale too
        outside, far_mass = _outside(FAR, FLOOR, kernel_mass, bh, rows, live, L, D1)
        final = tl.where(outside, tl.maximum(far_scale, shift), shift)
        exact, exact_mass = exact * tl.exp(shift - final)[:, None], exact_mass * tl.exp(shift - final)
        far_weight = tl.where(outside, tl.exp(far_scale - final), 0.0)  # (BQ,)
        row_base = (bh * L + rows) * D1
        keep = live[:, None] & (cols < D1 - 1)[None, :]
        far = tl.load(FAR + row_base[:, None] + cols[None, :], mask=keep, other=0.0)
        tl.store(OUT + row_base[:, None] + cols[None, :], exact + far_weight[:, None] * (far - kernel), mask=keep)
        tl.store(OUT + row_base + D1 - 1, exact_mass + far_weight * (far_mass - kernel_mass), mask=live)
        tl.store(SHIFT + bh * L + rows, final, mask=live)

    @triton.jit
    def _backward_kernel(
        GRAD, X, RQ, QSCALE, FAR, KSHIFT, Y, V1, KLOG, MASK, ROUTES, FLOOR, SHIFT, KMASS,
        DX, DRQ, DQSCALE, DFAR, DY, DV1, DKLOG,
        H, L, N, R, D1, block_q, width, nb_global, left, right, c2,
        D: tl.constexpr, EP: tl.constexpr, BQ: tl.constexpr, BLOCK_K: tl.constexpr, CH: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # The query block's gradients (its queries', centering log-weights', far-field scales' and far sums'), and
        # its window and global candidates' shares of theirs, added atomically (_routed_backward_kernel adds the
        # routed blocks')
        n, bh, b, q_start, rows, live, x, rq, key_shift, far_scale = _query_block(
            X, RQ, QSCALE, KSHIFT, H, L, block_q, D, BQ
        )
        dims, cols = tl.arange(0, D), tl.arange(0, EP)
        shift, far_weight, grad, grad_mass, far, far_mass = _backward_terms(
            GRAD, FAR, FLOOR, SHIFT, KMASS, bh, rows, live, far_scale, L, D1, EP
        )
        # out = sums + far_weight [far values, far mass]
        row_base = (bh * L + rows) * D1
        keep = live[:, None] & (cols < D1 - 1)[None, :]
        tl.store(DFAR + row_base[:, None] + cols[None, :], far_weight[:, None] * grad, mask=keep)
        tl.store(DFAR + row_base + D1 - 1, far_weight * grad_mass, mask=live)
        d_far_weight = tl.sum(far * grad, axis=1) + far_mass * grad_mass
        d_x = tl.zeros((BQ, D), dtype=tl.float32)
        d_rq = tl.zeros((BQ,), dtype=tl.float32)
        for step in range(0, width + nb_global + R * BLOCK_K, CH):
            pos, valid, candidate, is_window, is_routed = _candidates(
                step, n, bh, b, ROUTES, MASK, L, N, R, width, nb_global, q_start, left, BLOCK_K, CH
            )
            y, pair, weights, d_weights, d_logits, d_pair, d_t = _backward_step(
                x, rows, live, rq, pos, valid, candidate, is_window, bh, Y, V1, KLOG, key_shift, L, D1, left, right, c2,
                shift, far_weight, grad, grad_mass, D, EP, PRECISION,
            )  # fmt: skip
            d_far_weight -= tl.sum(d_weights * pair, axis=1)
            d_rq -= tl.sum(d_t, axis=1)
            d_x += tl.dot(d_logits, y, input_precision=PRECISION)
            if step < width + nb_global:  # this block's share of its window and global candidates' gradients
                d_klog, d_y, d_v, d_v_mass = _key_shares(
                    x, grad, grad_mass, pair, weights, d_logits, d_pair, d_t, PRECISION
                )
                here = candidate & ~is_routed
                _add_key_grads(DY, DV1, DKLOG, bh * L + pos, here, d_klog, d_y, d_v, d_v_mass, D1, D, EP)
        tl.store(DX + (bh * L + rows)[:, None] * D + dims[None, :], d_x, mask=live[:, None])
        tl.store(DRQ + bh * L + rows, d_rq, mask=live)
        tl.store(DQSCALE + bh * L + rows, d_far_weight * far_weight, mask=live)  # far_weight = exp(q_scale + ...)

    @triton.jit
    def _routed_backward_kernel(
        GRAD, X, RQ, QSCALE, FAR, KSHIFT, Y, V1, KLOG, MASK, FLOOR, SHIFT, KMASS, PIECES, CHOOSERS, DY, DV1, DKLOG,
        H, L, NKB, D1, block_q, nb_global, left, right, c2,
        D: tl.constexpr, EP: tl.constexpr, BQ: tl.constexpr, BLOCK_K: tl.constexpr, KT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # program: a piece of a routed key block's choosers (PIECES' row: the key block, bh * NKB + its index, and the
        # piece's first and end entries in CHOOSERS, the query blocks that chose each key block, key block after key
        # block): the block's keys' shares of their gradients from those query blocks, added atomically. The block's
        # BLOCK_K keys in a tile of KT.
        piece = tl.program_id(0).to(tl.int64)
        key_block = tl.load(PIECES + 3 * piece).to(tl.int64)
        first, end = tl.load(PIECES + 3 * piece + 1), tl.load(PIECES + 3 * piece + 2)
        bh = key_block // NKB
        slots = tl.arange(0, KT)
        pos = key_block % NKB * BLOCK_K + slots
        valid = (slots < BLOCK_K) & (pos < L) & (pos >= nb_global)  # a global key: counted once
        valid = valid & (slots * 0 + first < end)  # a vector: Triton 3.9's interpreter types a scalar's as int32
        candidate = valid & (tl.load(MASK + bh // H * L + pos, mask=valid, other=0) != 0)
        routed = tl.zeros((KT,), dtype=tl.int1)  # no window slot: pairs inside a query's window count there
        d_y = tl.zeros((KT, D), dtype=tl.float32)
        d_v = tl.zeros((KT, EP), dtype=tl.float32)
        d_v_mass = tl.zeros((KT,), dtype=tl.float32)
        d_klog = tl.zeros((KT,), dtype=tl.float32)
        for entry in range(first, end):
            n = tl.load(CHOOSERS + entry).to(tl.int64)
            q_start, rows, live, x, rq, key_shift, far_scale = _query_rows(
                X, RQ, QSCALE, KSHIFT, n, bh, L, block_q, D, BQ
            )
            shift, far_weight, grad, grad_mass, _, _ = _backward_terms(
                GRAD, FAR, FLOOR, SHIFT, KMASS, bh, rows, live, far_scale, L, D1, EP
            )
            _, pair, weights, _, d_logits, d_pair, d_t = _backward_step(
                x, rows, live, rq, pos, candidate, candidate, routed, bh, Y, V1, KLOG, key_shift, L, D1, left, right,
                c2, shift, far_weight, grad, grad_mass, D, EP, PRECISION,
            )  # fmt: skip
            shares = _key_shares(x, grad, grad_mass, pair, weights, d_logits, d_pair, d_t, PRECISION)
            d_klog, d_y, d_v, d_v_mass = d_klog + shares[0], d_y + shares[1], d_v + shares[2], d_v_mass + shares[3]
        _add_key_grads(DY, DV1, DKLOG, bh * L + pos, candidate, d_klog, d_y, d_v, d_v_mass, D1, D, EP)


def serves(x: Tensor, values_width: int, query_block: int) -> bool:
    """Whether the kernels take queries ``x`` (B, H, L, d) with values ``values_width`` wide (the last, the mass's
    ones, apart from the others' tile) in query blocks of ``query_block``: as :func:`.far_field_triton.tiles_serve`
    says (head dims up to 128), at most 64 queries per block and 65,535 (batch, head) pairs (the launch grid's second
    axis)."""
    fits = tiles_serve(x, padded_width(values_width - 1), 128)
    return fits and query_block <= 64 and x.shape[0] * x.shape[1] <= 65535


def _settings(x: Tensor, width: int, block_q: int, block_k: int, precision: str) -> dict:
    """The kernels' compile-time settings: tile sizes (query rows and the values but their last column, the mass's,
    padded to at least 16, the matrix products' smallest tile) and their matrix products' precision."""
    tiles = dict(D=x.shape[-1], EP=padded_width(width - 1), BQ=padded_width(block_q), BLOCK_K=block_k)
    return {**tiles, "PRECISION": input_precision(precision)}


def _launch(kernel, grid: tuple, args: tuple, settings: dict) -> None:
    """``kernel[grid](*args, **settings)`` in chunks of :data:`CHUNK` candidates, or of fewer where that needs more
    shared memory than the GPU has (wide heads and values, large query blocks: up to 257 KB on Hopper, which has 227;
    less on other GPUs), remembered for that kind of launch."""
    launch_fitting(kernel, grid, args, settings, tuple({"CH": chunk} for chunk in (CHUNK, *_SMALLER_CHUNKS)))


def _forward(
    x: Tensor, rq: Tensor, q_scale: Tensor, far_sum: Tensor, key_shift: Tensor, y: Tensor, values1: Tensor,
    klog: Tensor, mask: Tensor, far_floor: Tensor, routes: Tensor, geometry: list[int], quadratic: float,
    precision: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The sums (B, H, L, D1), each query's shift and the kernel's mass on its support (B, H, L). Inputs as
    :func:`support_sums` gives them (y untransposed, routes int32)."""
    x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, far_floor, routes = contiguous_rows(
        x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, far_floor, routes
    )
    left, right, nb_global, block_q, block_k = geometry
    B, H, L, _ = x.shape
    N, R, D1 = routes.shape[2], routes.shape[3], values1.shape[-1]
    out = torch.empty_like(far_sum)
    shift, kernel_mass = (x.new_empty(B, H, L) for _ in range(2))
    width = block_q + left + right if right >= 0 else 0
    args = (
        x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, routes, far_floor, out, shift, kernel_mass,
        H, L, N, R, D1, block_q, width, nb_global, left, right, quadratic,
    )  # fmt: skip
    _launch(_forward_kernel, (N, B * H), args, {**_settings(x, D1, block_q, block_k, precision), "num_stages": STAGES})
    return out, shift, kernel_mass


def _backward(
    grad: Tensor, x: Tensor, rq: Tensor, q_scale: Tensor, far_sum: Tensor, key_shift: Tensor, y: Tensor,
    values1: Tensor, klog: Tensor, mask: Tensor, far_floor: Tensor, routes: Tensor, shift: Tensor,
    kernel_mass: Tensor, geometry: list[int], quadratic: float, precision: str,
) -> list[Tensor]:  # fmt: skip
    """The gradients of x, rq, q_scale, far_sum, y, values1 and klog."""
    tensors = (grad, x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, far_floor, routes, shift, kernel_mass)
    grad, x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, far_floor, routes, shift, kernel_mass = (
        contiguous_rows(*tensors)
    )
    left, right, nb_global, block_q, block_k = geometry
    B, H, L, _ = x.shape
    N, R, D1 = routes.shape[2], routes.shape[3], values1.shape[-1]
    d_x, d_rq, d_q_scale, d_far = (torch.empty_like(t) for t in (x, rq, q_scale, far_sum))
    d_y, d_values1, d_klog = (torch.zeros_like(t) for t in (y, values1, klog))  # added into atomically
    width = block_q + left + right if right >= 0 else 0
    args = (
        grad, x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, routes, far_floor, shift, kernel_mass,
        d_x, d_rq, d_q_scale, d_far, d_y, d_values1, d_klog,
        H, L, N, R, D1, block_q, width, nb_global, left, right, quadratic,
    )  # fmt: skip
    settings = _settings(x, D1, block_q, block_k, precision)
    _launch(_backward_kernel, (N, B * H), args, {**settings, "num_warps": BACKWARD_WARPS, "num_stages": STAGES})
    if R:
        pieces, choosers = routed_pieces(routes, -(-L // block_k))
        args = (
            grad, x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, far_floor, shift, kernel_mass, pieces,
            choosers,
            d_y, d_values1, d_klog, H, L, -(-L // block_k), D1, block_q, nb_global, left, right, quadratic,
        )  # fmt: skip
        _routed_launch(pieces.shape[0], args, {**settings, "KT": padded_width(block_k)})
    return [d_x, d_rq, d_q_scale, d_far, d_y, d_values1, d_klog]


def routed_pieces(routes: Tensor, key_blocks: int) -> tuple[Tensor, Tensor]:
    """The routes (B, H, N, R) inverted, for the routed blocks' gradients: the query blocks that chose each of the
    ``key_blocks`` key blocks of each (batch, head), key block after key block (``choosers``, int32), and the pieces of
    at most :data:`CHOOSERS_PER_PROGRAM` of them that programs take (``pieces`` (P, 3) int32: a key block,
    ``bh * key_blocks + block``, and its piece's first and end entries in ``choosers``). P is a bound known before
    the routes are (no wait for the device): the rows past the pieces' count have first = end = 0, and take nothing."""
    B, H, N, R = routes.shape
    device, blocks = routes.device, B * H * key_blocks
    chosen = routes.reshape(B * H, N * R).long()
    owner = torch.arange(B * H, device=device)[:, None] * key_blocks + chosen  # (B H, N R): bh's key block
    owner, order = torch.where(chosen >= 0, owner, blocks).flatten().sort()  # no choice: past every key block
    choosers = (order % (N * R) // R).int()  # (E,): each entry's query block, the entries by key block
    counts = torch.bincount(owner, minlength=blocks + 1)[:blocks]  # (K,): choosers of each key block
    ends = counts.cumsum(0)
    per_block = -(-counts // CHOOSERS_PER_PROGRAM)  # (K,): its pieces
    pieces_end = per_block.cumsum(0)
    bound = -(-(B * H * N * R) // CHOOSERS_PER_PROGRAM) + min(blocks, B * H * N * R)
    piece = torch.arange(bound, device=device)
    block = torch.searchsorted(pieces_end, piece, right=True).clamp_max(blocks - 1)  # (P,): its key block
    first = ends[block] - counts[block] + (piece - (pieces_end[block] - per_block[block])) * CHOOSERS_PER_PROGRAM
    real = piece < pieces_end[-1]
    first = torch.where(real, first, 0)
    end = torch.where(real, torch.minimum(first + CHOOSERS_PER_PROGRAM, ends[block]), 0)
    return torch.stack([block, first, end], dim=-1).int(), choosers


def _routed_launch(programs: int, args: tuple, settings: dict) -> None:
    """The routed blocks' gradients' kernel over ``programs`` pieces (its tiles a key block's keys: 4 warps, 122
    registers compiled for Hopper at head dim 32); one stage of loads where two exceed the GPU's shared memory."""
    tiles = ({"num_stages": 2}, {"num_stages": 1})
    launch_fitting(_routed_backward_kernel, (programs,), args, settings, tiles)


def _register() -> None:
    """The kernels as custom operators (opaque to ``torch.compile``, which calls them between its own kernels), with
    their shapes for tracing and the sums' gradients. A second copy of this module (remote code beside the installed
    package) finds them registered and uses them."""
    if hasattr(torch.ops.performer_hf, "hybrid_support_sums"):
        return
    library = torch.library
    forward = library.custom_op("performer_hf::hybrid_support_sums", mutates_args=())(_forward)
    backward = library.custom_op("performer_hf::hybrid_support_sums_backward", mutates_args=())(_backward)

    @forward.register_fake
    def _(x, rq, q_scale, far_sum, *rest):
        return far_sum.new_empty(far_sum.shape), x.new_empty(x.shape[:3]), x.new_empty(x.shape[:3])

    @backward.register_fake
    def _(grad, x, rq, q_scale, far_sum, key_shift, y, values1, klog, *rest):
        return [t.new_empty(t.shape) for t in (x, rq, q_scale, far_sum, y, values1, klog)]

    def setup_context(ctx, inputs, output):
        *tensors, ctx.geometry, ctx.quadratic, ctx.precision = inputs
        ctx.save_for_backward(*tensors, *output[1:])

    def gradients(ctx, grad, _d_shift, _d_kernel_mass):
        x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, far_floor, routes, shift, kernel_mass = (
            ctx.saved_tensors
        )
        d_x, d_rq, d_q_scale, d_far, d_y, d_values1, d_klog = torch.ops.performer_hf.hybrid_support_sums_backward(
            grad, x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, far_floor, routes, shift, kernel_mass,
            ctx.geometry, ctx.quadratic, ctx.precision,
        )  # fmt: skip
        return d_x, d_rq, d_q_scale, d_far, None, d_y, d_values1, d_klog, None, None, None, None, None, None

    library.register_autograd("performer_hf::hybrid_support_sums", gradients, setup_context=setup_context)


if triton is not None:
    _register()


def support_sums(
    x: Tensor, rq: Tensor, q_scale: Tensor, far_sum: Tensor, key_shift: Tensor, y: Tensor, values1: Tensor,
    klog: Tensor, mask: Tensor, far_floor: Tensor, routes: Tensor, geometry: list[int], quadratic: float,
    precision: str = "pytorch",
) -> Tensor:  # fmt: skip
    """Bidirectional hybrid attention's merged sums (B, H, L, D1) relative to a per-query shift, as the CPU kernels'
    ``hybrid_support_sums``: x, y (B, H, L, d); rq, q_scale, klog, far_floor (B, H, L); far_sum, values1 (B, H, L,
    D1); key_shift (B, H); mask (B, L) bool; routes (B, H, N, R) the routed key blocks of each query block (-1:
    none); geometry ``[left, right, nb_global, block_q, block_k]``; quadratic the polynomial's ``c2``. Float32, the
    matrix products in ``precision`` (:func:`.far_field_triton.float32_precision`)."""
    out, _, _ = torch.ops.performer_hf.hybrid_support_sums(
        x, rq, q_scale, far_sum, key_shift, y, values1, klog, mask, far_floor, routes.to(torch.int32),
        [int(g) for g in geometry], float(quadratic), precision,
    )  # fmt: skip
    return out
