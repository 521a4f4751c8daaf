"""The bidirectional polynomial far field of hybrid attention in Triton kernels, for CUDA devices.

In PyTorch the far field's features (``1 + d + d (d + 1) / 2`` per row) go to memory between its matrix products: on
a GPU its time follows those bytes (``benchmarks/compiled_traffic.py``: 1.51 GB forward and backward for 12 heads x 4K
tokens, 8x at 32K). Here they live in registers, as in the CPU kernels (:mod:`.hybrid_compiled`), and each call reads
its inputs and writes its outputs once. The kernel ``1 + t + c t^2`` of ``t = x . y`` splits into a state over the
keys and its sums for each query, three kernels between them, forward and backward:

- ``state(X, V, c)``, (B, H, 1 + d + d^2, E): rows ``[sum_j v_j, X^T V]``, then for each ``a`` the (d, E) block
  ``c sum_j x_ja x_j (x) v_j`` (the full symmetric square: regular tiles); a program takes :data:`STATE_BLOCKS`
  consecutive blocks (one product) over a segment of the rows and adds them into the state;
- ``apply(X, S, c)``, (B, H, N, E): ``s_0 + x_i S_lin + c sum_ab x_ia x_ib S_ab`` for each row;
- ``grad_x(X, G, S, c)``, (B, H, N, d): the gradient of ``sum_i g_i . apply(X, S, c)_i`` with respect to X.

The state of keys w with weighted values wv1 is ``state(w, wv1, c2)``, its sums for queries u ``apply(u, S, 1)``.
Backward: ``d wv1 = apply(w, dS, c2)``, ``d w = grad_x(w, wv1, dS, c2)``; ``d u = grad_x(u, g, S, 1)``,
``d S = state(u, g, 1)``. Their matrix products take float32 as :func:`float32_precision` says (by default as
PyTorch's do, TF32 for bfloat16 and float16 attention): about 160 GFLOP forward and backward for 12 heads x 32K tokens
x 32 dims (the full square of d: 2x what the features need, traded for regular tiles). The values' last column (the
normaliser's weights) stays out of their tile, in reductions beside each product (:func:`value_tiles`: 33 columns
take a tile of 32, not 64; on Hopper, compiled ahead of time, 16-17 KB of shared memory where 25-33 KB were).
Tested on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``); :func:`serves` says where they run.
"""

from __future__ import annotations

import os

import torch

Tensor = torch.Tensor
BLOCK_ROWS = 64  # rows (keys or queries) per tile
# warps per program of every kernel here: compiled for Hopper (ptxas) at d = 32 and 33 value columns, the state's
# takes 128 registers and spills none (at 4 warps it spills), the sums' and gradient's spill 216 and 56 bytes (612 and
# 448 at 4 warps)
WARPS = 8
# The state kernel: a program takes STATE_BLOCKS blocks of the state (of d rows each: one product with the values)
# over a segment of the rows, about STATE_PROGRAMS programs in all, segments of at least MIN_STATE_SEGMENT rows. A
# program per block over all the rows read each head's rows 1 + d times, one after the other: ~3.4 GB at 12 heads x
# 32K x 32 dims, in 1.0 ms on an H200 (run 6's profile)
STATE_BLOCKS = 4
STATE_PROGRAMS = 4096
MIN_STATE_SEGMENT = 1024


try:  # Triton comes with torch's CUDA builds; on a CPU without it, nothing here runs (see serves)
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def enabled() -> bool:
    """Whether the kernels may run: Triton is there, and ``PERFORMER_HF_TRITON`` is not ``0`` (which turns them off:
    the PyTorch features instead)."""
    return triton is not None and os.environ.get("PERFORMER_HF_TRITON", "1") != "0"


def tiles_serve(x: Tensor, values_width: int, max_head_dim: int) -> bool:
    """What every Triton kernel here requires of its rows ``x`` (B, H, N, d) and their ``values_width`` value columns:
    CUDA where the kernels are :func:`enabled`, float32 (attention's compute dtype), d a power of two from 16 (the
    matrix products' smallest tile) to ``max_head_dim``, at most 128 value columns."""
    d = x.shape[-1]
    return (
        x.device.type == "cuda"
        and enabled()
        and x.dtype == torch.float32
        and 16 <= d <= max_head_dim
        and d & (d - 1) == 0
        and values_width <= 128
    )


def serves(x: Tensor, values_width: int) -> bool:
    """Whether the far field's kernels take rows ``x`` (B, H, N, d) with values ``values_width`` wide: as
    :func:`tiles_serve` says of the values' tile (:func:`value_tiles`), head dims up to 64."""
    return tiles_serve(x, value_tiles(values_width)[0], 64)


def padded_width(width: int) -> int:
    """A tile's width for ``width`` columns: a power of two, at least 16 (the matrix products' smallest tile)."""
    return max(16, 1 << (width - 1).bit_length())


def value_tiles(width: int) -> tuple[int, bool]:
    """How a kernel holds ``width`` value columns: (the width of their tile, whether the last column is apart). A
    power of two (16 or more) plus one, as a head's values and the normaliser's column come, keeps the power in the
    tile and its last column in reductions beside each product, for half the products of a tile padded to the next
    power (65 columns: 64, not 128); other widths take a tile padded to a power of two (:func:`padded_width`)."""
    head = width - 1
    if head >= 16 and head & (head - 1) == 0:
        return head, True
    return padded_width(width), False


_FITTING: dict[tuple, int] = {}  # per kind of launch that did not fit at first: the index of the tiles that did


def launch_fitting(kernel, grid: tuple, args: tuple, settings: dict, tiles: tuple[dict, ...]) -> None:
    """``kernel[grid](*args, **settings, **tile)`` with the first of ``tiles`` (compile-time settings, largest first)
    whose shared memory the GPU has, remembered for that kind of launch: a launch refused for its shared memory
    (``triton.runtime.OutOfResources``) runs again with the next."""
    key = (kernel, *sorted(settings.items()))
    for index in range(_FITTING.get(key, 0), len(tiles)):
        try:
            kernel[grid](*args, **settings, **tiles[index])
        except triton.runtime.OutOfResources:
            if index == len(tiles) - 1:
                raise
            continue
        if index:
            _FITTING[key] = index
        return


def float32_precision(inputs_dtype: torch.dtype = torch.float32) -> str:
    """How the kernels' matrix products take float32 for attention whose inputs came in ``inputs_dtype``: ``"tf32"``
    for bfloat16 and float16, whose own rounding (2^-8, 2^-11) is above TF32's of the operands (2^-11), at a fraction
    of IEEE float32's time; else ``"pytorch"``, as PyTorch's own products when the kernels run
    (``torch.set_float32_matmul_precision``: IEEE float32 by default, TF32 at "high" or "medium"; read then, not
    where a compiled graph is traced)."""
    return "tf32" if inputs_dtype in (torch.bfloat16, torch.float16) else "pytorch"


def input_precision(precision: str) -> str:
    """Triton's ``input_precision`` for a :func:`float32_precision`."""
    if precision == "pytorch":
        return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return precision


if triton is not None:  # defined at import, when Triton reads TRITON_INTERPRET (its interpreter: the tests on a CPU)

    @triton.jit
    def _state_kernel(
        X, V, S, N, E, SEG, SEGMENTS, c,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, BLOCK: tl.constexpr, A: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # program (group, segment, bh), one axis, the groups of a segment's rows next to each other (they read the same
        # rows): the state blocks r = A group ... A group + A - 1 (r = 0 the linear rows X^T V, r = 1 + a the quadratic
        # block a; each block's D rows follow the last's from row 1) over the segment's rows, one product, added into
        # S; the value columns in a tile (EP) and, with TAIL, the last apart. Group 0 also adds the values' sum (row 0).
        groups = tl.cdiv(1 + D, A)
        pid = tl.program_id(0).to(tl.int64)  # int64 offsets: B H N d passes 2^31
        group, segment, bh = pid % groups, pid // groups % SEGMENTS, pid // groups // SEGMENTS
        dims, cols, rows = tl.arange(0, D), tl.arange(0, EP), tl.arange(0, BLOCK)
        blocks = group * A + tl.arange(0, A)  # (A,)
        x_base, v_base = X + bh * N * D, V + bh * N * E
        s_base = S + bh * (1 + D + D * D) * E
        acc = tl.zeros((A * D, EP), dtype=tl.float32)
        acc_tail = tl.zeros((A * D,), dtype=tl.float32)
        ones = tl.zeros((EP,), dtype=tl.float32)
        ones_tail = tl.sum(tl.zeros((BLOCK,), dtype=tl.float32), axis=0)
        first = segment * SEG
        stop = tl.minimum(first + SEG, N)
        for start in range(first, stop, BLOCK):
            row = start + rows
            live = row < stop
            x = tl.load(x_base + row[:, None] * D + dims[None, :], mask=live[:, None], other=0.0)  # (BLOCK, D)
            v = tl.load(v_base + row[:, None] * E + cols[None, :], mask=live[:, None] & (cols[None, :] < E), other=0.0)
            v_tail = tl.where(live, 0.0, 0.0)
            if TAIL:
                v_tail = tl.load(v_base + row * E + EP, mask=live, other=0.0)  # (BLOCK,)
            # each block's factor per row (A, BLOCK): 1 for the linear rows, x_a for the quadratic block a
            quadratic = (blocks >= 1) & (blocks <= D)
            x_a = tl.load(x_base + row[None, :] * D + (blocks - 1)[:, None], mask=quadratic[:, None] & live[None, :])
            factors = tl.where((blocks == 0)[:, None], 1.0, tl.where(quadratic[:, None] & live[None, :], x_a, 0.0))
            lhs = tl.reshape(factors[:, None, :] * tl.trans(x)[None, :, :], (A * D, BLOCK))  # row a D + d: x_a x_d
            acc += tl.dot(lhs, v, input_precision=PRECISION)
            if TAIL:
                acc_tail += tl.sum(lhs * v_tail[None, :], axis=1)
            if group == 0:
                ones += tl.sum(v, axis=0)
                if TAIL:
                    ones_tail += tl.sum(v_tail, axis=0)
        state_rows = 1 + group * A * D + tl.arange(0, A * D)  # (A D,): the group's blocks' rows
        scale = tl.where(state_rows > D, c, 1.0)  # the quadratic blocks' rows: times c
        kept = state_rows < 1 + D + D * D
        tile_mask = kept[:, None] & (cols < E)[None, :]
        tl.atomic_add(s_base + state_rows[:, None] * E + cols[None, :], acc * scale[:, None], mask=tile_mask)
        if TAIL:
            tl.atomic_add(s_base + state_rows * E + EP, acc_tail * scale, mask=kept)
        if group == 0:
            tl.atomic_add(s_base + cols, ones, mask=cols < E)
            if TAIL:
                tl.atomic_add(s_base + EP, ones_tail)

    @triton.jit
    def _row_tile(X, S, N, E, D: tl.constexpr, EP: tl.constexpr, BLOCK: tl.constexpr):
        # program (bh, tile): the tile's rows (BLOCK,), which exist, the value columns (EP,), which exist, the rows of
        # X (BLOCK, D), their pointers and those of the head's state
        bh, tile = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        row, cols = tile * BLOCK + tl.arange(0, BLOCK), tl.arange(0, EP)
        live, keep = row < N, cols < E
        x_base, s_base = X + bh * N * D, S + bh * (1 + D + D * D) * E
        x = tl.load(x_base + row[:, None] * D + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)
        return bh, row, cols, live, keep, x, x_base, s_base

    @triton.jit
    def _state_rows(s_base, first, keep, E, D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr):
        # the D state rows from `first`: the linear block (first = 1) or a quadratic one (1 + D + a D), their tile
        # (D, EP) and, with TAIL, their last column (D,) (zero without)
        dims, cols = tl.arange(0, D), tl.arange(0, EP)
        tile = tl.load(s_base + (first + dims[:, None]) * E + cols[None, :], mask=keep[None, :], other=0.0)
        tail = tl.zeros((D,), dtype=tl.float32)
        if TAIL:
            tail = tl.load(s_base + (first + dims) * E + EP)
        return tile, tail

    @triton.jit
    def _apply_kernel(
        X, S, OUT, N, E, c,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        bh, row, cols, live, keep, x, x_base, s_base = _row_tile(X, S, N, E, D, EP, BLOCK)  # x: (BLOCK, D)
        s0 = tl.load(s_base + cols, mask=keep, other=0.0)  # (EP,)
        linear, linear_tail = _state_rows(s_base, 1, keep, E, D, EP, TAIL)
        acc = tl.dot(x, linear, input_precision=PRECISION) + s0[None, :]
        acc_tail = tl.sum(x * linear_tail[None, :], axis=1)  # (BLOCK,)
        quad = tl.zeros((BLOCK, EP), dtype=tl.float32)
        quad_tail = tl.zeros((BLOCK,), dtype=tl.float32)
        for a in range(D):
            s_a, s_a_tail = _state_rows(s_base, 1 + D + a * D, keep, E, D, EP, TAIL)  # (D, EP), (D,)
            x_a = tl.load(x_base + row * D + a, mask=live, other=0.0)
            quad += x_a[:, None] * tl.dot(x, s_a, input_precision=PRECISION)
            if TAIL:
                quad_tail += x_a * tl.sum(x * s_a_tail[None, :], axis=1)
        acc += quad * c
        out = OUT + bh * N * E + row * E
        tl.store(out[:, None] + cols[None, :], acc, mask=live[:, None] & keep[None, :])
        if TAIL:
            tl.store(out + EP, acc_tail + tl.load(s_base + EP) + quad_tail * c, mask=live)

    @triton.jit
    def _grad_x_kernel(
        X, G, S, OUT, N, E, c,
        D: tl.constexpr, EP: tl.constexpr, TAIL: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # d/dx_ic of g_i . (x_i S_lin + c sum_ab x_ia x_ib S_ab) = g_i . S_lin[c] + c sum_b x_ib g_i . (S_cb + S_bc)
        bh, row, cols, live, keep, x, x_base, s_base = _row_tile(X, S, N, E, D, EP, BLOCK)  # x: (BLOCK, D)
        dims = tl.arange(0, D)
        g_base = G + bh * N * E + row * E
        g = tl.load(g_base[:, None] + cols[None, :], mask=live[:, None] & keep[None, :], other=0.0)
        g_tail = tl.zeros((BLOCK,), dtype=tl.float32)
        if TAIL:
            g_tail = tl.load(g_base + EP, mask=live, other=0.0)
        linear, linear_tail = _state_rows(s_base, 1, keep, E, D, EP, TAIL)
        acc = tl.dot(g, tl.trans(linear), input_precision=PRECISION) + g_tail[:, None] * linear_tail[None, :]
        quad = tl.zeros((BLOCK, D), dtype=tl.float32)
        for a in range(D):
            s_a, s_a_tail = _state_rows(s_base, 1 + D + a * D, keep, E, D, EP, TAIL)  # (D, EP), (D,)
            m = tl.dot(g, tl.trans(s_a), input_precision=PRECISION)  # (BLOCK, D): g_i . S_ab for every b
            if TAIL:
                m += g_tail[:, None] * s_a_tail[None, :]
            x_a = tl.load(x_base + row * D + a, mask=live, other=0.0)
            quad += x_a[:, None] * m  # column b gains x_ia g_i . S_ab (the S_bc term, as a runs over b)
            quad += tl.where(dims[None, :] == a, tl.sum(x * m, axis=1)[:, None], 0.0)  # column a: sum_b x_ib g_i . S_ab
        acc += quad * c
        tl.store(OUT + bh * N * D + row[:, None] * D + dims[None, :], acc, mask=live[:, None])


def _launch_shape(x: Tensor, width: int, precision: str) -> dict:
    """The kernels' compile-time settings: tile widths (:func:`value_tiles`), their products' precision, warps."""
    tile, tail = value_tiles(width)
    precision = input_precision(precision)
    return {"D": x.shape[-1], "EP": tile, "TAIL": tail, "BLOCK": BLOCK_ROWS, "PRECISION": precision, "num_warps": WARPS}


def contiguous_rows(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors contiguous: every kernel reads rows in place, and a compiled caller may pass other strides (an
    operator's inputs, then, and its fake outputs are contiguous whatever it was given)."""
    return tuple(t.contiguous() for t in tensors)


def state_segments(batch_heads: int, head_dim: int, rows: int) -> tuple[int, int]:
    """How the state kernel cuts ``rows`` rows: (segments, rows per segment, a multiple of :data:`BLOCK_ROWS`), about
    :data:`STATE_PROGRAMS` programs in all, segments of at least :data:`MIN_STATE_SEGMENT` rows."""
    programs = batch_heads * triton.cdiv(1 + head_dim, STATE_BLOCKS)
    wanted = max(1, min(triton.cdiv(rows, MIN_STATE_SEGMENT), triton.cdiv(STATE_PROGRAMS, programs)))
    size = triton.cdiv(triton.cdiv(max(rows, 1), wanted), BLOCK_ROWS) * BLOCK_ROWS
    return triton.cdiv(max(rows, 1), size), size


def _state(x: Tensor, v: Tensor, c: float, precision: str = "pytorch") -> Tensor:
    """(B, H, N, d), (B, H, N, E) -> (B, H, 1 + d + d^2, E)."""
    x, v = contiguous_rows(x, v)
    B, H, N, d = x.shape
    E = v.shape[-1]
    out = torch.zeros(B, H, 1 + d + d * d, E, dtype=torch.float32, device=x.device)  # added into, a share per segment
    segments, size = state_segments(B * H, d, N)
    grid = (B * H * segments * triton.cdiv(1 + d, STATE_BLOCKS),)
    settings = {**_launch_shape(x, E, precision), "A": STATE_BLOCKS}
    _state_kernel[grid](x, v, out, N, E, size, segments, c, **settings)
    return out


def _apply(x: Tensor, s: Tensor, c: float, precision: str = "pytorch") -> Tensor:
    """(B, H, N, d), (B, H, 1 + d + d^2, E) -> (B, H, N, E)."""
    x, s = contiguous_rows(x, s)
    B, H, N, d = x.shape
    E = s.shape[-1]
    out = torch.empty(B, H, N, E, dtype=torch.float32, device=x.device)
    _apply_kernel[(B * H, -(-N // BLOCK_ROWS))](x, s, out, N, E, c, **_launch_shape(x, E, precision))
    return out


def _grad_x(x: Tensor, g: Tensor, s: Tensor, c: float, precision: str = "pytorch") -> Tensor:
    """(B, H, N, d), (B, H, N, E), (B, H, 1 + d + d^2, E) -> (B, H, N, d)."""
    x, g, s = contiguous_rows(x, g, s)
    B, H, N, d = x.shape
    E = s.shape[-1]
    out = torch.empty_like(x)
    _grad_x_kernel[(B * H, -(-N // BLOCK_ROWS))](x, g, s, out, N, E, c, **_launch_shape(x, E, precision))
    return out


# The kernels as custom operators (opaque to torch.compile, which calls them between its own fused kernels), with
# their shapes for tracing and the gradients of the state and the sums (module docstring). A second copy of this
# module (remote code beside the installed package) finds them registered and uses them; an older copy calls them
# without the precision, which then defaults to PyTorch's.
_OPS = {"polynomial_far_state": _state, "polynomial_far_apply": _apply, "polynomial_far_grad_x": _grad_x}
_SHAPES = {
    "polynomial_far_state": lambda x, v, c, precision="pytorch": (
        *x.shape[:2],
        1 + x.shape[-1] + x.shape[-1] ** 2,
        v.shape[-1],
    ),
    "polynomial_far_apply": lambda x, s, c, precision="pytorch": (*x.shape[:3], s.shape[-1]),
    "polynomial_far_grad_x": lambda x, g, s, c, precision="pytorch": x.shape,
}


def _state_backward(ctx, d_state: Tensor):
    x, v = ctx.saved_tensors
    ops, c, precision = torch.ops.performer_hf, ctx.c, ctx.precision
    d_x = ops.polynomial_far_grad_x(x, v, d_state, c, precision)
    return d_x, ops.polynomial_far_apply(x, d_state, c, precision), None, None


def _apply_backward(ctx, d_sums: Tensor):
    x, s = ctx.saved_tensors
    ops, c, precision = torch.ops.performer_hf, ctx.c, ctx.precision
    d_x = ops.polynomial_far_grad_x(x, d_sums, s, c, precision)
    return d_x, ops.polynomial_far_state(x, d_sums, c, precision), None, None


def _save_inputs(ctx, inputs, output):
    *tensors, ctx.c, ctx.precision = inputs
    ctx.save_for_backward(*tensors)


def _register() -> None:
    if hasattr(torch.ops.performer_hf, "polynomial_far_state"):
        return  # registered by another copy of this module
    for name, function in _OPS.items():
        op = torch.library.custom_op(f"performer_hf::{name}", mutates_args=())(function)
        op.register_fake(lambda *args, shape=_SHAPES[name]: args[0].new_empty(shape(*args), dtype=torch.float32))
    torch.library.register_autograd("performer_hf::polynomial_far_state", _state_backward, setup_context=_save_inputs)
    torch.library.register_autograd("performer_hf::polynomial_far_apply", _apply_backward, setup_context=_save_inputs)


if triton is not None:
    _register()


def quadratic_state(w: Tensor, wv1: Tensor, c2: float, precision: str = "pytorch") -> Tensor:
    """The far field's state of keys w (B, H, S, d) and weighted values wv1 (B, H, S, E), float32: (B, H,
    1 + d + d^2, E) (see the module docstring). ``precision``: the products' (:func:`float32_precision`)."""
    return torch.ops.performer_hf.polynomial_far_state(w, wv1, float(c2), precision)


def quadratic_apply(u: Tensor, state: Tensor, precision: str = "pytorch") -> Tensor:
    """The kernel sums (B, H, L, E) of queries u (B, H, L, d) from :func:`quadratic_state`."""
    return torch.ops.performer_hf.polynomial_far_apply(u, state, 1.0, precision)
