"""The settings of sparse attention (:class:`SparseSpec`, derived from a config) and its decoding state
(:class:`SparseState`): what :mod:`.sparse_attention` reads."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, NamedTuple

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class SparseSpec:
    """Causal block-sparse attention: every query computes exact softmax over

    - its window: the keys of its own block up to itself and of the ``local_window // block_size`` blocks before;
    - the first ``num_global_tokens`` keys (attention sinks);
    - the ``select_blocks`` earlier key blocks that hold most of its attention among the selectable ones: ranked
      by the log-sum-exp of its logits over each block's keys (and the query heads that share a key/value head).

    ``budget``: 0 keeps every key block that leaves the window, so that any can be selected again (memory grows with
    the context, reads do not); with ``select_blocks=0`` nothing is kept beyond the window and the global tokens,
    whatever the budget (it is taken as 0).
    ``n > 0`` keeps ``n`` blocks, and decoding memory stops growing. Which ones, by ``ranking``:

    - ``"window"``: the blocks that received the most attention while they were in the window, pruned as blocks
      leave it. Causal: a prefill, a chunked continuation or decoding one token at a time computes what one full
      forward does. It cannot know what a later question will ask for.
    - ``"latest"``: the blocks that the last queries of each call attend to most (each call's last block of queries,
      softmax over the kept blocks; the sums accumulate over calls), pruned at the end of each call, as SnapKV
      compresses a prompt by the attention of its last tokens. Within a call every block is kept, so a prefill in
      one call computes what keeping every block does; decoding then reads only the kept blocks, so its outputs
      depend on where the prompt ended (they are not those of one full forward). A prompt prefilled in chunks
      (``generate(prefill_chunk_size=...)``) is pruned after each chunk like any call: once it passes the budget,
      its later chunks read only the blocks the earlier chunks' last queries kept, and it decodes otherwise than
      the prompt in one call.

    A model derives it from its config (:meth:`from_config`), under the names of :attr:`CONFIG_NAMES`.
    """

    local_window: int = 512
    num_global_tokens: int = 4
    block_size: int = 64
    select_blocks: int = 8
    budget: int = 0
    ranking: str = "window"

    CONFIG_NAMES: ClassVar[dict[str, str]] = {
        "block_size": "select_block_size",
        "budget": "select_budget",
        "ranking": "select_ranking",
    }
    RANKINGS: ClassVar[tuple[str, ...]] = ("window", "latest")
    _LOWEST: ClassVar[dict[str, int]] = {
        "local_window": 0,
        "num_global_tokens": 0,
        "block_size": 1,
        "select_blocks": 0,
        "budget": 0,
    }

    def __post_init__(self):
        if self.select_blocks == 0:  # nothing is ever selected: no block is worth keeping
            object.__setattr__(self, "budget", 0)
        for name, low in self._LOWEST.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{self.config_fields()[name]} must be an integer >= {low}, got {value!r}.")
        if self.ranking not in self.RANKINGS:
            raise ValueError(f"select_ranking must be one of {self.RANKINGS}, got {self.ranking!r}.")
        if self.local_window % self.block_size:
            raise ValueError(
                f"local_window={self.local_window} must be a multiple of select_block_size={self.block_size} for "
                f"attention_method='sparse' (the window is whole key blocks); use e.g. local_window="
                f"{max(1, round(self.local_window / self.block_size)) * self.block_size}."
            )
        if self.budget and self.budget < self.select_blocks:
            raise ValueError(
                f"select_budget={self.budget} keeps fewer key blocks than select_blocks={self.select_blocks} reads; "
                "raise select_budget (or set it to 0 to keep every block)."
            )

    @classmethod
    def config_fields(cls) -> dict[str, str]:
        """Each setting's config field name, by setting."""
        return {f.name: cls.CONFIG_NAMES.get(f.name, f.name) for f in fields(cls)}

    @classmethod
    def from_config(cls, config: Any) -> SparseSpec:
        """The spec of a config (a ``PerformerConfig``, or anything with its field names)."""
        return cls(**{name: getattr(config, field) for name, field in cls.config_fields().items()})

    @property
    def bounded(self) -> bool:
        """Whether key blocks that leave the window are dropped beyond a fixed number: a budget, or no selection
        (then nothing outside the window and the global tokens is ever read again)."""
        return self.budget > 0 or self.select_blocks == 0

    @property
    def window_blocks(self) -> int:
        """Whole key blocks before the query's own that its window holds."""
        return self.local_window // self.block_size

    @property
    def covered_length(self) -> int:
        """The positions whose queries read every earlier key exactly (no selection yet): the first blocks, up to a
        window and ``select_blocks`` blocks before the last."""
        return (self.window_blocks + 1 + self.select_blocks) * self.block_size

    def covers(self, length: int) -> bool:
        """Whether every query of a ``length``-token input reads every earlier key exactly (no selection)."""
        return length <= self.covered_length


class SparseState(NamedTuple):
    """What causal sparse attention keeps after ``length`` tokens (one per key/value head, never repeated for
    grouped-query attention).

    Attributes:
        keys, values: ``(B, Hkv, R, D)``: positions ``start ... length - 1``: every key with ``budget=0``
            (``start`` stays 0; the blocks before a query's window are its pool), else the window of the next query
            and the blocks after it.
        key_mask: ``(B, R)`` bool, True for real tokens.
        mass: ``(B, Hkv, ceil(R / block))`` float32: the attention each of those blocks received so far (what the
            bounded pool ranks blocks by when they leave the window, with ``ranking="window"``).
        pool_keys, pool_values: ``(B, Hkv, N, block, D)``: with a budget, the key blocks that left the window and
            were kept (empty with ``budget=0``).
        pool_mask: ``(B, Hkv, N, block)`` bool: real keys that are not global tokens.
        pool_score: ``(B, Hkv, N)`` float32: each pool block's rank: its mass when it left the window, or with
            ``ranking="latest"`` the attention it received from the last queries of the calls so far.
        global_keys, global_values: ``(B, Hkv, S, D)``: the first ``S <= num_global_tokens`` keys and values.
        global_mask: ``(B, S)`` bool.
        start: the position of ``keys[:, :, 0]`` (a block boundary: the blocks before it are in the pool or dropped).
        length: tokens consumed so far (the position of the next token).
    """

    keys: Tensor
    values: Tensor
    key_mask: Tensor
    mass: Tensor
    pool_keys: Tensor
    pool_values: Tensor
    pool_mask: Tensor
    pool_score: Tensor
    global_keys: Tensor
    global_values: Tensor
    global_mask: Tensor
    start: int
    length: int

    @classmethod
    def empty(cls, k: Tensor, v: Tensor, block: int) -> SparseState:
        """The state before the first token, for keys ``k`` and values ``v`` shaped (B, Hkv, ., D)."""
        B, Hkv, _, D = k.shape
        Dv = v.shape[-1]
        on = dict(device=k.device)
        return cls(
            keys=k.new_zeros(B, Hkv, 0, D),
            values=v.new_zeros(B, Hkv, 0, Dv),
            key_mask=torch.zeros(B, 0, dtype=torch.bool, **on),
            mass=torch.zeros(B, Hkv, 0, dtype=torch.float32, **on),
            pool_keys=k.new_zeros(B, Hkv, 0, block, D),
            pool_values=v.new_zeros(B, Hkv, 0, block, Dv),
            pool_mask=torch.zeros(B, Hkv, 0, block, dtype=torch.bool, **on),
            pool_score=torch.zeros(B, Hkv, 0, dtype=torch.float32, **on),
            global_keys=k.new_zeros(B, Hkv, 0, D),
            global_values=v.new_zeros(B, Hkv, 0, Dv),
            global_mask=torch.zeros(B, 0, dtype=torch.bool, **on),
            start=0,
            length=0,
        )
