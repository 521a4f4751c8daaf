"""Shape code that keeps one compiled graph valid for many input lengths.

Under ``torch.compile``, a dynamic length stays symbolic only while the Python around the tensors does not branch on
its exact value. Where attention cuts a sequence into pieces:

- loops count the pieces (:func:`spans`): ``range(0, length, size)`` pins the graph to one length;
- padding to a multiple always runs inside a graph (:func:`needs_padding`), so that aligned and unaligned lengths share
  it, and its output is contiguous there (:func:`padded`): a pad of 0 returns a copy with its input's strides, where the
  graph, traced with a symbolic pad, expects a contiguous tensor and its later views fail ("view size is not compatible
  with input tensor's size and stride");
- sizes derived from the length are sums, with branches rather than ``max`` / ``min`` where it matters
  (:class:`.hybrid_causal.LeavingKeys`): inductor could not prove ``max(0, min(L - 4, L - 3)) + 4`` equal to ``L``, and
  in a compiled causal hybrid's backward mispredicted a block temporary's strides (an AssertionError, torch 2.15).

An exported program (``torch.export`` with a dynamic length) must hold for every length: there a slab loop takes the
sequence in one piece (memory still linear in its length), and a count of chunks or query blocks is read at run time
(:func:`chunking`), with at least one padded position. A bidirectional and a causal FAVOR+ model export
so, and a causal hybrid for inputs longer than its window and global tokens (shorter ones take exact attention, and
its leaving keys branch on the length). Outside a compiled graph these are the plain operations. What has not yet
run compiled with a symbolic length pins it (:func:`pin_length`: the hybrid on a GPU).
"""

import torch
import torch.nn.functional as F


def spans(length: int, size: int) -> list[tuple[int, int]]:
    """(start, stop) ranges of ``size`` positions covering ``range(length)`` (a compiled graph is guarded on their
    number); one range under ``torch.export``, whose program holds for every length of its range."""
    if exported():  # one graph for every length: the whole range in one piece
        return [(0, length)]
    count = (length + size - 1) // size
    if count == 0:
        return []
    # (the last stop is the length itself, not min(stop, length): a compiled graph would guard on the minimum)
    return [(i * size, (i + 1) * size) for i in range(count - 1)] + [((count - 1) * size, length)]


def needs_padding(amount: int) -> bool:
    """Whether to pad by ``amount``: when it is not 0, and always inside a compiled graph."""
    return torch.compiler.is_compiling() or amount != 0


def padded(t: torch.Tensor, pad: tuple[int, ...], **kwargs) -> torch.Tensor:
    """``F.pad(t, pad, **kwargs)``, contiguous inside a compiled graph whatever the pad's run-time value."""
    # (a clone, not .contiguous(): whether a slice is contiguous can depend on the length, a guard)
    return F.pad(t.clone(memory_format=torch.contiguous_format) if torch.compiler.is_compiling() else t, pad, **kwargs)


def traced() -> bool:
    """Whether a graph is being compiled or exported: checks that read tensor values on the host are skipped."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def exported() -> bool:
    """Whether ``torch.export`` traces this call, with dynamo (``strict=True``) or without; not ``torch.compile``.
    Export's own flag: torch 2.11's dynamo answers ``torch.compiler.is_exporting()`` True under ``torch.compile`` too,
    where slab loops then took one piece and the vocabulary product lost its padding (a private name, set by export in
    torch 2.11 to 2.15; where it is gone, ``is_exporting()``)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def exporting() -> bool:
    """Whether ``torch.export`` traces this call without dynamo (its default, non-strict), where a size may be read at
    run time (:func:`chunking`; under dynamo, that of ``torch.compile`` or of a strict export, it breaks the graph)."""
    return exported() and not torch.compiler.is_dynamo_compiling()


def chunking(length: int, chunk: int) -> tuple[int, int]:
    """(C, N): ``N`` chunks of ``C`` positions that cover ``length`` (a pad of ``N * C - length``): ``C = min(chunk,
    length)`` and the fewest chunks. Under ``torch.compile``, ``C = chunk`` and ``N = length // C + 1``: at least
    one padded position, so that aligned and unaligned lengths share a graph (with a pad that could be 0, slicing
    the output back to ``length`` positions guarded on whether the slice was contiguous). Under ``torch.export``,
    ``C = chunk`` and ``N = max(length // C + 1, 2)``, an unbacked size (one the program reads at run time) that the
    shape environment knows only by ``N >= 2`` and ``N * C > length``: with ``N`` a function of the length, the
    chunk views and the slice back to ``length`` positions guarded on ``N == 1``, ``N * C == length`` and
    divisibility facts about floor divisions that it could not prove for every length. (An export with a static
    length reads it so too, and pads by 1 to ``chunk`` positions: masked keys, the same sums.
    ``torch.export(strict=True)`` traces with dynamo, which guards as before.)"""
    if torch.compiler.is_compiling() and not exporting():
        return chunk, length // chunk + 1
    if not exporting():
        size = min(chunk, length)
        return size, -(-length // size)
    # (a CPU scalar: a device tensor's .item() would wait for the device)
    count = torch.full((), length // chunk + 1, dtype=torch.int64, device="cpu").clamp_min(2).item()
    torch._check(count >= 2)
    torch._check(count * chunk > length)
    return chunk, count


def refuse_dynamic_length(length, what: str, fix: str) -> None:
    """Refuse, by name, to export ``what`` with a dynamic ``length`` (a ``torch.export.Dim``), which it cannot hold
    for every length (export's constraint check would fail on its guards, unexplained); ``fix``: what exports."""
    if exporting() and not isinstance(length, int):
        raise ValueError(
            f"{what} exports one length at a time: export it without a Dim on the sequence (a static length), {fix}."
        )


def pin_length(length: int) -> None:
    """Make ``length`` a constant of the graph being compiled: the graph is guarded on its exact value (one graph per
    length). Nothing outside a compiled graph."""
    if torch.compiler.is_compiling():
        (_,) = range(length, length + 1)  # dynamo iterates a range over its concrete values: a guard on the length
