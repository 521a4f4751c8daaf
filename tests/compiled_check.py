"""The checks the custom operators' tests share: a function compiled (``aot_eager``, ``fullgraph``) against itself
eager, and an operator given rows of other strides (as a compiled caller may pass them)."""

import torch
from torch._dynamo.testing import CompileCounterWithBackend


def assert_one_graph_as_eager(function, leaves, rtol: float = 0.0, atol: float = 0.0) -> None:
    """``function(*leaves)`` traces into one graph without breaks, whose output and gradients (of its sum, with
    respect to ``leaves``) equal eager's within ``rtol`` / ``atol``."""
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(function, backend=counter, fullgraph=True)(*leaves)
        got = (compiled, *torch.autograd.grad(compiled.sum(), leaves))
    finally:
        torch._dynamo.reset()
    eager = function(*leaves)
    want = (eager, *torch.autograd.grad(eager.sum(), leaves))
    assert counter.frame_count == 1
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def padded_rows(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in rows padded by three elements: not contiguous, as inductor may pad rows."""
    if t.dim() == 0:
        return t
    storage = t.new_zeros(*t.shape[:-1], t.shape[-1] + 3)
    return storage[..., : t.shape[-1]].copy_(t)


def heads_last(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values laid out with its first two dims swapped (a (B, L, H, d) layout for (B, H, L, d)): dense, not
    contiguous, as a caller's transposed projections are."""
    if t.dim() < 2:
        return t
    return (
        t.transpose(0, 1).contiguous().transpose(0, 1)
        if t.dim() < 3
        else t.transpose(1, 2).contiguous().transpose(1, 2)
    )


def assert_strides_do_not_matter(op, args: list) -> None:
    """The custom operator ``op`` gives the same outputs for ``args`` with every tensor's rows padded, or laid out
    heads last, and its fake implementation (what ``torch.compile`` traces, and inductor checks at run time) the
    real outputs' shapes, dtypes and strides (``torch.library.opcheck``)."""
    want = _flat(op(*args))
    # the schema's test (no input mutated, no output aliased) once: it does not depend on the layout
    checks = {padded_rows: ("test_schema", "test_faketensor"), heads_last: ("test_faketensor",)}
    for layout, test_utils in checks.items():
        strided = [layout(a) if isinstance(a, torch.Tensor) else a for a in args]
        assert any(isinstance(a, torch.Tensor) and not a.is_contiguous() for a in strided)
        for a, b in zip(_flat(op(*strided)), want, strict=True):
            torch.testing.assert_close(a, b)
        torch.library.opcheck(op, strided, test_utils=test_utils)


def _flat(outputs) -> list[torch.Tensor]:
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
