"""Compiles the Triton kernels of performer-hf for a GPU ahead of time, without one: what Triton's compiler checks
(shapes, types, layouts, shared memory) and its interpreter, which the other tests run them in, does not. Run as a
script in a process without ``TRITON_INTERPRET`` (in the interpreter a kernel is not compiled):

    python -m tests.triton_aot            # each kernel once, at the defaults' tiles (what the tests run)
    python -m tests.triton_aot --widest   # also the widest tiles the kernels take, in both precisions

The defaults' tiles: head dim 32, 33 value columns (32 in a tile, the last apart), query blocks of 16; the support
sums' products in TF32 (bfloat16 models), the far field's in IEEE float32 (float32 models). The widest: head dims of
128 (support sums) and 64 (far field), 129 value columns for the support sums, 65 and 128 for the far field, query
blocks of 64. The causal scan's (``favor_exp_triton``): see :func:`scan_configurations`; routing's
(``hybrid_routing_triton``): :func:`routing_configurations`. Cold, the 16 compile in about 20 s on two CPU cores.
"""

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from performer_hf.modeling import far_field_triton, favor_exp_triton, hybrid_routing_triton, hybrid_triton

TARGET = GPUTarget("cuda", 90, 32)  # Hopper (H100, H200): the GPUs the floors are measured on
SUPPORT_INTS = ("H", "L", "N", "R", "D1", "block_q", "width", "nb_global", "left", "right")


def _rows(names: str) -> dict:
    return dict.fromkeys(names.split(), "*fp32")


SUPPORT_FORWARD = {
    **_rows("X RQ QSCALE FAR KSHIFT Y V1 KLOG"),
    "MASK": "*i1",
    "ROUTES": "*i32",
    **_rows("FLOOR OUT SHIFT KMASS"),
}
SUPPORT_ROUTED = {
    **_rows("GRAD X RQ QSCALE FAR KSHIFT Y V1 KLOG"),
    "MASK": "*i1",
    **_rows("FLOOR SHIFT KMASS"),
    "PIECES": "*i32",
    "CHOOSERS": "*i32",
    **_rows("DY DV1 DKLOG"),
}
ROUTED_INTS = ("H", "L", "NKB", "D1", "block_q", "nb_global", "left", "right")
SUPPORT_BACKWARD = {
    **_rows("GRAD X RQ QSCALE FAR KSHIFT Y V1 KLOG"),
    "MASK": "*i1",
    "ROUTES": "*i32",
    **_rows("FLOOR SHIFT KMASS DX DRQ DQSCALE DFAR DY DV1 DKLOG"),
}


def compile_kernel(kernel, tensors: dict, ints, floats, constants: dict, options: dict | None = None) -> int:
    """Compile ``kernel`` for :data:`TARGET` with pointer arguments ``tensors`` (name: type), 32-bit integers
    ``ints``, float32 scalars ``floats``, ``constants`` (its constexprs) and launch ``options`` (``num_stages``);
    -> its shared memory in bytes."""
    signature = {**tensors, **dict.fromkeys(ints, "i32"), **dict.fromkeys(floats, "fp32")}
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=TARGET, options=options or {}).metadata.shared


def configurations(widest: bool):
    """(name, kernel, tensors, ints, floats, constants, options) for the support sums' and the far field's kernels:
    at the defaults' tiles, and with ``widest`` at the widest too; their launch options as the modules set them."""
    support = [(32, 33, 16, "tf32")] + ([(128, 129, 64, "ieee"), (128, 129, 64, "tf32")] if widest else [])
    for d, width, rows, precision in support:  # head dim, value columns (the mass's last, apart), BQ, precision
        tile = far_field_triton.padded_width(width - 1)
        constants = dict(D=d, EP=tile, BQ=rows, BLOCK_K=8, CH=hybrid_triton.CHUNK, PRECISION=precision)
        common = (SUPPORT_INTS, ("c2",), constants)
        stages = {"num_stages": hybrid_triton.STAGES}
        yield "support sums forward", hybrid_triton._forward_kernel, SUPPORT_FORWARD, *common, stages
        warps = {"num_warps": hybrid_triton.BACKWARD_WARPS, **stages}
        yield "support sums backward", hybrid_triton._backward_kernel, SUPPORT_BACKWARD, *common, warps
        routed = {key: value for key, value in constants.items() if key != "CH"}
        routed["KT"] = far_field_triton.padded_width(routed["BLOCK_K"])
        kernel = hybrid_triton._routed_backward_kernel
        yield "support sums routed backward", kernel, SUPPORT_ROUTED, ROUTED_INTS, ("c2",), routed, {}
    far = [(32, 33, "ieee")] + ([(64, 65, "ieee"), (64, 65, "tf32"), (64, 128, "tf32")] if widest else [])
    for d, width, precision in far:  # head dim, value columns (the last apart where value_tiles says)
        tile, tail = far_field_triton.value_tiles(width)
        constants = dict(D=d, EP=tile, TAIL=tail, BLOCK=far_field_triton.BLOCK_ROWS, PRECISION=precision)
        state, warps = {**constants, "A": far_field_triton.STATE_BLOCKS}, {"num_warps": far_field_triton.WARPS}
        state_ints = ("N", "E", "SEG", "SEGMENTS")
        yield "far field state", far_field_triton._state_kernel, _rows("X V S"), state_ints, ("c",), state, warps
        for name, kernel, tensors in (
            ("far field sums", far_field_triton._apply_kernel, _rows("X S OUT")),
            ("far field gradient", far_field_triton._grad_x_kernel, _rows("X G S OUT")),
        ):
            yield name, kernel, tensors, ("N", "E"), ("c",), constants, warps


ROUTE_TENSORS = {**_rows("QMEANS GMEANS GRADII"), "GKEYS": "*i1", "BMEANS": "*fp32", "BKEYS": "*i1"}
ROUTE_TENSORS.update({"CHOSEN": "*i64", "REAL": "*i1"})
ROUTE_INTS = ("H", "n", "Ng", "Nk", "group_size", "first_block", "block_q", "block_k", "left", "right")


def routing_configurations(widest: bool):
    """Routing's kernel (``hybrid_routing_triton``), as :func:`configurations` yields it: the default's (head dim 32,
    24 groups of 16 blocks) and with ``widest`` head dim 128 and the most candidates it takes (32 groups of 16)."""
    for d, chosen, size in [(32, 24, 16)] + ([(128, 32, 16)] if widest else []):
        tile = hybrid_routing_triton.MAX_GROUP_TILE
        constants = dict(D=d, DC=min(d, 32), QB=hybrid_routing_triton.QUERY_BLOCKS, GT=tile, T=chosen)
        constants.update(TP=triton.next_power_of_2(chosen), GP=size)
        options = {"num_warps": hybrid_routing_triton.WARPS}
        yield "routing", hybrid_routing_triton._route_kernel, ROUTE_TENSORS, ROUTE_INTS, (), constants, options


SCAN_INTS = ("H", "L", "M", "E", "S", "SEG", "dir_b", "dir_h", "bias_b", "bias_h")
SCAN_INPUTS = "Q K V1 QOFF KOFF SHIFTS DIR"


def _scan_kernels(bias: bool) -> list:
    """(name, kernel, tensors, ints, floats, writes) of the causal scan's kernels, the bias a pointer or None."""
    bias_type = "*fp32" if bias else "constexpr"
    with_bias = {**_rows(SCAN_INPUTS), "BIAS": bias_type}
    walk = {**_rows("K V1 KOFF SHIFTS DIR"), "BIAS": bias_type, **_rows("KV0 SHIFT0 KV CHUNKS")}
    grad_walk = {**_rows("GRAD GKV Q QOFF SHIFTS DIR"), "BIAS": bias_type, **_rows("SHIFT0 DKV0 DCHUNKS")}
    sums = {**with_bias, **_rows("SHIFT0 CHUNKS OUT")}
    queries = {"GRAD": "*fp32", **with_bias, **_rows("SHIFT0 CHUNKS"), "QTOP": "*i32", **_rows("DQ DQOFF")}
    keys = {"GRAD": "*fp32", **with_bias, **_rows("DCHUNKS DK DKOFF DV1")}
    per_chunk = [name for name in SCAN_INTS if name not in ("S", "SEG")]
    walks, stabilizer, kernels = {"WRITE_CHUNKS": True}, ("stabilizer",), favor_exp_triton
    return [
        ("causal scan keys' walk", kernels._state_walk_kernel, walk, SCAN_INTS, (), walks),
        ("causal scan chunks' sums", kernels._chunk_sums_kernel, sums, per_chunk, stabilizer, {}),
        ("causal scan queries' walk", kernels._state_grad_walk_kernel, grad_walk, SCAN_INTS, stabilizer, walks),
        ("causal scan query gradients", kernels._chunk_query_grad_kernel, queries, per_chunk, stabilizer, {}),
        ("causal scan key gradients", kernels._chunk_key_grad_kernel, keys, per_chunk, stabilizer, {}),
    ]


def _bidirectional_kernels(bias: bool, constants: dict, options: dict):
    """The bidirectional sums' kernels, as :func:`configurations` yields them: the state's sums, and the rows' sums
    and gradients (the pointers a mode does not read given as None)."""
    with_bias = {"BIAS": "*fp32" if bias else "constexpr"}
    ints = ("H", "L", "M", "E", "SEG", "dir_b", "dir_h", "bias_b", "bias_h")
    sums = {**_rows("X OFF W DIR"), **with_bias, "OUT": "*fp32"}
    yield "bidirectional sums", favor_exp_triton._sum_kernel, sums, ints, ("stabilizer",), constants, options
    # the rows (no gradient), the keys' gradients, the queries' (with TOP: each row's largest feature)
    modes = ((False, ("TOP", "G", "DX", "DOFF")), (True, ("TOP", "OUT")), (True, ("OUT",)))
    for gradient, unused in modes:
        rows = {**_rows("X OFF"), "TOP": "*i32", **_rows("G S DIR"), **with_bias, **_rows("OUT DX DOFF")}
        rows.update(dict.fromkeys(unused, "constexpr"))
        per_program = favor_exp_triton.rows_per_program(constants["D"])
        settings = {**constants, "C": per_program, "GRADIENT": gradient, **dict.fromkeys(unused)}
        name = (
            "bidirectional rows"
            if not gradient
            else "bidirectional rows' gradients" + (" (queries)" if "TOP" not in unused else "")
        )
        row_ints = [n for n in ints if n != "SEG"]
        yield name, favor_exp_triton._rows_kernel, rows, row_ints, ("stabilizer",), settings, options


def scan_configurations(widest: bool):
    """FAVOR+'s kernels (the causal scan's, the bidirectional sums'), as :func:`configurations` yields them, at the
    scan's first tiles (chunk and pipeline stages): FAVOR++ (with a bias) at the decoder's head dim 32 and 33 value
    columns (a tile of 32, the last apart: ``far_field_triton.value_tiles``); with ``widest`` also plain FAVOR+ (no
    bias) at head dim 64 and 65 value columns in IEEE float32, head dim 128 with 129 value columns, and 24 value
    columns (a tile of 32, none apart)."""
    tiles = [(32, 33, "tf32", True)]
    if widest:
        tiles += [(64, 65, "ieee", False), (128, 129, "tf32", True), (32, 24, "tf32", True)]
    first = {"C": favor_exp_triton.CHUNK, **favor_exp_triton.TILES[0]}
    for d, width, precision, bias in tiles:
        constants = dict(D=d, BM=favor_exp_triton.FEATURES_PER_PROGRAM, PRECISION=precision, C=first["C"])
        constants.update({} if bias else {"BIAS": None})
        tile, tail = far_field_triton.value_tiles(width)
        options = {"num_stages": first["num_stages"]}
        for name, kernel, tensors, ints, floats, writes in _scan_kernels(bias):
            if "S" not in ints:  # a program per chunk: its features a block at a time
                writes = {"BM": favor_exp_triton.SUM_FEATURES}
            yield name, kernel, tensors, ints, floats, {**constants, "EP": tile, "TAIL": tail, **writes}, options
        yield from _bidirectional_kernels(bias, {**constants, "EP": tile, "TAIL": tail}, options)
        row_max = {**_rows("X DIR"), "BIAS": "*fp32" if bias else "constexpr", "OUT": "*fp32", "TOP": "*i32"}
        ints = [name for name in SCAN_INTS if name not in ("E", "S", "SEG")]
        yield "causal scan row max", favor_exp_triton._row_max_kernel, row_max, ints, (), {**constants, "C": 64}, {}


def main(widest: bool) -> None:
    assert not os.environ.get("TRITON_INTERPRET"), "the interpreter compiles nothing: run without TRITON_INTERPRET"
    kernels = [*configurations(widest), *scan_configurations(widest), *routing_configurations(widest)]
    for name, kernel, tensors, ints, floats, constants, options in kernels:
        shared = compile_kernel(kernel, tensors, ints, floats, constants, options)
        print(f"{name} {constants} {options}: {shared} bytes of shared memory", flush=True)


if __name__ == "__main__":
    main(widest="--widest" in sys.argv[1:])
