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

An exported program (``torch.export`` with a dynamic length) must hold for every length: there a sequence is one
piece (memory still linear in its length). So far a bidirectional FAVOR+ model exports so; the causal chunk views
still guard on the chunk count. Outside a compiled graph these are the plain operations. What has not yet run
compiled with a symbolic length pins it (:func:`pin_length`: the hybrid on a GPU).
"""

import torch
import torch.nn.functional as F


def spans(length: int, size: int) -> list[tuple[int, int]]:
    """(start, stop) ranges of ``size`` positions covering ``range(length)`` (a compiled graph is guarded on their
    number); one range under ``torch.export``, whose program holds for every length of its range."""
    if torch.compiler.is_exporting():  # one graph for every length: the whole range in one piece
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


def pin_length(length: int) -> None:
    """Make ``length`` a constant of the graph being compiled: the graph is guarded on its exact value (one graph per
    length). Nothing outside a compiled graph."""
    if torch.compiler.is_compiling():
        (_,) = range(length, length + 1)  # dynamo iterates a range over its concrete values: a guard on the length
