"""The Triton kernels of the polynomial far field (``far_field_triton``) against the PyTorch forms and the dense
reference: on a CPU through Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` where there is
no CUDA device), on CUDA compiled. Float32 kernels against float64 PyTorch."""

import pytest
import torch

from performer_hf.favor import hybrid_attention
from performer_hf.modeling import far_field_polynomial, far_field_triton

from ..compiled_check import assert_one_graph_as_eager, assert_strides_do_not_matter
from ..hybrid_reference import random_qkv, reference, right_padding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(d: int, width: int, length: int = 70, seed: int = 0):
    """Keys w, queries u (1, 2, length, d) and weighted values wv1 (1, 2, length, width), float32 on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    w, u = (torch.randn(1, 2, length, d, generator=g) * 0.5 for _ in range(2))
    wv1 = torch.randn(1, 2, length, width, generator=g)
    return [t.to(DEVICE).requires_grad_() for t in (w, wv1, u)]


def _sums_and_gradients(state_fn, apply_fn, w, wv1, u, c2, probe):
    sums = apply_fn(u, state_fn(w, wv1, c2))
    return (sums, *torch.autograd.grad((sums * probe).sum(), (w, wv1, u)))


def _assert_relatively_close(got, want, tol):
    for a, b in zip(got, want, strict=True):
        error = (a.double() - b).abs().max() / b.abs().max()
        assert error < tol, f"relative error {error:.2e}"


@pytest.mark.parametrize(
    "d,width,c2,segment",
    [(d, width, c2, None) for d, width in ((16, 9), (32, 33), (64, 16)) for c2 in (0.25, 0.5)]
    + [(16, 9, 0.25, 64), (32, 33, 0.5, 64)],  # the state's rows in two segments
)
def test_the_kernels_give_the_sums_and_gradients_of_pytorch(d, width, c2, segment, monkeypatch):
    """State and sums forward, and the gradients of keys, values and queries, against the outer products in float64
    (70 rows: a partial second tile); the state's rows summed whole or in two segments, its 1 + d blocks of rows a
    group at a time (the last group partial)."""
    if segment:
        monkeypatch.setattr(far_field_triton, "MIN_STATE_SEGMENT", segment)
    assert far_field_triton.state_segments(2, d, 70)[0] == (2 if segment else 1)
    assert (1 + d) % far_field_triton.STATE_BLOCKS
    w, wv1, u = _rows(d, width)
    probe = torch.randn(1, 2, 70, width, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = _sums_and_gradients(far_field_triton.quadratic_state, far_field_triton.quadratic_apply, w, wv1, u, c2, probe)
    exact = [t.detach().cpu().double().requires_grad_() for t in (w, wv1, u)]
    want = _sums_and_gradients(
        far_field_polynomial.quadratic_state, far_field_polynomial.quadratic_apply, *exact, c2, probe.cpu().double()
    )
    _assert_relatively_close([t.cpu() for t in got], want, 1e-5)


def test_the_operators_take_rows_of_any_strides():
    """The three operators give the same outputs for rows that are not contiguous (inductor may pad them), and
    their fake outputs have the real ones' strides."""
    w, wv1, u = (t.detach() for t in _rows(16, 9))
    ops = torch.ops.performer_hf
    assert_strides_do_not_matter(ops.polynomial_far_state.default, [w, wv1, 0.25, "pytorch"])
    state = ops.polynomial_far_state(w, wv1, 0.25, "pytorch")
    assert_strides_do_not_matter(ops.polynomial_far_apply.default, [u, state, 0.25, "pytorch"])
    assert_strides_do_not_matter(ops.polynomial_far_grad_x.default, [u, wv1, state, 0.25, "pytorch"])


def test_the_far_field_takes_the_kernels_where_they_serve(monkeypatch):
    """``quadratic_state`` hands rows the kernels serve to them (their state: 1 + d + d^2 rows), and
    ``quadratic_apply`` recognises that state."""
    calls = []
    monkeypatch.setattr(far_field_polynomial, "triton_serves", lambda x, width: calls.append(width) or True)
    w, wv1, u = _rows(16, 9)
    state = far_field_polynomial.quadratic_state(w, wv1, 0.25)
    assert calls == [9] and state.shape == (1, 2, 1 + 16 + 16 * 16, 9)
    sums = far_field_polynomial.quadratic_apply(u, state)
    torch.testing.assert_close(sums, far_field_triton.quadratic_apply(u, state), rtol=0, atol=0)


def test_only_cuda_float32_rows_of_tile_dims_are_served(monkeypatch):
    assert far_field_triton.enabled()  # Triton is part of the test install
    monkeypatch.setenv("PERFORMER_HF_TRITON", "0")
    assert not far_field_triton.enabled()
    monkeypatch.delenv("PERFORMER_HF_TRITON")
    x = torch.zeros(1, 1, 4, 32)
    assert not far_field_triton.serves(x, 33)  # a CPU: the PyTorch forms
    if torch.cuda.is_available():
        assert far_field_triton.serves(x.cuda(), 33)
        assert not far_field_triton.serves(x.cuda().double(), 33)  # float64: PyTorch
        assert not far_field_triton.serves(torch.zeros(1, 1, 4, 24, device="cuda"), 33)  # not a power of two
        assert far_field_triton.serves(x.cuda(), 129)  # 128 columns in the tile, the last apart
        assert not far_field_triton.serves(x.cuda(), 130)  # wider values than a tile


def test_a_heads_values_and_the_normaliser_fill_a_tile_and_the_last_column_goes_apart():
    """d + 1 columns (d a power of two from 16) take a tile of d and the last apart; other widths a padded tile."""
    tiles = {width: far_field_triton.value_tiles(width) for width in (9, 16, 17, 24, 33, 65, 129)}
    assert tiles == {
        9: (16, False), 16: (16, False), 17: (16, True), 24: (32, False), 33: (32, True), 65: (64, True),
        129: (128, True),
    }  # fmt: skip


@pytest.mark.parametrize("padded", [False, True])
def test_hybrid_attention_through_the_kernels_matches_the_dense_reference(padded, monkeypatch):
    """The bidirectional hybrid with its far field in the kernels (as on CUDA, float32) against the dense reference in
    float64: outputs and gradients. (On a CPU the hybrid's own C++ kernels would take the call: off here.)"""
    monkeypatch.setenv("PERFORMER_HF_CPU_KERNELS", "0")
    states = []

    def counted_state(w, wv1, c2, precision):
        states.append(w.shape)
        return far_field_triton.quadratic_state(w, wv1, c2, precision)

    monkeypatch.setattr(far_field_polynomial, "triton_serves", lambda x, width: x.dtype == torch.float32)
    monkeypatch.setattr(far_field_polynomial, "triton_state", counted_state)
    q, k, v = random_qkv(head_dim=16)
    mask = right_padding(2, 45) if padded else None
    config = dict(far_field="poly2", center=True, local_window=7, num_global_tokens=1, routed_blocks=2)
    config.update(route_block_size=4, query_block_size=8)
    fast_inputs = [t.float().to(DEVICE).requires_grad_() for t in (q, k, v)]
    fast_mask = None if mask is None else mask.to(DEVICE)
    fast = hybrid_attention(*fast_inputs, key_padding_mask=fast_mask, **config)
    ref_inputs = [t.requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_inputs, mask=mask, **config)
    keep = torch.ones(2, 45, dtype=torch.bool) if mask is None else mask  # padded queries' outputs are unspecified
    fast, ref = fast.cpu() * keep[:, None, :, None], ref * keep[:, None, :, None]
    probe = torch.randn_like(ref)
    got = (fast, *torch.autograd.grad((fast * probe).sum(), fast_inputs))
    want = (ref, *torch.autograd.grad((ref * probe).sum(), ref_inputs))
    _assert_relatively_close([t.cpu() for t in got], want, 1e-5)
    assert states == [(2, 2, 45, 16)]  # the far field went through the kernels


def test_compiled_the_kernels_are_operators_of_the_graph():
    """Under ``torch.compile`` the kernels are custom operators, opaque to tracing: one graph without breaks, with
    eager's sums and gradients."""
    w, wv1, u = _rows(16, 9)

    def far_sums(w, wv1, u):
        return far_field_triton.quadratic_apply(u, far_field_triton.quadratic_state(w, wv1, 0.25))

    assert_one_graph_as_eager(far_sums, (w, wv1, u))


def test_the_products_take_float32_as_pytorch_does():
    """IEEE float32 by default; TF32 where ``torch.set_float32_matmul_precision`` lets PyTorch's products use it (read
    when the kernels run), and for attention whose inputs came in bfloat16 or float16."""
    x = torch.zeros(1, 1, 4, 32)
    assert far_field_triton.float32_precision() == "pytorch"
    assert (
        far_field_triton.float32_precision(torch.bfloat16) == far_field_triton.float32_precision(torch.half) == "tf32"
    )
    previous = torch.get_float32_matmul_precision()
    try:
        assert far_field_triton._launch_shape(x, 33, "pytorch")["PRECISION"] == "ieee"
        torch.set_float32_matmul_precision("high")
        # 33 columns: 32 and the last
        shape = {"D": 32, "EP": 32, "TAIL": True, "BLOCK": 64, "PRECISION": "tf32", "num_warps": far_field_triton.WARPS}
        assert far_field_triton._launch_shape(x, 33, "pytorch") == shape
    finally:
        torch.set_float32_matmul_precision(previous)
    assert far_field_triton._launch_shape(x, 33, "tf32")["PRECISION"] == "tf32"
