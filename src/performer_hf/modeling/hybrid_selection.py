"""The selection of hybrid attention: each block of queries' exact support, as candidate sets.

The queries are processed by blocks of ``query_block_size``, in slabs of blocks (:class:`QueryBlocking`). Block
``n`` reads its window keys ``[n * block_q - left, (n + 1) * block_q + right)``, the global keys and (bidirectional)
its routed key blocks (:mod:`.hybrid_routing`): one :class:`.CandidateSet` of C keys per block and kind, with a
(block_q, C) support mask. Every per-block tensor is built once for all blocks (views, one gather) and split into
slabs, so that backward gathers each gradient once instead of writing a full-size one per slab.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from .compiled_lengths import chunking, exporting, padded
from .hybrid_exact import CandidateSet
from .hybrid_keys import Keys, cat_keys, pad_keys, slice_keys
from .hybrid_routing import gather_blocks, key_blocks, route, route_width
from .hybrid_spec import HybridSpec, in_window
from .slabs import slab_sizes

Tensor = torch.Tensor


class ExtraKeys(NamedTuple):
    """Keys a query may compute exactly besides its own call's: the window buffer of earlier tokens (decoding) and
    the global keys (the first ``num_global_tokens`` of the sequence), each a :class:`.Keys` or None."""

    prefix: Keys | None
    globals_: Keys | None


class QueryBlocking:
    """How the L queries of a call are cut: N blocks of ``block_q`` (padded to a multiple of ``period``), in
    slabs of blocks sized so that each slab's largest temporary stays within the device's budget."""

    def __init__(self, x: Tensor, period: int, block_q: int, per_block: int):
        self.B, self.H, self.L = x.shape[:3]
        self.block_q, self.device = block_q, x.device
        if exporting():  # a count the program reads at run time (see chunking)
            period, periods = chunking(self.L, period)
            self.pad, self.N = periods * period - self.L, periods * (period // block_q)
        else:
            self.pad = -(-self.L // period) * period - self.L
            self.N = (self.L + self.pad) // block_q
        self.sizes = slab_sizes(self.N, per_block, "blocks", x.device)  # query blocks per slab
        self.starts = list(itertools.accumulate(self.sizes[:-1], initial=0))  # each slab's first query block

    def by_slab(self, t: Tensor) -> list[Tensor]:
        """(B, H, N, ...) -> its slabs along the block axis."""
        return t.split(self.sizes, dim=2)

    def blocked(self, t: Tensor) -> list[Tensor]:
        """(B, H, L, X) -> slabs of (B, H, n, block_q, X)."""
        return self.by_slab(padded(t, (0, 0, 0, self.pad)).view(self.B, self.H, self.N, self.block_q, -1))

    def positions(self, first_block: int, count: int, offset: int) -> Tensor:
        """(count, block_q, 1) the absolute positions of the queries of blocks ``first_block ...``."""
        first, stop = first_block * self.block_q, (first_block + count) * self.block_q
        return (torch.arange(first, stop, device=self.device) + offset).view(count, self.block_q, 1)

    def unblocked(self, slabs: list[Tensor]) -> Tensor:
        """Slabs of (B, H, n, block_q, X) -> (B, H, L, X)."""
        return torch.cat(slabs, dim=2).flatten(2, 3)[:, :, : self.L]


class Selection:
    """The exact support of every query of a call, as candidate sets per slab of query blocks.

    Args:
        x: (B, H, L, d) scaled queries; keys: the call's :class:`.Keys`; extra: the :class:`ExtraKeys`.
        spec: the settings; causal: the direction; offset: the absolute position of the call's first token.
        with_feats: whether the candidates carry far-field features (the bidirectional random-feature far fields
            subtract their kernel on the support).
    """

    def __init__(
        self, x: Tensor, keys: Keys, extra: ExtraKeys, spec: HybridSpec, causal: bool, offset: int, with_feats: bool
    ):
        self.x, self.keys, self.extra, self.spec, self.causal, self.offset = x, keys, extra, spec, causal, offset
        self.with_feats = with_feats
        self.left, self.right = spec.offsets(causal)
        block_q, block_k = spec.query_block_size, spec.route_block_size
        self.width = block_q + self.left + self.right if self.right >= 0 else 0
        self.nb_global = 0 if extra.globals_ is None else extra.globals_.y.shape[2]
        self.nb_candidates = self.width + self.nb_global + spec.routed_blocks * block_k
        d = x.shape[-1]
        widest = max(d, keys.values1.shape[-1], keys.feats.shape[-1] if with_feats else 1)
        # A slab's largest temporaries are its logits (block_q x C per block) and its candidates' fields (C x widest):
        # eagerly, budgeted as if their product were (what the CPU's budgets were tuned with). Traced (compiled), by
        # the larger of the two: each slab is a copy of the graph, whose compilation time grows with it (at 32K
        # tokens on a GPU, the product made 11 slabs)
        per_candidate = max(block_q, widest) if torch.compiler.is_compiling() else block_q * widest
        per_block = x.shape[0] * x.shape[1] * max(self.nb_candidates, 1) * per_candidate
        period = math.lcm(block_q, block_k) if spec.routed_blocks else block_q
        self.blocking = QueryBlocking(x, period, block_q, per_block)
        # built on first use (candidate sets and FlexAttention's mask need different parts); not cached_property,
        # whose lock (Python < 3.12) torch.compile cannot trace: each use would break the compiled graph
        self._padded_keys: Keys | None = None
        self._routes: tuple[Tensor, Tensor] | None = None

    @property
    def continues(self) -> bool:
        """Whether the call continues after a state (its first token is not the sequence's)."""
        return self.offset > 0

    @property
    def padded_keys(self) -> Keys:
        """The call's keys padded to the blocks' length (built when candidate sets are, not by the compiled path)."""
        if self._padded_keys is None:
            self._padded_keys = pad_keys(self.keys, 0, self.blocking.pad)
        return self._padded_keys

    def candidate_sets(self) -> list[list[CandidateSet]]:
        """Per slab of query blocks, its candidate sets (window, routed blocks, global keys; those that apply)."""
        per_slab = [[] for _ in self.blocking.sizes]
        for kind in (self._window, self._routed):
            for slab, candidates in enumerate(kind()):
                per_slab[slab].append(candidates)
        if self.nb_global:
            for slab, (first, count) in enumerate(zip(self.blocking.starts, self.blocking.sizes, strict=True)):
                per_slab[slab].append(self._globals(first, count))
        return per_slab

    def _expanded(self, keys: list[Tensor], support: Tensor, count: int) -> CandidateSet:
        B, H, block_q = self.x.shape[0], self.x.shape[1], self.spec.query_block_size
        keys = [t.expand(B, H, count, *t.shape[3:]) for t in keys]
        return CandidateSet(keys, support.expand(B, H, count, block_q, -1))

    def _window(self) -> list[CandidateSet]:
        """The window context: buffered keys (decoding) or nothing before, nothing after."""
        if not self.width:
            return []
        blocking, block_q, width = self.blocking, self.spec.query_block_size, self.width
        prefix = self.extra.prefix
        before = prefix if prefix is not None else slice_keys(self.keys, 0, 0)
        window = cat_keys(pad_keys(before, self.left - before.y.shape[2], 0), pad_keys(self.padded_keys, 0, self.right))
        band = torch.arange(width, device=self.x.device)[None, :] - torch.arange(block_q, device=self.x.device)[:, None]
        band = (band >= 0) & (band <= self.left + self.right)  # (block_q, width): i - left <= j <= i + right
        support = band & window.mask.unfold(1, width, block_q)[:, None, :, None, :]  # (B, 1, N, block_q, width)
        fields = [
            blocking.by_slab(t.unfold(2, width, block_q).transpose(-2, -1)) for t in window.fields(self.with_feats)
        ]
        return [
            self._expanded(list(keys), support_s, count)
            for *keys, support_s, count in zip(*fields, blocking.by_slab(support), blocking.sizes, strict=True)
        ]

    @property
    def routes(self) -> tuple[Tensor, Tensor]:
        """Each of the N query blocks' routed key blocks (:func:`.route`, slab by slab): the chosen blocks
        (B, H, N, t) and whether each choice is real (B, H, N, t). Bidirectional, with ``routed_blocks`` only.

        The slabs are sized by routing's own temporaries (:func:`.route_width`), not by the exact part's candidate
        sets: on a GPU, one slab at 8K tokens where those gave six, each a round of kernel launches."""
        if self._routes is None:
            self._routes = self._route()
        return self._routes

    def _route(self) -> tuple[Tensor, Tensor]:
        spec, blocking, keys = self.spec, self.blocking, self.keys
        (B, H), N, block_q, block_k = self.x.shape[:2], blocking.N, spec.query_block_size, spec.route_block_size
        blocks = key_blocks(pad_keys(keys, 0, -keys.y.shape[2] % block_k), block_k, spec.route_group_size)
        sizes = slab_sizes(N, B * H * route_width(blocks, spec.routed_blocks), "blocks", self.x.device)
        xq = padded(self.x, (0, 0, 0, blocking.pad)).view(B, H, N, block_q, -1).split(sizes, dim=2)
        q_mask = padded(keys.mask, (0, blocking.pad), value=False).view(B, N, block_q).split(sizes, dim=1)
        starts = itertools.accumulate(sizes[:-1], initial=0)  # each slab's first query block
        routes = [
            route(xq_s, q_mask_s, blocks, first, block_k, self.left, self.right, spec.routed_blocks)
            for xq_s, q_mask_s, first in zip(xq, q_mask, starts, strict=True)
        ]
        return torch.cat([chosen for chosen, _ in routes], dim=2), torch.cat([real for _, real in routes], dim=2)

    def _routed(self) -> list[CandidateSet]:
        """Each query block's routed key blocks, minus its window and the global tokens."""
        spec, blocking = self.spec, self.blocking
        if not spec.routed_blocks:
            return []
        N, block_k = blocking.N, spec.route_block_size
        chosen, chosen_real = self.routes  # (B, H, N, t)
        fields = [blocking.by_slab(gather_blocks(t, chosen, block_k)) for t in self.padded_keys.fields(self.with_feats)]
        key_pos = (chosen.unsqueeze(-1) * block_k + torch.arange(block_k, device=self.x.device)).flatten(-2)
        real = self.padded_keys.mask.gather(1, key_pos.flatten(1)).view(key_pos.shape)  # (B, H, N, R): real keys
        real = real & chosen_real.repeat_interleave(block_k, dim=-1)  # ... of blocks that qualified
        pos = blocking.positions(0, N, self.offset)  # (N, block_q, 1) absolute
        key_pos = key_pos.unsqueeze(-2)  # (B, H, N, 1, R)
        support = real.unsqueeze(-2) & ~in_window(pos, key_pos, self.left, self.right) & (key_pos >= self.nb_global)
        return [
            self._expanded(list(keys), support_s, count)
            for *keys, support_s, count in zip(*fields, blocking.by_slab(support), blocking.sizes, strict=True)
        ]

    def _globals(self, first: int, count: int) -> CandidateSet:
        """The global keys, for the queries of ``count`` blocks from ``first`` (those outside their window)."""
        globals_ = self.extra.globals_
        keys = [t.unsqueeze(2) for t in globals_.fields(self.with_feats)]
        pos = self.blocking.positions(first, count, self.offset)
        key_pos = torch.arange(self.nb_global, device=self.x.device)  # (G,)
        support = globals_.mask[:, None, None, None, :] & ~in_window(pos, key_pos, self.left, self.right)
        if self.causal:
            support = support & (key_pos <= pos)
        return self._expanded(keys, support, count)  # (B, 1, n, block_q, G)
