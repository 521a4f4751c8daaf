"""A function compiled (``aot_eager``, ``fullgraph``) against itself eager: the check the custom operators' tests
share."""

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
