"""FAVOR+ sums of exponential features in Triton kernels, for CUDA devices: what :func:`.favor_exp.causal_exp_sums`
(causal FAVOR+, and the causal hybrid's FAVOR++ far field) and :func:`.favor_exp.bidirectional_exp_sums` (plain
FAVOR+) compute, with their contracts.

Compiled on a GPU, the PyTorch forms write (positions x features) buffers to memory, forward and backward (the
causal scan also its chunk products and start states): ``benchmarks/compiled_traffic.py`` counts 2.56 GB for one
causal FAVOR+ call of 12 heads x 4K tokens x 32 dims (256 features), 1.22 GB bidirectionally, where the inputs and
outputs are about 25 MB. Here the features live in registers. A walk's program holds the state of a block of
:data:`FEATURES_PER_PROGRAM` features and walks a segment of positions in chunks; segments run in parallel where
(batch, head, feature block) programs are too few to fill a GPU (:func:`segments`), each causal segment's start state
from a first pass over its keys and a short scan over the segments (:func:`.causal_scan.scan_forward`).

The features are ``phi(x)_r = exp(x . D_r + bias_r + offset(x))``: the offsets come from PyTorch (per row: the
queries' ``-max_r (x . D_r + bias_r)``, the keys' ``row - |x|^2 / 2 - log sqrt(m)`` minus their shift: the running
max ``s_j`` of the keys' log-features causally, their max bidirectionally), so that every feature and every factor
``exp(s_j - s_i)`` is at most 1, as in PyTorch. Their gradient reaches the offsets' differentiable parts (``|x|^2``,
``row``) through PyTorch; the kernels give the rest:

- ``_row_max_kernel``: ``max_r (x . D_r + bias_r)`` for every row (the shifts' input);
- causal, in two steps each way, as flash-linear-attention's chunked kernels. Forward, ``_state_walk_kernel`` walks the
  keys alone and writes the state before every chunk of :data:`CHUNK` positions (and after the last), then
  ``_chunk_sums_kernel`` gives each chunk's sums ``sum_{j <= i} phi(q_i) . phi(k_j) exp(s_j - s_i) [v_j, 1]`` (plus the
  state before position 0) from its keys and that state. Backward, the keys' walk again and
  ``_state_grad_walk_kernel``, the queries alone in reverse, which writes the gradient of the state after every chunk;
  then ``_chunk_query_grad_kernel`` and ``_chunk_key_grad_kernel``, each chunk's queries' gradients from the one, its
  keys' and values' from the other (and the offsets'; the state before position 0's from the walk). The chunks run in
  parallel, each program over all the features a block at a time: no chain of dependent chunks beside the queries'
  work, nothing added atomically. (The walks that computed the sums and gradients too, a feature block's share per
  program added into the outputs, used 255 registers and spilled 632 / 784 / 1,052 bytes compiled for Hopper at the
  decoder's head size; now the query gradients' kernel spills 16 bytes, the others none.)
- bidirectional: ``_sum_kernel``, ``sum_rows (phi(x) + stabilizer) (x) w`` (the keys' state; backward, its gradient
  from the queries), and ``_rows_kernel``, each row's ``(phi(x) + stabilizer) S`` (the sums; backward, the values'
  gradient) or the gradients of rows and offsets.

The values come with the normaliser's column (ones: a head's d values and 1, E = d + 1): the kernels hold d of them in
their tiles and the last in reductions beside each product (:func:`.far_field_triton.value_tiles`), where a tile
padded to the next power of two would double the products' value side (65 columns in 128) and the shared memory the
state takes (on Hopper, ahead of time, at head dim 64: the scan's kernels 87 / 111 / 119 KB -> 62 / 74 / 91 KB).

Matrix products take float32 as :func:`.far_field_triton.float32_precision` says. The directions and bias are
constants here (the projection is a buffer; a learned FAVOR++ parameter keeps PyTorch: :func:`serves`). Tested on
the CPU through Triton's interpreter against the PyTorch forms in float64.
"""

from __future__ import annotations

import functools
import math

import torch

# Triton and its language come from the far field's module, which imports them where they are (remote code's import
# check requires every module a file imports outside a try block)
from .causal_scan import EMPTY_SHIFT, scan_backward, scan_forward, scan_weights
from .far_field_triton import contiguous_rows, input_precision, launch_fitting, tiles_serve, tl, triton, value_tiles

Tensor = torch.Tensor
FEATURES_PER_PROGRAM = 64  # features of the state one program holds
CHUNK = 32  # positions per step of a program's walk
# the launch settings of the kernels, the first that fits the GPU's shared memory (launch_fitting), chunks of CHUNK
# positions always (the walks write a state per chunk, which the chunks' kernels read): compiled for Hopper, two stages
# of loads in flight take at most 31 KB at head dim 32 x 33 value columns, 115 KB at 128 x 129 (of 227)
TILES = ({"num_stages": 2}, {"num_stages": 1})
# features per step of a chunk's program (over all of them): compiled for Hopper at head dim 32, 33 value columns and
# 4 warps (ptxas), the chunks' sums take 185 registers and spill none at 16, spill at two stages of loads at 32 (255
# registers) and at any at 64
SUM_FEATURES = 16
# The walk is cut into segments that run in parallel where (batch, head, feature block) programs are too few to fill a
# GPU (a 32K-token call of 12 heads x 256 features has 48): about this many programs in all, segments of at least
# MIN_SEGMENT positions. Each segment's start state then comes from a first pass over the segments' keys and a short
# scan over the segments (causal_scan.scan_forward); backward likewise.
TARGET_PROGRAMS = 1024
MIN_SEGMENT = 512
# rows per program of the bidirectional rows' kernel (sums, gradients) at head dims up to 32, which read the whole
# state and the feature directions once per program: 64 rows halve those reads (66 KB a program at 256 features x 33
# columns; 800 MB a call of 12 heads x 32K rows at 32) and give Hopper's warpgroup products their 64 rows; compiled
# for Hopper at head dim 32, 235 / 191 registers (sums / gradients) and no spill. Wider heads keep CHUNK rows: at 64
# rows head dim 64 spills 2.3 KB (sums) and 20 KB (gradients) in IEEE float32
WIDE_ROWS = 64

if triton is not None:  # defined at import, when Triton reads TRITON_INTERPRET (its interpreter: the tests on a CPU)

    @triton.jit
    def _directions(DIR, BIAS, b, h, f0, M, dir_b, dir_h, bias_b, bias_h, D: tl.constexpr, BM: tl.constexpr):
        # The program's block of features: which exist (BM,), their directions (BM, D) and biases (BM,) (0 without)
        feats = f0 + tl.arange(0, BM)
        exists = feats < M
        base = DIR + b * dir_b + h * dir_h
        dirs = tl.load(base + feats[:, None] * D + tl.arange(0, D)[None, :], mask=exists[:, None], other=0.0)
        bias = tl.zeros((BM,), dtype=tl.float32)
        if BIAS is not None:
            bias = tl.load(BIAS + b * bias_b + h * bias_h + feats, mask=exists, other=0.0)
        return feats, exists, dirs, bias

    @triton.jit
    def _row_max_kernel(
        X, DIR, BIAS, OUT, TOP, H, L, M, dir_b, dir_h, bias_b, bias_h,
        D: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # program (bh, tile): max_r (x . D_r + bias_r) for the tile's C rows, and its r (the first of equal ones)
        bh, tile = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64 offsets: B H L d passes 2^31
        b, h = bh // H, bh % H
        rows = tile * C + tl.arange(0, C)
        live = rows < L
        x = tl.load(X + (bh * L + rows)[:, None] * D + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)
        best = tl.full((C,), float("-inf"), dtype=tl.float32)
        top = tl.zeros((C,), dtype=tl.int32)
        for f0 in range(0, M, BM):
            feats, exists, dirs, bias = _directions(DIR, BIAS, b, h, f0, M, dir_b, dir_h, bias_b, bias_h, D, BM)
            logits = tl.dot(x, tl.trans(dirs), input_precision=PRECISION) + bias[None, :]
            block_best, block_top = tl.max(
                tl.where(exists[None, :], logits, float("-inf")), axis=1, return_indices=True
            )
            top = tl.where(block_best > best, block_top + f0, top)
            best = tl.maximum(best, block_best)
        tl.store(OUT + bh * L + rows, best, mask=live)
        tl.store(TOP + bh * L + rows, top, mask=live)

    @triton.jit
    def _stabilizer_grads(TOP, DIR, b, h, bh, rows, live, L, dir_b, dir_h, stabilizer, d_phi_sum, D: tl.constexpr):
        # The stabilizer's share of the query rows' gradients (C, D) and of their offsets' (C,): it is relative to
        # each query's largest feature (index TOP's, direction D_top), stabilizer * exp(x . D_top + bias_top + offset),
        # whose log gets stabilizer * sum_r d loss / d phi_r (d_phi_sum (C,))
        top = tl.load(TOP + bh * L + rows, mask=live, other=0)
        dims = tl.arange(0, D)
        top_dirs = tl.load(
            DIR + b * dir_b + h * dir_h + top[:, None] * D + dims[None, :], mask=live[:, None], other=0.0
        )
        d_top = stabilizer * d_phi_sum
        return d_top[:, None] * top_dirs, d_top

    @triton.jit
    def _row_features(X, OFF, bh, rows, live, dirs, bias, exists, L, D: tl.constexpr, PRECISION: tl.constexpr):
        # the features exp(x . D_r + bias_r + offset) (C, BM) of rows x, 0 for rows and features that do not exist
        # (an offset of -inf: a key left out)
        x = tl.load(X + (bh * L + rows)[:, None] * D + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)
        off = tl.load(OFF + bh * L + rows, mask=live, other=float("-inf"))
        logits = tl.dot(x, tl.trans(dirs), input_precision=PRECISION) + bias[None, :] + off[:, None]
        return tl.where(exists[None, :] & live[:, None], tl.exp(logits), 0.0)

    @triton.jit
    def _value_rows(V, bh, rows, live, L, E, EP: tl.constexpr, TAIL: tl.constexpr):
        # rows of (B, H, L, E) values: their tile (C, EP), zero past E, and with TAIL their last column apart (C,)
        # (zero without)
        cols = tl.arange(0, EP)
        base = V + (bh * L + rows) * E
        tile = tl.load(base[:, None] + cols[None, :], mask=live[:, None] & (cols < E)[None, :], other=0.0)
        tail = tl.where(live, 0.0, 0.0)
        if TAIL:
            tail = tl.load(base + EP, mask=live, other=0.0)
        return tile, tail

    @triton.jit
    def _write_rows(OUT, bh, rows, live, tile, tail, L, E, EP: tl.constexpr, TAIL: tl.constexpr, ADD: tl.constexpr):
        # writes (or with ADD, adds atomically) a tile (C, EP) and its last column apart (C,) (with TAIL) into rows
        # of (B, H, L, E)
        cols = tl.arange(0, EP)
        base = OUT + (bh * L + rows) * E
        tile_ptr, tile_mask = base[:, None] + cols[None, :], live[:, None] & (cols < E)[None, :]
        if ADD:
            tl.atomic_add(tile_ptr, tile, mask=tile_mask)
            if TAIL:
                tl.atomic_add(base + EP, tail, mask=live)
        else:
            tl.store(tile_ptr, tile, mask=tile_mask)
            if TAIL:
                tl.store(base + EP, tail, mask=live)

    @triton.jit
    def _state_rows(KV, row, feats, exists, M, E, EP: tl.constexpr):
        # pointers to the program's rows of a (B, H, S, M, E) state (row = its (batch, head, segment)), the mask of
        # its tile (BM, EP), and pointers to their last column (the tail's, with TAIL)
        cols = tl.arange(0, EP)
        base = KV + (row * M + feats) * E
        return base[:, None] + cols[None, :], exists[:, None] & (cols < E)[None, :], base + EP

    @triton.jit
    def _load_state(KV, row, feats, exists, M, E, EP: tl.constexpr, TAIL: tl.constexpr):
        # the program's rows of a (B, H, S, M, E) state: its tile (BM, EP) and last column (BM,) (zero without TAIL)
        tile_ptr, tile_mask, tail_ptr = _state_rows(KV, row, feats, exists, M, E, EP)
        tile = tl.load(tile_ptr, mask=tile_mask, other=0.0)
        tail = tl.where(exists, 0.0, 0.0)
        if TAIL:
            tail = tl.load(tail_ptr, mask=exists, other=0.0)
        return tile, tail

    @triton.jit
    def _store_state(KV, row, feats, exists, M, E, tile, tail, EP: tl.constexpr, TAIL: tl.constexpr, ADD: tl.constexpr):
        # writes (or with ADD, adds atomically) the program's rows of a (B, H, S, M, E) state
        tile_ptr, tile_mask, tail_ptr = _state_rows(KV, row, feats, exists, M, E, EP)
        if ADD:
            tl.atomic_add(tile_ptr, tile, mask=tile_mask)
            if TAIL:
                tl.atomic_add(tail_ptr, tail, mask=exists)
        else:
            tl.store(tile_ptr, tile, mask=tile_mask)
            if TAIL:
                tl.store(tail_ptr, tail, mask=exists)

    @triton.jit
    def _sum_kernel(
        X, OFF, W, DIR, BIAS, OUT,
        H, L, M, E, SEG, dir_b, dir_h, bias_b, bias_h, stabilizer,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # program (bh, feature block, segment): its segment's share of sum_rows (phi(x) + stabilizer) (x) w, for its
        # block of features, added into OUT (B, H, M, E): the keys' state, or the state's gradient from the queries
        bh, block, g = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
        feats, exists, dirs, bias = _directions(
            DIR, BIAS, bh // H, bh % H, block * BM, M, dir_b, dir_h, bias_b, bias_h, D, BM
        )
        acc = tl.zeros((BM, EP), dtype=tl.float32)
        acc_tail = tl.zeros((BM,), dtype=tl.float32)
        first = g * SEG
        stop = tl.minimum(first + SEG, L)
        for start in range(first, stop, C):
            rows = start + tl.arange(0, C)
            live = rows < stop
            phi = _row_features(X, OFF, bh, rows, live, dirs, bias, exists, L, D, PRECISION)
            phi = tl.where(exists[None, :] & live[:, None], phi + stabilizer, 0.0)
            w, w_tail = _value_rows(W, bh, rows, live, L, E, EP, TAIL)
            acc += tl.dot(tl.trans(phi), w, input_precision=PRECISION)
            if TAIL:
                acc_tail += tl.sum(phi * w_tail[:, None], axis=0)
        _store_state(OUT, bh, feats, exists, M, E, acc, acc_tail, EP, TAIL, True)

    @triton.jit
    def _rows_kernel(
        X, OFF, TOP, G, S, DIR, BIAS, OUT, DX, DOFF,
        H, L, M, E, dir_b, dir_h, bias_b, bias_h, stabilizer,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
        PRECISION: tl.constexpr, GRADIENT: tl.constexpr,
    ):  # fmt: skip
        # program (bh, tile): for the tile's C rows, over every block of features of the state S (B, H, M, E):
        # OUT = (phi(x) + stabilizer) S (the sums, or the values' gradient); with GRADIENT, from G (C, E):
        # d log phi = (G S^T) phi, DX = d log phi D and DOFF = its row sums (the rows' and their offsets' gradients),
        # with TOP (queries: the index of each row's largest feature) the stabilizer's share (:func:`_stabilizer_grads`)
        bh, tile = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        b, h = bh // H, bh % H
        rows = tile * C + tl.arange(0, C)
        live = rows < L
        dims = tl.arange(0, D)
        g = tl.zeros((C, EP), dtype=tl.float32)
        g_tail = tl.zeros((C,), dtype=tl.float32)
        if GRADIENT:
            g, g_tail = _value_rows(G, bh, rows, live, L, E, EP, TAIL)
        acc = tl.zeros((C, EP), dtype=tl.float32)
        acc_tail = tl.zeros((C,), dtype=tl.float32)
        d_x = tl.zeros((C, D), dtype=tl.float32)
        d_off = tl.zeros((C,), dtype=tl.float32)
        d_phi_sum = tl.zeros((C,), dtype=tl.float32)
        for f0 in range(0, M, BM):
            feats, exists, dirs, bias = _directions(DIR, BIAS, b, h, f0, M, dir_b, dir_h, bias_b, bias_h, D, BM)
            state, state_tail = _load_state(S, bh, feats, exists, M, E, EP, TAIL)  # (BM, EP), (BM,)
            phi = _row_features(X, OFF, bh, rows, live, dirs, bias, exists, L, D, PRECISION)
            if GRADIENT:
                d_phi = tl.dot(g, tl.trans(state), input_precision=PRECISION)  # (C, BM)
                if TAIL:
                    d_phi += g_tail[:, None] * state_tail[None, :]
                d_log = d_phi * phi
                d_x += tl.dot(d_log, dirs, input_precision=PRECISION)
                d_off += tl.sum(d_log, axis=1)
                d_phi_sum += tl.sum(d_phi, axis=1)
            else:
                phi = tl.where(exists[None, :], phi + stabilizer, 0.0)
                acc += tl.dot(phi, state, input_precision=PRECISION)
                if TAIL:
                    acc_tail += tl.sum(phi * state_tail[None, :], axis=1)
        if GRADIENT:
            if TOP is not None:
                d_x_top, d_off_top = _stabilizer_grads(
                    TOP, DIR, b, h, bh, rows, live, L, dir_b, dir_h, stabilizer, d_phi_sum, D
                )
                d_x += d_x_top
                d_off += d_off_top
            tl.store(DX + (bh * L + rows)[:, None] * D + dims[None, :], d_x, mask=live[:, None])
            tl.store(DOFF + bh * L + rows, d_off, mask=live)
        else:
            _write_rows(OUT, bh, rows, live, acc, acc_tail, L, E, EP, TAIL, False)

    @triton.jit
    def _chunk_shifts(start, stop, bh, SHIFTS, L, C: tl.constexpr):
        # One chunk's rows (C,) from `start`, which are before `stop` (its segment's end), key shifts s (C,) (past the
        # segment: the chunk's end shift) and the chunk's end shift
        rows = start + tl.arange(0, C)
        live = rows < stop
        s = tl.load(SHIFTS + bh * L + rows, mask=live, other=float("-inf"))
        end = tl.max(s, axis=0)  # the shifts never decrease: the last position's
        return rows, live, tl.where(live, s, end), end

    @triton.jit
    def _chunk_rows(start, stop, bh, V1, SHIFTS, L, E, EP: tl.constexpr, TAIL: tl.constexpr, C: tl.constexpr):
        # :func:`_chunk_shifts`' and the chunk's values (C, EP) and their last column apart (C,) (TAIL):
        # (rows, live, v, v_tail, s, end)
        rows, live, s, end = _chunk_shifts(start, stop, bh, SHIFTS, L, C)
        v, v_tail = _value_rows(V1, bh, rows, live, L, E, EP, TAIL)
        return rows, live, v, v_tail, s, end

    @triton.jit
    def _causal_decay(rows, s):
        # the causal factors exp(s_j - s_i) (C, C) [i, j] of a chunk's rows, 0 above the diagonal
        causal = rows[:, None] >= rows[None, :]
        return tl.where(causal, tl.exp(tl.minimum(s[None, :] - s[:, None], 0.0)), 0.0)

    @triton.jit
    def _segment(H, L, S, SEG):
        # program (bh, feature block, segment): its batch, head, feature block, segment, the segment's positions
        # [first, stop) and the shift its start state is relative to's position (first - 1; the state's before the
        # call for the first segment)
        bh, block, g = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
        first = g * SEG
        return bh, bh // H, bh % H, block, bh * S + g, first, tl.minimum(first + SEG, L)

    @triton.jit
    def _start_shift(SHIFTS, SHIFT0, bh, L, start):
        # the shift the state before position `start` is relative to: the key shift before it, or the state's before
        # the call
        return tl.where(start > 0, tl.load(SHIFTS + bh * L + tl.maximum(start - 1, 0)), tl.load(SHIFT0 + bh))

    @triton.jit
    def _chunk_program(L, H, C: tl.constexpr):
        # program (bh, chunk) of a grid over every chunk of every (batch, head), one axis: (chunks per row, bh, b, h,
        # chunk)
        chunks = tl.cdiv(L, C)
        pid = tl.program_id(0).to(tl.int64)  # int64 offsets: B H L d passes 2^31
        bh = pid // chunks
        return chunks, bh, bh // H, bh % H, pid % chunks

    @triton.jit
    def _chunk_block(
        Q, K, QOFF, KOFF, DIR, BIAS, STATES, state_row, bh, b, h, f0, rows, live, L, M, E,
        dir_b, dir_h, bias_b, bias_h, stabilizer,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # A chunk program's block of BM features from f0: their directions (BM, D), the chunk's query features plus
        # the stabilizer and key features (C, BM), and the block's rows of a state (STATES' row state_row: (BM, EP)
        # and the last column (BM,))
        feats, exists, dirs, bias = _directions(DIR, BIAS, b, h, f0, M, dir_b, dir_h, bias_b, bias_h, D, BM)
        phi_q = _row_features(Q, QOFF, bh, rows, live, dirs, bias, exists, L, D, PRECISION)
        phi_q = tl.where(exists[None, :], phi_q + stabilizer, 0.0)
        phi_k = _row_features(K, KOFF, bh, rows, live, dirs, bias, exists, L, D, PRECISION)
        state, state_tail = _load_state(STATES, state_row, feats, exists, M, E, EP, TAIL)
        return dirs, phi_q, phi_k, state, state_tail

    @triton.jit
    def _state_walk_kernel(
        K, V1, KOFF, SHIFTS, DIR, BIAS, KV0, SHIFT0, KV, CHUNKS,
        H, L, M, E, S, SEG, dir_b, dir_h, bias_b, bias_h,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
        PRECISION: tl.constexpr, WRITE_CHUNKS: tl.constexpr,
    ):  # fmt: skip
        # program (bh, feature block, segment): from its segment's start state (KV0's), its rows of the state after
        # the segment (KV's) and, with WRITE_CHUNKS, of the state before each of its chunks (CHUNKS (B, H, NT, M, E),
        # relative to the key shift before the chunk): the keys only, no query read
        bh, b, h, block, row, first, stop = _segment(H, L, S, SEG)
        feats, exists, dirs, bias = _directions(DIR, BIAS, b, h, block * BM, M, dir_b, dir_h, bias_b, bias_h, D, BM)
        state, state_tail = _load_state(KV0, row, feats, exists, M, E, EP, TAIL)  # relative to exp(prev)
        prev = _start_shift(SHIFTS, SHIFT0, bh, L, first)
        for start in range(first, stop, C):
            if WRITE_CHUNKS:
                chunk = bh * tl.cdiv(L, C) + start // C
                _store_state(CHUNKS, chunk, feats, exists, M, E, state, state_tail, EP, TAIL, False)
            rows, live, v, v_tail, s, end = _chunk_rows(start, stop, bh, V1, SHIFTS, L, E, EP, TAIL, C)
            phi_k = _row_features(K, KOFF, bh, rows, live, dirs, bias, exists, L, D, PRECISION)
            to_end = tl.exp(s - end)  # (C,)
            state = state * tl.exp(prev - end) + tl.dot(tl.trans(phi_k), v * to_end[:, None], input_precision=PRECISION)
            if TAIL:
                state_tail = state_tail * tl.exp(prev - end) + tl.sum(phi_k * (v_tail * to_end)[:, None], axis=0)
            prev = end
        _store_state(KV, row, feats, exists, M, E, state, state_tail, EP, TAIL, False)

    @triton.jit
    def _chunk_sums_kernel(
        Q, K, V1, QOFF, KOFF, SHIFTS, DIR, BIAS, SHIFT0, CHUNKS, OUT,
        H, L, M, E, dir_b, dir_h, bias_b, bias_h, stabilizer,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # program (bh, chunk) (one axis: (batch, head) after (batch, head) of chunks): the chunk's sums over every
        # block of features, from its keys (the causal product phi(q) phi(k)^T, decayed, times the values) and from
        # the state before it (CHUNKS'), written once: no walk, nothing added atomically
        chunks, bh, b, h, n = _chunk_program(L, H, C)
        rows, live, v, v_tail, s, end = _chunk_rows(n * C, L, bh, V1, SHIFTS, L, E, EP, TAIL, C)
        scores = tl.zeros((C, C), dtype=tl.float32)
        reads = tl.zeros((C, EP), dtype=tl.float32)  # the state's sums, relative to exp(prev)
        reads_tail = tl.zeros((C,), dtype=tl.float32)
        for f0 in range(0, M, BM):
            _, phi_q, phi_k, state, state_tail = _chunk_block(
                Q, K, QOFF, KOFF, DIR, BIAS, CHUNKS, bh * chunks + n, bh, b, h, f0, rows, live, L, M, E,
                dir_b, dir_h, bias_b, bias_h, stabilizer, D, EP, TAIL, BM, PRECISION,
            )  # fmt: skip
            scores += tl.dot(phi_q, tl.trans(phi_k), input_precision=PRECISION)
            reads += tl.dot(phi_q, state, input_precision=PRECISION)
            if TAIL:
                reads_tail += tl.sum(phi_q * state_tail[None, :], axis=1)
        scores = scores * _causal_decay(rows, s)
        to_query = tl.exp(_start_shift(SHIFTS, SHIFT0, bh, L, n * C) - s)  # (C,)
        out = tl.dot(scores, v, input_precision=PRECISION) + reads * to_query[:, None]
        out_tail = tl.sum(scores * v_tail[None, :], axis=1) + reads_tail * to_query
        _write_rows(OUT, bh, rows, live, out, out_tail, L, E, EP, TAIL, False)

    @triton.jit
    def _state_grad_walk_kernel(
        GRAD, GKV, Q, QOFF, SHIFTS, DIR, BIAS, SHIFT0, DKV0, DCHUNKS,
        H, L, M, E, S, SEG, dir_b, dir_h, bias_b, bias_h, stabilizer,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
        PRECISION: tl.constexpr, WRITE_CHUNKS: tl.constexpr,
    ):  # fmt: skip
        # program (bh, feature block, segment): walking the segment's chunks in reverse from the gradient of the state
        # after it (GKV's row, relative to its end shift), its rows of the gradient of the segment's start state
        # (DKV0's) and, with WRITE_CHUNKS, of the state after each chunk (DCHUNKS (B, H, NT, M, E), relative to the
        # chunk's end shift): how the queries after each chunk read it, the queries only
        bh, b, h, block, row, first, stop = _segment(H, L, S, SEG)
        feats, exists, dirs, bias = _directions(DIR, BIAS, b, h, block * BM, M, dir_b, dir_h, bias_b, bias_h, D, BM)
        d_state, d_state_tail = _load_state(GKV, row, feats, exists, M, E, EP, TAIL)  # (BM, EP), (BM,)
        last = first + (stop - first - 1) // C * C
        for back in range(0, stop - first, C):
            start = last - back
            if WRITE_CHUNKS:
                chunk = bh * tl.cdiv(L, C) + start // C
                _store_state(DCHUNKS, chunk, feats, exists, M, E, d_state, d_state_tail, EP, TAIL, False)
            rows, live, s, end = _chunk_shifts(start, stop, bh, SHIFTS, L, C)
            prev = _start_shift(SHIFTS, SHIFT0, bh, L, start)
            phi_q = _row_features(Q, QOFF, bh, rows, live, dirs, bias, exists, L, D, PRECISION)
            reads = tl.where(exists[None, :], phi_q + stabilizer, 0.0) * tl.exp(prev - s)[:, None]  # (C, BM)
            g, g_tail = _value_rows(GRAD, bh, rows, live, L, E, EP, TAIL)
            d_state = d_state * tl.exp(prev - end) + tl.dot(tl.trans(reads), g, input_precision=PRECISION)
            if TAIL:
                d_state_tail = d_state_tail * tl.exp(prev - end) + tl.sum(reads * g_tail[:, None], axis=0)
        _store_state(DKV0, row, feats, exists, M, E, d_state, d_state_tail, EP, TAIL, False)

    @triton.jit
    def _chunk_grad_rows(
        GRAD, V1, SHIFTS, L, H, E, EP: tl.constexpr, TAIL: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr
    ):
        # A chunk program's rows (:func:`_chunk_program`, :func:`_chunk_rows`), their sums' gradient g (C, EP) and its
        # last column (C,), the causal factors (C, C) and the gradient of the causal scores, (g v^T) * decay
        chunks, bh, b, h, n = _chunk_program(L, H, C)
        rows, live, v, v_tail, s, end = _chunk_rows(n * C, L, bh, V1, SHIFTS, L, E, EP, TAIL, C)
        g, g_tail = _value_rows(GRAD, bh, rows, live, L, E, EP, TAIL)
        d_scores = tl.dot(g, tl.trans(v), input_precision=PRECISION)  # (C, C) [i, j]
        if TAIL:
            d_scores += g_tail[:, None] * v_tail[None, :]
        decay = _causal_decay(rows, s)
        return chunks, bh, b, h, n, rows, live, v, v_tail, s, end, g, g_tail, decay, d_scores * decay

    @triton.jit
    def _store_row_grads(DX, DOFF, bh, rows, live, d_x, d_off, L, D: tl.constexpr):
        # the gradients of a chunk's rows (C, D) and of their offsets (C,)
        tl.store(DX + (bh * L + rows)[:, None] * D + tl.arange(0, D)[None, :], d_x, mask=live[:, None])
        tl.store(DOFF + bh * L + rows, d_off, mask=live)

    @triton.jit
    def _chunk_query_grad_kernel(
        GRAD, Q, K, V1, QOFF, KOFF, SHIFTS, DIR, BIAS, SHIFT0, CHUNKS, QTOP, DQ, DQOFF,
        H, L, M, E, dir_b, dir_h, bias_b, bias_h, stabilizer,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # program (bh, chunk): the chunk's queries' gradients, from its keys and the state before it (CHUNKS'), over
        # every block of features. d phi_q = (g v^T * decay) phi_k + exp(prev - s) g S^T; d log phi_q = d phi_q phi_q;
        # and the stabilizer's share (:func:`_stabilizer_grads`, QTOP: the index of each query's largest feature)
        chunks, bh, b, h, n, rows, live, v, v_tail, s, end, g, g_tail, decay, d_scores = _chunk_grad_rows(
            GRAD, V1, SHIFTS, L, H, E, EP, TAIL, C, PRECISION
        )
        to_query = tl.exp(_start_shift(SHIFTS, SHIFT0, bh, L, n * C) - s)  # (C,)
        d_q = tl.zeros((C, D), dtype=tl.float32)
        d_q_off = tl.zeros((C,), dtype=tl.float32)
        d_phi_sum = tl.zeros((C,), dtype=tl.float32)
        for f0 in range(0, M, BM):
            # (the query features' own, without the stabilizer: its gradient follows the loop)
            dirs, phi_q, phi_k, state, state_tail = _chunk_block(
                Q, K, QOFF, KOFF, DIR, BIAS, CHUNKS, bh * chunks + n, bh, b, h, f0, rows, live, L, M, E,
                dir_b, dir_h, bias_b, bias_h, 0.0, D, EP, TAIL, BM, PRECISION,
            )  # fmt: skip
            reads = tl.dot(g, tl.trans(state), input_precision=PRECISION)  # (C, BM)
            if TAIL:
                reads += g_tail[:, None] * state_tail[None, :]
            d_phi = tl.dot(d_scores, phi_k, input_precision=PRECISION) + reads * to_query[:, None]
            d_log = d_phi * phi_q  # (C, BM)
            d_q += tl.dot(d_log, dirs, input_precision=PRECISION)
            d_q_off += tl.sum(d_log, axis=1)
            d_phi_sum += tl.sum(d_phi, axis=1)
        d_q_top, d_q_off_top = _stabilizer_grads(
            QTOP, DIR, b, h, bh, rows, live, L, dir_b, dir_h, stabilizer, d_phi_sum, D
        )
        _store_row_grads(DQ, DQOFF, bh, rows, live, d_q + d_q_top, d_q_off + d_q_off_top, L, D)

    @triton.jit
    def _chunk_key_grad_kernel(
        GRAD, Q, K, V1, QOFF, KOFF, SHIFTS, DIR, BIAS, DCHUNKS, DK, DKOFF, DV1,
        H, L, M, E, dir_b, dir_h, bias_b, bias_h, stabilizer,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # program (bh, chunk): the chunk's keys' and values' gradients, from its queries and the gradient of the state
        # after it (DCHUNKS'), over every block of features
        chunks, bh, b, h, n, rows, live, v, v_tail, s, end, g, g_tail, decay, d_scores = _chunk_grad_rows(
            GRAD, V1, SHIFTS, L, H, E, EP, TAIL, C, PRECISION
        )
        to_end = tl.exp(s - end)  # (C,)
        scores = tl.zeros((C, C), dtype=tl.float32)
        d_v = tl.zeros((C, EP), dtype=tl.float32)  # the state's share, relative to exp(end)
        d_v_tail = tl.zeros((C,), dtype=tl.float32)
        d_k = tl.zeros((C, D), dtype=tl.float32)
        d_k_off = tl.zeros((C,), dtype=tl.float32)
        for f0 in range(0, M, BM):
            dirs, phi_q, phi_k, d_state, d_state_tail = _chunk_block(
                Q, K, QOFF, KOFF, DIR, BIAS, DCHUNKS, bh * chunks + n, bh, b, h, f0, rows, live, L, M, E,
                dir_b, dir_h, bias_b, bias_h, stabilizer, D, EP, TAIL, BM, PRECISION,
            )  # fmt: skip
            scores += tl.dot(phi_q, tl.trans(phi_k), input_precision=PRECISION)
            writes = tl.dot(v, tl.trans(d_state), input_precision=PRECISION)  # (C, BM)
            if TAIL:
                writes += v_tail[:, None] * d_state_tail[None, :]
            d_phi = tl.dot(tl.trans(d_scores), phi_q, input_precision=PRECISION) + writes * to_end[:, None]
            d_v += tl.dot(phi_k, d_state, input_precision=PRECISION)
            if TAIL:
                d_v_tail += tl.sum(phi_k * d_state_tail[None, :], axis=1)
            d_log = d_phi * phi_k  # (C, BM)
            d_k += tl.dot(d_log, dirs, input_precision=PRECISION)
            d_k_off += tl.sum(d_log, axis=1)
        scores = scores * decay
        d_v = d_v * to_end[:, None] + tl.dot(tl.trans(scores), g, input_precision=PRECISION)
        d_v_tail = d_v_tail * to_end + tl.sum(scores * g_tail[:, None], axis=0)
        _store_row_grads(DK, DKOFF, bh, rows, live, d_k, d_k_off, L, D)
        _write_rows(DV1, bh, rows, live, d_v, d_v_tail, L, E, EP, TAIL, False)


def serves(q: Tensor, values_width: int, directions: Tensor, bias: Tensor | None) -> bool:
    """Whether the kernels take queries ``q`` (B, H, L, d) with values ``values_width`` wide and these features: as
    :func:`.far_field_triton.tiles_serve` says of the values' tile (:func:`.far_field_triton.value_tiles`: head dims
    up to 128, and their values with the normaliser's column), with directions and bias that need no gradient (a
    learned FAVOR++ parameter keeps PyTorch)."""
    learned = torch.is_grad_enabled() and (directions.requires_grad or (bias is not None and bias.requires_grad))
    return tiles_serve(q, value_tiles(values_width)[0], 128) and not learned


def _features_args(q: Tensor, directions: Tensor, bias: Tensor | None) -> tuple:
    """Directions and bias broadcast to (B, H, m, d) and (B, H, 1, m), with their (batch, head) strides (0 where
    shared): (directions, bias or None, dir_b, dir_h, bias_b, bias_h)."""
    B, H = q.shape[:2]
    m, d = directions.shape[-2:]
    dirs = directions.contiguous().broadcast_to(B, H, m, d)
    if bias is None:
        return dirs, None, dirs.stride(0), dirs.stride(1), 0, 0
    bias = bias.contiguous().broadcast_to(B, H, 1, m)
    return dirs, bias, dirs.stride(0), dirs.stride(1), bias.stride(0), bias.stride(1)


def _settings(q: Tensor, width: int, precision: str) -> dict:
    """The kernels' compile-time settings but the pipeline's stages (:data:`TILES`): widths, chunks and their
    products' precision."""
    tile, tail = value_tiles(width)
    precision = input_precision(precision)
    return dict(D=q.shape[-1], EP=tile, TAIL=tail, BM=FEATURES_PER_PROGRAM, C=CHUNK, PRECISION=precision)


def _row_max(x: Tensor, directions: Tensor, bias: Tensor | None, precision: str) -> tuple[Tensor, Tensor]:
    """``max_r (x . D_r + bias_r)`` (B, H, L) of rows x (B, H, L, d), and its index r (B, H, L) int32 (the first of
    equal ones)."""
    (x,) = contiguous_rows(x)
    B, H, L, _ = x.shape
    dirs, bias, *strides = _features_args(x, directions, bias)
    out, top = x.new_empty(B, H, L), x.new_empty(B, H, L, dtype=torch.int32)
    settings = dict(D=x.shape[-1], C=64, BM=FEATURES_PER_PROGRAM, PRECISION=input_precision(precision))
    _row_max_kernel[(B * H, triton.cdiv(L, 64))](x, dirs, bias, out, top, H, L, dirs.shape[-2], *strides, **settings)
    return out, top


def segments(batch_heads: int, features: int, length: int) -> tuple[int, int]:
    """How a walk of ``length`` positions is cut: (segments, positions per segment, a multiple of :data:`CHUNK`)."""
    blocks = batch_heads * triton.cdiv(features, FEATURES_PER_PROGRAM)
    wanted = max(1, min(triton.cdiv(length, MIN_SEGMENT), triton.cdiv(TARGET_PROGRAMS, blocks)))
    size = triton.cdiv(triton.cdiv(max(length, 1), wanted), CHUNK) * CHUNK
    return triton.cdiv(max(length, 1), size), size


def _segment_weights(shifts: Tensor, shift0: Tensor, size: int) -> Tensor:
    """The scan over segments of :func:`.causal_scan.scan_weights`, from the shift before the call and each segment's
    end shift (its last position's): (B, H, S + 1, S + 1)."""
    L = shifts.shape[-1]
    ends = torch.arange(size, L + size, size, device=shifts.device).clamp_max(L) - 1  # (S,)
    return scan_weights(torch.cat([shift0[..., None], shifts[..., ends]], dim=-1))


def _keys_walk(
    keys: tuple, shift0: Tensor, sizes: tuple, grid: tuple, settings: dict, starts: Tensor, after: Tensor,
    chunk_states: Tensor | None,
) -> None:  # fmt: skip
    """The keys' walk (:func:`_state_walk_kernel`) of each segment from its start state ``starts`` (B, H, S, m, E):
    the state after it into ``after`` and, unless ``chunk_states`` is None, the state before every chunk into it."""
    write_chunks = chunk_states is not None
    args = (*keys, starts, shift0, after, chunk_states if write_chunks else after, *sizes)
    launch_fitting(_state_walk_kernel, grid, args, {**settings, "WRITE_CHUNKS": write_chunks}, TILES)


def _forward(
    q: Tensor, k: Tensor, v1: Tensor, q_off: Tensor, q_top: Tensor, k_off: Tensor, shifts: Tensor, directions: Tensor,
    bias: Tensor | None, kv0: Tensor, shift0: Tensor, stabilizer: float, precision: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The sums (B, H, L, E), the state after the call (B, H, m, E) and each segment's start state (B, H, S, m, E)
    (``q_top``, the index of each query's largest feature, is backward's).

    The keys' walk gives the state before every chunk of :data:`CHUNK` positions (its segments in parallel, each from
    its start state: the segments' own states, then their scan); then each chunk's sums, every chunk in parallel, from
    its keys and that state. Those states are (B, H, L / CHUNK, m, E) float32 while the call runs: 415 MB at 12 heads
    x 32K positions x 256 features x 33 columns."""
    q, k, v1, q_off, k_off, shifts, kv0, shift0 = contiguous_rows(q, k, v1, q_off, k_off, shifts, kv0, shift0)
    B, H, L, _ = q.shape
    E, M = v1.shape[-1], directions.shape[-2]
    dirs, bias, *strides = _features_args(q, directions, bias)
    S, size = segments(B * H, M, L)
    grid, settings = (B * H, triton.cdiv(M, FEATURES_PER_PROGRAM), S), _settings(q, E, precision)
    walk = functools.partial(
        _keys_walk, (k, v1, k_off, shifts, dirs, bias), shift0, (H, L, M, E, S, size, *strides), grid, settings
    )
    chunk_states = q.new_empty(B, H, triton.cdiv(L, CHUNK), M, E)
    if S == 1:
        starts, kv = kv0[:, :, None].clone(), torch.empty_like(kv0)  # (an operator's outputs alias no input)
        walk(starts, kv, chunk_states)
    else:  # each segment's keys alone, then the segments' start states, then the states before their chunks
        local = q.new_empty(B, H, S, M, E)
        walk(torch.zeros_like(local), local, None)
        starts, kv = scan_forward(_segment_weights(shifts, shift0, size), kv0, local)
        walk(starts, local, chunk_states)
    out = q.new_empty(B, H, L, E)
    args = (q, k, v1, q_off, k_off, shifts, dirs, bias, shift0, chunk_states, out, H, L, M, E, *strides, stabilizer)
    settings = {**settings, "BM": SUM_FEATURES}
    launch_fitting(_chunk_sums_kernel, (B * H * triton.cdiv(L, CHUNK),), args, settings, TILES)
    return out, kv, starts


def _backward(
    grad: Tensor, grad_kv: Tensor, q: Tensor, k: Tensor, v1: Tensor, q_off: Tensor, q_top: Tensor, k_off: Tensor,
    shifts: Tensor, directions: Tensor, bias: Tensor | None, starts: Tensor, shift0: Tensor, stabilizer: float,
    precision: str,
) -> list[Tensor]:  # fmt: skip
    """The gradients of q, k, v1, q_off, k_off and the state before the call, from each segment's start state.

    As forward: the walks give the state before every chunk (the keys' walk again, from the segments' start states)
    and the gradient of the state after every chunk (the queries' walk in reverse: each segment's own, then the
    segments' scan's adjoint); then every chunk's gradients in parallel, its queries' from the one, its keys' and
    values' from the other."""
    tensors = contiguous_rows(grad, grad_kv, q, k, v1, q_off, q_top, k_off, shifts, starts, shift0)
    grad, grad_kv, q, k, v1, q_off, q_top, k_off, shifts, starts, shift0 = tensors
    B, H, L, _ = q.shape
    E, M = v1.shape[-1], directions.shape[-2]
    dirs, bias, *strides = _features_args(q, directions, bias)
    S, size = segments(B * H, M, L)
    grid, settings = (B * H, triton.cdiv(M, FEATURES_PER_PROGRAM), S), _settings(q, E, precision)
    sizes = (H, L, M, E, S, size, *strides)
    chunk_states, d_chunk_states = (q.new_empty(B, H, triton.cdiv(L, CHUNK), M, E) for _ in range(2))
    keys = (k, v1, k_off, shifts, dirs, bias)
    _keys_walk(keys, shift0, sizes, grid, settings, starts, torch.empty_like(starts), chunk_states)

    def queries_walk(after: Tensor, before: Tensor, write_chunks: bool) -> None:
        """The queries' walk in reverse of each segment from the gradient of the state ``after`` it: the gradient of
        its start state into ``before`` and, with ``write_chunks``, of the state after every chunk."""
        args = (grad, after, q, q_off, shifts, dirs, bias, shift0, before, d_chunk_states, *sizes, stabilizer)
        launch_fitting(_state_grad_walk_kernel, grid, args, {**settings, "WRITE_CHUNKS": write_chunks}, TILES)

    if S == 1:
        d_kv0 = torch.empty_like(grad_kv)
        queries_walk(grad_kv[:, :, None], d_kv0[:, :, None], True)
    else:  # how each segment's queries read its start state, then the gradients of the states after the segments
        reads = torch.empty_like(starts)
        queries_walk(torch.zeros_like(starts), reads, False)
        after, d_kv0 = scan_backward(_segment_weights(shifts, shift0, size), reads, grad_kv)
        queries_walk(after, reads, True)
    d_q, d_k, d_v1, d_q_off, d_k_off = (torch.empty_like(t) for t in (q, k, v1, q_off, k_off))
    rows = (grad, q, k, v1, q_off, k_off, shifts, dirs, bias)
    chunks, settings = (B * H * triton.cdiv(L, CHUNK),), {**settings, "BM": SUM_FEATURES}
    args = (*rows, shift0, chunk_states, q_top, d_q, d_q_off, H, L, M, E, *strides, stabilizer)
    launch_fitting(_chunk_query_grad_kernel, chunks, args, settings, TILES)
    args = (*rows, d_chunk_states, d_k, d_k_off, d_v1, H, L, M, E, *strides, stabilizer)
    launch_fitting(_chunk_key_grad_kernel, chunks, args, settings, TILES)
    return [d_q, d_k, d_v1, d_q_off, d_k_off, d_kv0]


def _sum(x: Tensor, off: Tensor, w: Tensor, features: tuple, out: Tensor, stabilizer: float, precision: str) -> None:
    """Adds ``sum_rows (phi(x) + stabilizer) (x) w`` into ``out`` (B, H, M, E), for rows x (B, H, L, d) with offsets
    (B, H, L) and w (B, H, L, E); ``features``: :func:`_features_args`'s."""
    B, H, L, _ = x.shape
    M, E = out.shape[-2:]
    dirs, bias, *strides = features
    S, size = segments(B * H, M, L)
    args = (x, off, w, dirs, bias, out, H, L, M, E, size, *strides, stabilizer)
    grid = (B * H, triton.cdiv(M, FEATURES_PER_PROGRAM), S)
    launch_fitting(_sum_kernel, grid, args, _settings(x, E, precision), TILES)


def rows_per_program(head_dim: int) -> int:
    """Rows per program of the bidirectional rows' kernel: :data:`WIDE_ROWS` at head dims up to 32, else
    :data:`CHUNK`."""
    return WIDE_ROWS if head_dim <= 32 else CHUNK


def _rows(
    x: Tensor, off: Tensor, state: Tensor, features: tuple, stabilizer: float, precision: str, g: Tensor | None = None,
    top: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """For rows x (B, H, L, d) with offsets (B, H, L) and a state (B, H, M, E): ``(phi(x) + stabilizer) state``
    (B, H, L, E); or with ``g`` (B, H, L, E), the gradients of x and of the offsets of ``sum g . phi(x) state``,
    with ``top`` (B, H, L) (queries: the index of each row's largest feature) also the stabilizer's, which is
    relative to that feature."""
    B, H, L, d = x.shape
    M, E = state.shape[-2:]
    dirs, bias, *strides = features
    gradient = g is not None
    out = None if gradient else x.new_empty(B, H, L, E)
    d_x, d_off = (x.new_empty(B, H, L, d), x.new_empty(B, H, L)) if gradient else (None, None)
    args = (x, off, top, g, state, dirs, bias, out, d_x, d_off, H, L, M, E, *strides, stabilizer)
    rows = rows_per_program(d)
    settings = {**_settings(x, E, precision), "C": rows, "GRADIENT": gradient}
    launch_fitting(_rows_kernel, (B * H, triton.cdiv(L, rows)), args, settings, TILES)
    return (d_x, d_off) if gradient else out


def _bidirectional_forward(
    q: Tensor, k: Tensor, v1: Tensor, q_off: Tensor, q_top: Tensor, k_off: Tensor, directions: Tensor,
    bias: Tensor | None, stabilizer: float, precision: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The sums (B, H, Lq, E) and the keys' state (B, H, M, E) (``q_top``, the index of each query's largest
    feature, is backward's)."""
    q, k, v1, q_off, k_off = contiguous_rows(q, k, v1, q_off, k_off)
    features = _features_args(q, directions, bias)
    kv = q.new_zeros(*q.shape[:2], directions.shape[-2], v1.shape[-1])  # added into, a share per segment
    _sum(k, k_off, v1, features, kv, 0.0, precision)
    return _rows(q, q_off, kv, features, stabilizer, precision), kv


def _bidirectional_backward(
    grad: Tensor, q: Tensor, k: Tensor, v1: Tensor, q_off: Tensor, q_top: Tensor, k_off: Tensor, directions: Tensor,
    bias: Tensor | None, kv: Tensor, stabilizer: float, precision: str,
) -> list[Tensor]:  # fmt: skip
    """The gradients of q, k, v1, q_off and k_off."""
    grad, q, k, v1, q_off, q_top, k_off, kv = contiguous_rows(grad, q, k, v1, q_off, q_top, k_off, kv)
    features = _features_args(q, directions, bias)
    d_kv = torch.zeros_like(kv)
    _sum(q, q_off, grad, features, d_kv, stabilizer, precision)
    d_q, d_q_off = _rows(q, q_off, kv, features, stabilizer, precision, g=grad, top=q_top)
    d_v1 = _rows(k, k_off, d_kv, features, 0.0, precision)
    d_k, d_k_off = _rows(k, k_off, d_kv, features, 0.0, precision, g=v1)
    return [d_q, d_k, d_v1, d_q_off, d_k_off]


def _key_state(k: Tensor, k_off: Tensor, v1: Tensor, directions: Tensor, bias: Tensor | None, precision: str) -> Tensor:
    """The keys' state ``sum_j phi(k_j) (x) v1_j`` (B, H, m, E) of keys k (B, H, L, d) with offsets k_off (B, H, L)
    and values v1 (B, H, L, E)."""
    k, k_off, v1 = contiguous_rows(k, k_off, v1)
    kv = k.new_zeros(*k.shape[:2], directions.shape[-2], v1.shape[-1])  # added into, a share per segment
    _sum(k, k_off, v1, _features_args(k, directions, bias), kv, 0.0, precision)
    return kv


def _register() -> None:
    """The kernels as custom operators (opaque to ``torch.compile``, which calls them between its own kernels), with
    their shapes for tracing and the scan's gradients. A second copy of this module (remote code beside the installed
    package) finds them registered and uses them. Their names carry the version of their signatures (``_v2``: with
    the index of each query's largest feature, for the stabilizer's gradient), so that a copy of an older version
    (a folder converted before) registers its own rather than call these with other arguments."""
    if hasattr(torch.ops.performer_hf, "causal_exp_scan_v2"):
        return
    library = torch.library
    row_max = library.custom_op("performer_hf::exp_row_max_v2", mutates_args=())(_row_max)
    forward = library.custom_op("performer_hf::causal_exp_scan_v2", mutates_args=())(_forward)
    backward = library.custom_op("performer_hf::causal_exp_scan_backward_v2", mutates_args=())(_backward)

    @row_max.register_fake
    def _(x, directions, bias, precision):
        return x.new_empty(x.shape[:3]), x.new_empty(x.shape[:3], dtype=torch.int32)

    @forward.register_fake
    def _(q, k, v1, q_off, q_top, k_off, shifts, directions, bias, kv0, shift0, stabilizer, precision):
        S = segments(q.shape[0] * q.shape[1], directions.shape[-2], q.shape[2])[0]
        starts = kv0.new_empty(*kv0.shape[:2], S, *kv0.shape[2:])
        return q.new_empty(*q.shape[:3], v1.shape[-1]), kv0.new_empty(kv0.shape), starts

    @backward.register_fake
    def _(grad, grad_kv, q, k, v1, q_off, q_top, k_off, shifts, directions, bias, starts, *rest):
        return [t.new_empty(t.shape) for t in (q, k, v1, q_off, k_off, grad_kv)]

    def setup_context(ctx, inputs, output):
        q, k, v1, q_off, q_top, k_off, shifts, directions, bias, _, shift0, ctx.stabilizer, ctx.precision = inputs
        ctx.has_bias = bias is not None
        tensors = (q, k, v1, q_off, q_top, k_off, shifts, directions, output[2], shift0)
        ctx.save_for_backward(*tensors, *((bias,) if ctx.has_bias else ()))

    def gradients(ctx, grad, grad_kv, _grad_starts):
        q, k, v1, q_off, q_top, k_off, shifts, directions, starts, shift0, *bias = ctx.saved_tensors
        bias = bias[0] if ctx.has_bias else None
        grad_kv = starts.new_zeros(*starts.shape[:2], *starts.shape[3:]) if grad_kv is None else grad_kv
        d_q, d_k, d_v1, d_q_off, d_k_off, d_kv0 = torch.ops.performer_hf.causal_exp_scan_backward_v2(
            grad, grad_kv, q, k, v1, q_off, q_top, k_off, shifts, directions, bias, starts, shift0,
            ctx.stabilizer, ctx.precision,
        )  # fmt: skip
        return d_q, d_k, d_v1, d_q_off, None, d_k_off, None, None, None, d_kv0, None, None, None

    library.register_autograd("performer_hf::causal_exp_scan_v2", gradients, setup_context=setup_context)


def _register_bidirectional() -> None:
    """The bidirectional sums as custom operators, as :func:`_register` does the scan."""
    if hasattr(torch.ops.performer_hf, "bidirectional_exp_sums_v2"):
        return
    library = torch.library
    forward = library.custom_op("performer_hf::bidirectional_exp_sums_v2", mutates_args=())(_bidirectional_forward)
    backward = library.custom_op("performer_hf::bidirectional_exp_sums_backward_v2", mutates_args=())(
        _bidirectional_backward
    )

    @forward.register_fake
    def _(q, k, v1, q_off, q_top, k_off, directions, bias, stabilizer, precision):
        return q.new_empty(*q.shape[:3], v1.shape[-1]), q.new_empty(*q.shape[:2], directions.shape[-2], v1.shape[-1])

    @backward.register_fake
    def _(grad, q, k, v1, q_off, q_top, k_off, *rest):
        return [t.new_empty(t.shape) for t in (q, k, v1, q_off, k_off)]

    def setup_context(ctx, inputs, output):
        q, k, v1, q_off, q_top, k_off, directions, bias, ctx.stabilizer, ctx.precision = inputs
        ctx.has_bias = bias is not None
        tensors = (q, k, v1, q_off, q_top, k_off, directions, output[1])
        ctx.save_for_backward(*tensors, *((bias,) if ctx.has_bias else ()))

    def gradients(ctx, grad, _grad_kv):
        q, k, v1, q_off, q_top, k_off, directions, kv, *bias = ctx.saved_tensors
        bias = bias[0] if ctx.has_bias else None
        d_q, d_k, d_v1, d_q_off, d_k_off = torch.ops.performer_hf.bidirectional_exp_sums_backward_v2(
            grad, q, k, v1, q_off, q_top, k_off, directions, bias, kv, ctx.stabilizer, ctx.precision
        )
        return d_q, d_k, d_v1, d_q_off, None, d_k_off, None, None, None, None

    library.register_autograd("performer_hf::bidirectional_exp_sums_v2", gradients, setup_context=setup_context)


def _register_key_state() -> None:
    """The keys' state as a custom operator, without a gradient (a cache's state: :func:`exp_key_state`)."""
    if hasattr(torch.ops.performer_hf, "exp_key_state"):
        return
    key_state = torch.library.custom_op("performer_hf::exp_key_state", mutates_args=())(_key_state)

    @key_state.register_fake
    def _(k, k_off, v1, directions, bias, precision):
        return k.new_empty(*k.shape[:2], directions.shape[-2], v1.shape[-1])


if triton is not None:
    _register()
    _register_bidirectional()
    _register_key_state()


def _constants(directions: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The features' directions and bias as the kernels take them: constants (no gradient reaches them)."""
    return directions.detach(), None if bias is None else bias.detach()


def _offsets(x: Tensor, directions: Tensor, bias: Tensor | None, precision: str) -> tuple[Tensor, Tensor, Tensor]:
    """For rows x (B, H, L, d): ``-|x|^2 / 2 - log sqrt(m)`` (differentiable), ``max_r log phi_r(x)`` (a constant)
    and that r (int32), each (B, H, L)."""
    with torch.no_grad():
        top, index = torch.ops.performer_hf.exp_row_max_v2(x.detach(), directions, bias, precision)
    base = -0.5 * x.pow(2).sum(-1) - 0.5 * math.log(directions.shape[-2])
    return base, (top + base).detach(), index


def _key_terms(
    k: Tensor, directions: Tensor, bias: Tensor | None, key_row: Tensor | None, mask: Tensor | None, precision: str
) -> tuple[Tensor, Tensor]:
    """Keys' offsets before any shift (differentiable) and their largest log-features (constants, ``EMPTY_SHIFT``
    for keys left out): k (B, H, L, d), key_row (B, H, L, 1) or None, mask (B, L) bool or None -> each (B, H, L)."""
    base, top, _ = _offsets(k, directions, bias, precision)
    if key_row is not None:
        base, top = base + key_row.squeeze(-1), top + key_row.squeeze(-1).detach()
    if mask is not None:
        top = top.masked_fill(~mask[:, None, :], EMPTY_SHIFT)
    return base, top


def _shifted(base: Tensor, shifts: Tensor, mask: Tensor | None) -> Tensor:
    """Keys' offsets ``base`` (B, H, L) relative to ``shifts`` (B, H, L or 1); -inf (no features) for keys left out."""
    k_off = base - shifts
    return k_off if mask is None else k_off.masked_fill(~mask[:, None, :], float("-inf"))


def _key_offsets(
    k: Tensor, directions: Tensor, bias: Tensor | None, key_row: Tensor | None, mask: Tensor | None, precision: str
) -> tuple[Tensor, Tensor]:
    """Keys' offsets relative to their largest log-feature, and that shift: arguments as :func:`_key_terms`'s ->
    (offsets (B, H, L), -inf for keys left out; shift (B, H))."""
    base, top = _key_terms(k, directions, bias, key_row, mask, precision)
    shift = top.amax(dim=-1).clamp_min(EMPTY_SHIFT)
    return _shifted(base, shift[..., None], mask), shift


def causal_exp_sums(
    q: Tensor,
    k: Tensor,
    v1: Tensor,
    directions: Tensor,
    bias: Tensor | None,
    stabilizer: float,
    key_row: Tensor | None,
    mask: Tensor | None,
    state: tuple[Tensor, Tensor] | None,
    precision: str = "pytorch",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """What :func:`.favor_exp.causal_exp_sums` computes, in the kernels: q, k (B, H, L, d), v1 (B, H, L, E), the
    :class:`.favor_exp.ExpFeatures` (directions, bias, stabilizer), key_row (B, H, L, 1) or None, mask (B, L) bool
    or None, state (kv (B, H, m, E), shift (B, H)) or None. -> (sums (B, H, L, E) relative to exp(q_shifts +
    shifts), q_shifts, shifts (B, H, L), the state after the call: kv (B, H, m, E), shift (B, H)), float32; the
    shifts are constants for autograd."""
    B, H, L, _ = q.shape
    m = directions.shape[-2]
    directions, bias = _constants(directions, bias)
    q_base, q_shifts, q_top = _offsets(q, directions, bias, precision)
    k_base, k_max = _key_terms(k, directions, bias, key_row, mask, precision)
    if state is None:
        kv0, shift0 = q.new_zeros(B, H, m, v1.shape[-1]), q.new_full((B, H), EMPTY_SHIFT)
    else:
        kv0, shift0 = state[0].to(q.dtype), state[1].to(q.dtype)
    shifts = torch.cummax(torch.maximum(k_max, shift0.detach()[..., None]), dim=-1).values  # s_j: running max
    k_off = _shifted(k_base, shifts, mask)
    out1, kv, _ = torch.ops.performer_hf.causal_exp_scan_v2(
        q, k, v1, q_base - q_shifts, q_top, k_off, shifts, directions, bias, kv0, shift0.detach(), float(stabilizer),
        precision,
    )  # fmt: skip
    shift = shifts[..., -1] if L else shift0.detach()
    return out1, q_shifts, shifts, kv, shift


def bidirectional_exp_sums(
    q: Tensor,
    k: Tensor,
    v1: Tensor,
    directions: Tensor,
    bias: Tensor | None,
    stabilizer: float,
    mask: Tensor | None,
    precision: str = "pytorch",
) -> Tensor:
    """What :func:`.favor_exp.bidirectional_exp_sums` computes, in the kernels: q (B, H, Lq, d), k (B, H, Lk, d),
    v1 (B, H, Lk, E), the :class:`.favor_exp.ExpFeatures` (directions, bias, stabilizer), mask (B, Lk) bool or None
    -> ``phi(q_i) . sum_j phi(k_j) v1_j`` (B, H, Lq, E), float32, each query's row relative to a scale of its own."""
    directions, bias = _constants(directions, bias)
    q_base, q_shifts, q_top = _offsets(q, directions, bias, precision)
    k_off, _ = _key_offsets(k, directions, bias, None, mask, precision)
    out, _ = torch.ops.performer_hf.bidirectional_exp_sums_v2(
        q, k, v1, q_base - q_shifts, q_top, k_off, directions, bias, float(stabilizer), precision
    )
    return out


def exp_key_state(
    k: Tensor,
    v1: Tensor,
    directions: Tensor,
    bias: Tensor | None,
    key_row: Tensor | None,
    mask: Tensor | None,
    precision: str = "pytorch",
) -> tuple[Tensor, Tensor]:
    """What :func:`.favor_exp.exp_key_state` computes, in the kernels (no gradient): k (B, H, L, d), v1 (B, H, L, E),
    directions and bias as :class:`.favor_exp.ExpFeatures`', key_row (B, H, L, 1) or None, mask (B, L) bool or None
    -> the state after every key, ``kv`` (B, H, m, E) relative to ``exp(shift)``, and ``shift`` (B, H): the largest
    key log-feature."""
    directions, bias = _constants(directions, bias)
    k_off, shift = _key_offsets(k, directions, bias, key_row, mask, precision)  # shift: the running max at the end
    return torch.ops.performer_hf.exp_key_state(k, k_off, v1, directions, bias, precision), shift
