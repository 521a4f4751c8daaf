"""The order that gives left-padded rows their own global tokens (:mod:`performer_hf.modeling.sink_order`), against
the order written out row by row, and the refusal of a chunked prefill that cached pads as global tokens."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from performer_hf.modeling.sink_order import sink_order, sinks_first


def _written_out(row: list[int], count: int, in_place: int) -> list[int]:
    """One row's order: its first ``count`` real keys among all but the last ``in_place`` first, then the rest."""
    movable = len(row) - in_place
    first = [i for i in range(movable) if row[i]][:count]
    return first + [i for i in range(len(row)) if i not in first]


@pytest.mark.parametrize("in_place", [0, 1, 3])
def test_the_order_moves_each_rows_first_real_keys_in_front(in_place):
    rows = [[1] * 10, [0] * 8 + [1] * 2, [0] * 3 + [1] * 7, [0] * 10, [0] * 9 + [1]]
    mask = torch.tensor(rows)
    order = sink_order(mask, 4, in_place=in_place)
    assert order.tolist() == [_written_out(row, 4, in_place) for row in rows]
    assert sink_order(torch.ones(2, 10, dtype=torch.long), 4) is None  # no row starts with a pad


def test_a_chunked_prefill_is_refused_only_for_rows_whose_global_tokens_were_not_all_cached():
    def attend(q, k, v, mask):
        return (q,)

    cached = 6
    mask = torch.tensor([[0] * 5 + [1] * 5, [0] * 10, [1] * 10])  # row 0: 2 of its 4 first real keys come later
    with pytest.raises(ValueError, match=r"Row 0 .* starts with 5 padding tokens, .* fixed by its first 6 positions"):
        sinks_first(attend, 4, mask, 10 - cached, 10)
    sinks_first(attend, 4, mask[1:], 10 - cached, 10)  # a row of pads only has no global tokens to lose
    sinks_first(attend, 1, mask, 10 - cached, 10)  # row 0's one global token was cached


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_compiled_chunked_prefill_is_refused_in_the_graph(backend):
    """Traced (torch.compile, whole graph), the refusal cannot read the mask on the host: it was skipped, and a row
    whose global tokens were pads went on with them. It is an assertion in the graph that raises the same advice,
    for the rows the eager rule refuses and no others; chunks after more cached keys share one dynamic graph (the
    message names no length, which would pin the graph to it)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)

    def attend(q, k, v, mask):
        return (q * 2,)

    @torch.compile(backend=counter, fullgraph=True)
    def prefill_chunk(q, k, mask):
        return sinks_first(attend, 4, mask, q.shape[2], k.shape[2])(q, k, k, mask)[0]

    q = torch.ones(3, 1, 4, 2)  # the call's 4 queries
    for cached in (6, 10, 14):
        k = torch.ones(3, 1, cached + 4, 2)
        refused = torch.ones(3, cached + 4, dtype=torch.long)
        refused[0, : cached - 1] = 0  # row 0: 3 of its 4 first real keys come in this call
        refused[1] = 0  # a row of pads only has no global tokens to lose
        with pytest.raises(RuntimeError, match=r"starts with padding tokens.*fixed by its first positions.*=None"):
            prefill_chunk(q, k, refused)
        accepted = refused.clone()
        accepted[0, cached - 4 :] = 1  # row 0's 4 global tokens were cached
        torch.testing.assert_close(prefill_chunk(q, k, accepted), q * 2)
    assert counter.frame_count <= 2  # the first length's graph, then one dynamic graph
