"""The settings of hybrid attention (:class:`HybridSpec`, derived from a config) and its decoding state
(:class:`HybridState`): what every part of :mod:`.favor_hybrid` reads."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, ClassVar, NamedTuple

import torch

from .far_fields import get_far_field
from .favor_attention import refuse_other_state

Tensor = torch.Tensor


def window_offsets(local_window: int, causal: bool) -> tuple[int, int]:
    """(left, right): query i computes keys i - left ... i + right exactly (right = -1: none)."""
    if not local_window:
        return 0, -1
    if causal:
        return local_window - 1, 0
    left = (local_window - 1) // 2
    return left, local_window - 1 - left


def in_window(query_pos: Tensor, key_pos: Tensor, left: int, right: int) -> Tensor:
    """Whether each key lies in each query's window: i - left <= j <= i + right (broadcast shapes)."""
    gap = query_pos - key_pos
    return (gap >= -right) & (gap <= left)


@dataclass(frozen=True)
class HybridSpec:
    """The settings of hybrid attention; see :func:`.hybrid_attention` for each field's meaning. Validated on
    construction. A model derives it from its config (:meth:`from_config`): the fields are the config's, under
    the names of :attr:`CONFIG_NAMES` where they differ."""

    far_field: str = "softmax"
    local_window: int = 0
    num_global_tokens: int = 0
    routed_blocks: int = 0
    route_block_size: int = 8
    route_group_size: int = 0
    query_block_size: int = 16
    center: bool = False
    chunk_size: int = 128

    # the PerformerConfig field of each setting whose name differs there
    CONFIG_NAMES: ClassVar[dict[str, str]] = {
        "far_field": "attention_kernel",
        "center": "center_features",
        "chunk_size": "causal_chunk_size",
    }
    # the smallest value of each integer setting
    _LOWEST: ClassVar[dict[str, int]] = {
        "local_window": 0,
        "num_global_tokens": 0,
        "routed_blocks": 0,
        "route_block_size": 1,
        "route_group_size": 0,
        "query_block_size": 1,
        "chunk_size": 1,
    }

    def __post_init__(self):
        get_far_field(self.far_field)  # an unknown name raises, listing the far fields
        for name, low in self._LOWEST.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")

    @classmethod
    def config_fields(cls) -> dict[str, str]:
        """Each setting's config field name, by setting."""
        return {f.name: cls.CONFIG_NAMES.get(f.name, f.name) for f in fields(cls)}

    @classmethod
    def from_config(cls, config: Any) -> HybridSpec:
        """The spec of a config (a ``PerformerConfig``, or anything with its field names)."""
        return cls(**{name: getattr(config, field) for name, field in cls.config_fields().items()})

    @property
    def uses_projection(self) -> bool:
        """Whether the far field needs a random projection."""
        return get_far_field(self.far_field).uses_projection

    def offsets(self, causal: bool) -> tuple[int, int]:
        """The window's (left, right) offsets (:func:`window_offsets`)."""
        return window_offsets(self.local_window, causal)

    def covers(self, length: int, causal: bool) -> bool:
        """Whether every query of a ``length``-token input computes every key it sees exactly (its window or
        the global tokens reach them all): hybrid attention is then exact softmax attention."""
        left, right = self.offsets(causal)
        # how far every query's window reaches on its shorter side (-1: no window, not even the query itself)
        reach = -1 if right < 0 else (left if causal else min(left, right))
        # keys past the first num_global_tokens must all lie within that reach of every later query
        return length <= self.num_global_tokens + reach + 1

    def check_direction(self, causal: bool, fixed_centres: bool, stateful: bool) -> None:
        """Refuse settings that would read future tokens in causal attention, or a state without it."""
        if causal and self.routed_blocks:
            raise ValueError(
                "routed_blocks is bidirectional only: routing a block of queries reads all of their "
                "queries and keys, which would leak future tokens in causal attention. Use routed_blocks=0."
            )
        if causal and self.center and not fixed_centres:
            raise ValueError(
                "center=True computes centres from the whole sequence, which leaks the future in causal "
                "attention; pass fixed query_center and key_center (e.g. measured at conversion) instead."
            )
        if stateful and not causal:
            raise ValueError("initial_state / return_state only apply to causal attention (causal=True).")

    def check_state(self, state: HybridState, k: Tensor, v: Tensor, projection: Tensor | None) -> None:
        """The causal ``state`` continues a call of these settings on keys k (B, H, L, d) and values v (.., dv): built
        for the same batch and heads, far field (its features), key and value widths, window and global tokens (what
        it holds of them after ``state.length`` tokens). Shapes alone, read eagerly (a traced graph takes its state
        as it comes)."""
        if torch.compiler.is_compiling():
            return
        B, H, _, d = k.shape
        n, keep, globals_ = state.length, max(self.local_window - 1, 0), self.num_global_tokens
        features = far_width(self.far_field, projection.shape[0] if self.uses_projection else 0, d)
        differences = [
            ("batch x heads", tuple(state.far_kv.shape[:2]), (B, H)),
            (f"far-field features (far_field={self.far_field!r})", state.far_kv.shape[-2], features),
            ("value width + 1", state.far_kv.shape[-1], v.shape[-1] + 1),
            ("key width", state.keys.shape[-1], d),
            (
                f"window buffer (local_window={self.local_window}: min({n} tokens, {keep}))",
                state.keys.shape[2],
                min(n, keep),
            ),
            (f"global keys (num_global_tokens={globals_})", state.global_keys.shape[2], min(n, globals_)),
        ]
        fix = (
            "Continue a state with the batch, heads, far_field, projection, local_window and num_global_tokens it was "
            "built with, or start anew (initial_state=None)."
        )
        refuse_other_state("hybrid_attention", differences, fix)


@functools.cache
def far_width(far_field: str, rows: int, head_dim: int) -> int:
    """How many features the far field ``far_field`` gives on keys of width ``head_dim`` (with a projection of
    ``rows`` rows where it takes one): what a causal state holds per value column. Read from the far field itself, on
    zeros on the CPU, once per shape."""
    far = get_far_field(far_field)
    probe = torch.zeros(1, head_dim, dtype=torch.float64)
    projection = torch.zeros(rows, head_dim, dtype=torch.float64) if far.uses_projection else None
    parameter = torch.zeros((), dtype=torch.float64) if far.uses_parameter else None
    base, log = far.features(probe, projection, parameter)
    return (log if base is None else base).shape[-1]


class HybridState(NamedTuple):
    """Recurrent state of causal hybrid attention after a prefix of ``length`` tokens.

    Constant size in the prefix length: the far-field state plus the last ``local_window - 1``
    keys and values (a ring buffer in effect) and the ``num_global_tokens`` first ones.

    Attributes:
        far_kv: ``(B, H, D, dv + 1)``: ``sum_j phi_k(y_j) [v_j, 1]^T`` over the previous keys outside the next
            query's exact support (those before the buffer, except the global tokens), relative to ``far_shift``.
            A decoding step reads it as its far field, adds the one key that leaves the window, and never
            evaluates the far-field kernel on its support.
        far_shift: ``(B, H)``: running max of the key log-features (``-1e30`` when empty).
        keys, values: ``(B, H, local_window - 1, d)`` / ``(.., dv)``: the most recent raw keys/values.
        key_mask: ``(B, local_window - 1)``: True where the buffer holds a real token.
        global_keys, global_values: ``(B, H, G, d)`` / ``(.., dv)``: the first ``G <= num_global_tokens``
            raw keys/values (``G`` grows until the prefix is ``num_global_tokens`` long).
        global_mask: ``(B, G)``: True for real tokens.
        length: tokens consumed so far (the absolute position of the next token).
    """

    far_kv: Tensor
    far_shift: Tensor
    keys: Tensor
    values: Tensor
    key_mask: Tensor
    global_keys: Tensor
    global_values: Tensor
    global_mask: Tensor
    length: int
