"""One compiled graph for many input lengths (:mod:`performer_hf.modeling.compiled_lengths`): a whole model under
``torch.compile`` compiles a graph per slab count, not per length, and its outputs and gradients are eager's."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from performer_hf import PerformerForCausalLM, PerformerForMaskedLM
from performer_hf.modeling import token_loss
from performer_hf.modeling.compiled_lengths import padded, spans
from performer_hf.modeling.vocabulary_projection import ALIGNMENT, MIN_ROWS, alignment_for

from ..tiny_models import HYBRID_BIDIRECTIONAL, METHODS, VOCAB, Logits, random_centres, tiny_model

# lengths that are and are not multiples of the causal chunk (8), all in one slab of the causal scan (16 chunks) and
# under the rows where the vocabulary projection pads its weight (a branch)
LENGTHS = [16, 32, 47, 90, 120]


@pytest.mark.parametrize("length,size", [(0, 4), (1, 4), (4, 4), (5, 4), (17, 4), (16, 16)])
def test_spans_cover_every_position_once_in_order(length, size):
    cover = spans(length, size)
    assert [position for start, stop in cover for position in range(start, stop)] == list(range(length))
    assert all(0 < stop - start <= size for start, stop in cover)


def test_padded_is_contiguous_when_compiled_even_with_nothing_to_pad():
    """A pad of 0 returns a copy with its input's strides; a graph traced with a symbolic pad expects a contiguous
    tensor and fails at its next view ("view size is not compatible") without the copy."""
    x = torch.randn(2, 5, 3, 4).transpose(1, 2)  # (2, 3, 5, 4), not contiguous

    @torch.compile(backend="aot_eager", dynamic=True)
    def pad_and_view(x):
        pad = -x.shape[2] % 5  # 0 at run time, symbolic in the graph
        return padded(x, (0, 0, 0, pad)).view(x.shape[0], -1)

    torch.testing.assert_close(pad_and_view(x), x.reshape(2, -1))


class _ShapeDecisions(torch.nn.Module):
    """The decisions a graph makes on its shapes, as a tensor: the pieces of a slab loop over 10 positions in 4s, the
    token loss's chunks of ``logits``' rows, and the row length the vocabulary product pads ``logits``' rows to."""

    def forward(self, logits):
        return logits.new_tensor([len(spans(10, 4)), len(token_loss._chunks(logits)), alignment_for(logits)])


def test_compiled_graphs_cut_and_pad_as_eager_does_and_exported_programs_do_not(monkeypatch):
    """Under ``torch.compile`` slab loops cut as eagerly (memory), the token loss takes its rows in one fused pass
    (its eager chunks, unrolled, made a compiled CPU training step at 16K tokens 1.4x-1.9x slower) and the vocabulary
    product is padded; an exported program, strict or not, which holds for every length, takes one piece, unpadded.
    (torch 2.11's dynamo answers ``torch.compiler.is_exporting()`` True under ``torch.compile`` too, which took
    compiled graphs there in one piece, unpadded.)"""
    from performer_hf.modeling import slabs as slabs_module

    monkeypatch.setitem(slabs_module.SLAB_ELEMENTS["cpu"], "loss", 64 * VOCAB)  # 64 rows per eager chunk
    logits = torch.randn(MIN_ROWS, VOCAB)
    eager = [3, MIN_ROWS // 64, ALIGNMENT]
    assert _ShapeDecisions()(logits).tolist() == eager
    torch._dynamo.reset()
    compiled = torch.compile(_ShapeDecisions(), backend="eager", fullgraph=True)
    assert compiled(logits).tolist() == [3, 1, ALIGNMENT]
    for strict in (False, True):  # a strict export traces with dynamo, as torch.compile does
        program = torch.export.export(_ShapeDecisions(), (logits,), strict=strict)
        assert program.module()(logits).tolist() == [1, 1, 1], strict


def _compiles_per_length(model, train: bool) -> list[int]:
    """Frames compiled at each of LENGTHS by ``torch.compile(model)``, whose outputs (and, training, gradients) are
    checked against eager."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")  # runs the traced graph, with its views, as traced
    compiled = torch.compile(model, backend=counter)
    embeddings = model.get_input_embeddings().weight
    frames = []
    for length in LENGTHS:
        ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        before = counter.frame_count
        with torch.set_grad_enabled(train):
            labels = ids if train else None
            expected, got = model(ids, labels=labels), compiled(ids, labels=labels)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
        if train:
            expected_grad, grad = (torch.autograd.grad(out.loss, [embeddings])[0] for out in (expected, got))
            torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
        frames.append(counter.frame_count - before)
    return frames


def test_a_compiled_favor_model_trains_at_new_lengths_without_compiling():
    """Before, ``range(0, length, size)`` in the slab loops pinned every graph to its length: a graph per length,
    and past torch's limit of 8 the model ran eagerly. Now the first length compiles a static graph, the second a
    graph with a symbolic length, and the next lengths reuse it."""
    model = tiny_model(PerformerForMaskedLM, max_position_embeddings=128, num_hidden_layers=1, **METHODS["favor"])
    model.train()
    frames = _compiles_per_length(model, train=True)
    assert frames[0] > 0 and frames[1] > 0 and frames[2:] == [0] * (len(LENGTHS) - 2), frames


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_a_compiled_causal_favor_model_reads_new_lengths_without_compiling(train):
    """The causal scan also looped over every chunk (a graph per chunk count): it now scans groups of chunks. Lengths
    that are multiples of the chunk and lengths that are not share the graph: the first unaligned one compiled once
    more, as aot_autograd guarded on whether the padded output's slice back to the length was contiguous (compiled,
    the scan now pads always)."""
    model = tiny_model(
        PerformerForCausalLM, max_position_embeddings=128, causal_chunk_size=8, num_hidden_layers=1, **METHODS["favor"]
    )
    model.train(train)
    frames = _compiles_per_length(model, train=train)
    assert frames[0] > 0 and frames[1] > 0 and frames[2:] == [0] * (len(LENGTHS) - 2), frames


def test_a_compiled_hybrid_model_trains_at_new_lengths_with_few_graphs():
    """The hybrid was pinned to one graph per length: with a symbolic length its padded query blocks failed their
    views (a pad of 0 kept its input's strides), and inductor mispredicted a causal block temporary's strides in
    backward (max / min in the leaving keys' count). On a CPU a bidirectional hybrid now compiles a graph with a
    symbolic length, which later lengths reuse but for one branch (query blocks that the window's keys fill or
    not). (A causal one shares its graph between aligned and unaligned lengths, as FAVOR+ does: one more graph than
    FAVOR+ at these lengths, with 8-position chunks.)
    """
    model = random_centres(
        tiny_model(PerformerForMaskedLM, max_position_embeddings=128, num_hidden_layers=1, **HYBRID_BIDIRECTIONAL)
    )
    model.train()
    frames = _compiles_per_length(model, train=True)
    assert frames[0] > 0 and frames[1] > 0 and sum(frames[2:]) <= 1, frames


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_a_bidirectional_favor_model_exports_one_program_for_every_length(monkeypatch, strict):
    """``torch.export`` with a dynamic length, without dynamo or with it (``strict``: dynamo traces it, as it does
    ``torch.compile``, whose slab loops cut by the length): the slab loops take the whole sequence in one piece and
    the vocabulary product its rows unpadded (a branch on the row count, which guarded the length to under 128 at a
    batch of 2); the exported program's logits equal eager's, which here cuts 37 and 130 tokens into slabs of 16."""
    from performer_hf.modeling import slabs as slabs_module

    monkeypatch.setitem(slabs_module.SLAB_ELEMENTS["cpu"], "features", 2 * 4 * 16 * 16)  # 16 positions per slab
    model = tiny_model(PerformerForMaskedLM, max_position_embeddings=256, **METHODS["favor"])

    length = torch.export.Dim("length", min=2, max=256)
    example = torch.randint(1, VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))
    program = torch.export.export(Logits(model), (example,), dynamic_shapes={"ids": {1: length}}, strict=strict)
    for tokens in (5, 37, 130):
        ids = torch.randint(1, VOCAB, (2, tokens), generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            torch.testing.assert_close(program.module()(ids), model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "method,shortest",
    [
        ({"attention_kernel": "softmax"}, 2),  # the exponential scan (favor_exp)
        ({"attention_kernel": "relu"}, 2),  # the generic one (causal_scan)
        # the window (4) and the global token cover inputs of up to 5 tokens, which take exact attention, and the
        # keys leaving the window branch on the length below 6
        (METHODS["hybrid"], 6),
    ],
    ids=["favor", "favor-relu", "hybrid"],
)
def test_a_causal_model_exports_one_program_for_every_length(method, shortest):
    """The causal chunk count was a function of the length (``ceil(L / C)`` chunks of ``C = min(chunk, L)``), and the
    chunk views and the slice back to ``L`` positions guarded on ``N == 1``, ``N * C == L`` and divisibility facts it
    could not prove for every length. Exported, the count is read at run time (:func:`.chunking`): the program's
    logits equal eager's at lengths shorter than a chunk (8), one chunk, and not a multiple of it, where eager cuts 130
    tokens into 2 slabs (of at most 16 chunks) and its scan groups."""
    model = tiny_model(PerformerForCausalLM, max_position_embeddings=256, causal_chunk_size=8, **method)
    length = torch.export.Dim("length", min=shortest, max=256)
    example = torch.randint(1, VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))
    program = torch.export.export(Logits(model), (example,), dynamic_shapes={"ids": {1: length}})
    for tokens in [tokens for tokens in (2, 3, 6, 8, 37, 130) if tokens >= shortest]:
        ids = torch.randint(1, VOCAB, (2, tokens), generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(program.module()(ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "model_class,method,message",
    [
        (PerformerForCausalLM, {**METHODS["hybrid"], "exact_max_length": 8}, "a causal hybrid with an exact prefix"),
        (PerformerForMaskedLM, {**HYBRID_BIDIRECTIONAL, "exact_max_length": 0}, "the bidirectional hybrid"),
    ],
    ids=["causal-with-prefix", "bidirectional"],
)
def test_a_hybrid_that_exports_one_length_at_a_time_says_so(model_class, method, message):
    """A dynamic length past a causal hybrid's exact prefix (the converter's preset) failed in export's constraint
    check on a wall of guards, a bidirectional hybrid's in torch's own suggested fix (an AssertionError): refused by
    name, with what exports."""
    model = tiny_model(model_class, max_position_embeddings=128, **method)
    example = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    dynamic = {"ids": {1: torch.export.Dim("length", min=2, max=60)}}
    with pytest.raises(ValueError, match=f"{message} exports one length at a time: export it without a Dim"):
        torch.export.export(Logits(model), (example,), dynamic_shapes=dynamic)


def test_a_causal_hybrid_exports_a_dynamic_length_within_its_exact_prefix():
    """One program for every length of a range the exact prefix holds (its refusal names it)."""
    model = tiny_model(PerformerForCausalLM, max_position_embeddings=128, exact_max_length=8, **METHODS["hybrid"])
    example = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    program = torch.export.export(Logits(model), (example,), dynamic_shapes={"ids": {1: torch.export.Dim("n", max=8)}})
    for tokens in (3, 8):
        ids = torch.randint(1, VOCAB, (2, tokens), generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            torch.testing.assert_close(program.module()(ids), model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
