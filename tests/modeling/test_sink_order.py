"""The order that gives left-padded rows their own global tokens (:mod:`performer_hf.modeling.sink_order`), against
the order written out row by row, and the refusal of a chunked prefill that cached pads as global tokens."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from performer_hf.modeling.sink_order import sink_order, sinks_first

from ..integrations.test_attention_interface import DECODERS, SPARSE, _ids, _load, _source


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


def test_a_prefill_in_one_token_chunks_is_refused_at_its_second_call():
    """A call of one query passes unread (a decoding step), but for the second of a sequence: its state was built by
    one key, which a row starting with a pad fixed as its global token (generate(prefill_chunk_size=1) on a
    left-padded batch ran, logits 0.12 from the one-call prefill, where chunks of 2 were refused)."""

    def attend(q, k, v, mask):
        return (q,)

    for mask in ([[1, 1], [0, 1]], [[1, 1], [0, 0]]):  # its first real token now, or later
        with pytest.raises(ValueError, match=r"Row 1 .* starts with a padding token, .* fixed by its first position"):
            sinks_first(attend, 1, torch.tensor(mask), 1, 2)
    sinks_first(attend, 4, torch.ones(2, 2, dtype=torch.long), 1, 2)  # no padding
    # decoding a row shorter than its global tokens (1 real one of 4), after a prompt of 5: carried, as before
    sinks_first(attend, 4, torch.tensor([[1] * 6, [0] * 4 + [1] * 2]), 1, 6)


def test_a_compiled_prefill_in_one_token_chunks_is_refused_in_the_graph():
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def second_call(q, k, mask):
        return sinks_first(lambda q, k, v, mask: (q * 2,), 1, mask, q.shape[2], k.shape[2])(q, k, k, mask)[0]

    q, k = torch.ones(2, 1, 1, 2), torch.ones(2, 1, 2, 2)
    with pytest.raises(RuntimeError, match=r"A row .* starts with a padding token.*prefill_chunk_size=None"):
        second_call(q, k, torch.tensor([[1, 1], [0, 1]]))
    torch.testing.assert_close(second_call(q, k, torch.ones(2, 2, dtype=torch.long)), q * 2)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("implementation", ["performer_hybrid", "performer_sparse"])
def test_generate_refuses_a_left_padded_batch_prefilled_in_one_token_chunks(implementation, tmp_path):
    """generate(prefill_chunk_size=1), row 1 after 4 pads: refused, naming the fix, as chunks of 2 and 4 are (it ran,
    logits 0.117 (sparse) and 9.8e-4 (hybrid) from the one-call prefill, with the short-prompt warning, whose advice
    did not fit a row of 26 real tokens). Unpadded, one-token chunks prefill what one call does."""
    _, folder = _source(DECODERS["llama"], tmp_path)
    settings = {"performer_hybrid": {"local_window": 8}, "performer_sparse": {**SPARSE, "select_ranking": "window"}}
    model = _load(folder, implementation, **settings[implementation])
    ids = _ids(2, 30)
    options = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    padded = torch.ones_like(ids)
    padded[1, :4] = 0
    with torch.no_grad():
        for chunk in (1, 2):
            with pytest.raises(ValueError, match=r"Row 1 .* starts with (a|4) padding token.*prefill_chunk_size=None"):
                model.generate(ids, attention_mask=padded, prefill_chunk_size=chunk, **options)
        chunked = model.generate(ids, prefill_chunk_size=1, **options)
        whole = model.generate(ids, **options)
    assert torch.equal(chunked.sequences, whole.sequences)
    for ours, theirs in zip(chunked.logits, whole.logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
