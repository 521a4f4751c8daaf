"""Performer model configuration."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .attention_methods import ATTENTION_METHODS

# Kept literal (not imported from the kernels) so this file stays self-contained when the
# Hub's remote-code loader copies it next to a checkpoint.
FAVOR_KERNELS = ("softmax", "softmax_hyperbolic", "softmax_trig", "relu", "elu")
# Far fields of performer_hf.favor_hybrid.hybrid_attention; the last three exist only there.
HYBRID_KERNELS = ("softmax", "softmax_hyperbolic", "softmax_opt", "taylor2", "poly2")
ATTENTION_KERNELS = (*FAVOR_KERNELS, "softmax_opt", "taylor2", "poly2", "exact")
FEATURE_COUPLINGS = ("orthogonal", "simplex", "iid")
FEATURE_ROW_NORMS = ("chi", "sqrt_d")
LAYER_NORM_POSITIONS = ("post", "pre")


@strict
class PerformerConfig(PreTrainedConfig):
    r"""Configuration of a Performer: a BERT / RoBERTa / GPT-2 style Transformer whose softmax
    attention is replaced by FAVOR+ (Choromanski et al., 2021).

    The architecture fields follow `BertConfig`. Three more fields let one architecture host the
    weights of all three source families exactly:

    - `layer_norm_position`: `"post"` (BERT, RoBERTa: LayerNorm after each residual, and on the
      embeddings) or `"pre"` (GPT-2: LayerNorm before attention and MLP, plus a final LayerNorm).
    - `position_offset`: `0` gives positions `0, 1, 2, ...` (BERT, GPT-2); RoBERTa uses
      `pad_token_id + 1` and counts only real tokens, padding gets position `pad_token_id`.
    - `is_decoder`: causal attention in `PerformerModel` (`PerformerForCausalLM` is always causal).

    FAVOR+ fields:

    - `attention_kernel`: a feature map of `performer_hf.favor` (`"softmax"` positive random
      features, `"softmax_hyperbolic"`, `"softmax_trig"`, `"relu"`, `"elu"`), a far field of the
      hybrid attention below (`"softmax"`, `"softmax_hyperbolic"`, `"softmax_opt"` = FAVOR++ optimal
      positive random features, `"taylor2"` / `"poly2"` = deterministic second-order polynomial
      kernels), or `"exact"` for plain softmax attention with the same weights (the reference the
      approximation is measured against; it ignores every field below).
    - `nb_features`: number of random features `m` per head (the paper's default 256; unused by
      `"taylor2"` and `"poly2"`).
    - `feature_coupling`: `"orthogonal"` (orthogonal random features), `"simplex"` (simplex random
      features, Reid et al. 2023: lower kernel-estimator MSE, still unbiased) or `"iid"`.
    - `feature_row_norms`: `"chi"` (unbiased) or `"sqrt_d"` (regularised softmax kernel).
    - `projection_seed`: seed of the initial projections; layer `i` draws from `projection_seed + i`.
    - `feature_redraw_interval`: optimizer steps between feature redraws during training, applied
      by training code (`model.redraw_projections(seed)`); `None` keeps the features fixed.
      Forward never redraws.
    - `causal_chunk_size`: positions per chunk of the causal prefix-sum scan (speed/memory only).
    - `exact_max_length`: bidirectional inputs of at most this many tokens get exact softmax attention
      (SDPA's fused kernels, no attention dropout, as for the approximations) instead of FAVOR+ or the
      hybrid: below the crossover length exact attention is faster, and it is the quality they
      approximate. `0`: never. Causal hybrid models: the first `exact_max_length` *positions* attend
      exactly, at any input length, so that cached decoding equals a full forward; the cache keeps their
      keys and values until the sequence passes them, then the hybrid's constant-size state. (Where the
      hybrid's window covers every key, it is exact attention anyway.)

    Hybrid attention (`performer_hf.favor_hybrid.hybrid_attention`): exact softmax on a sparse support
    per query plus the `attention_kernel` as a linear-time far field for every other key, sharing one
    normaliser. It is used whenever `attention_kernel` is `"softmax_opt"`, `"taylor2"` or `"poly2"`,
    or any of the fields below is set; with all of them at their defaults the kernels above run as
    plain FAVOR+ (`performer_hf.favor.favor_attention`).

    - `local_window`: `w` keys around each query computed exactly (bidirectional: `(w - 1) // 2`
      before, the rest after; causal: the query and the `w - 1` before). `0`: no window.
    - `num_global_tokens`: the first `g` tokens are exact keys for every query (and, bidirectionally,
      attend exactly to everything): BigBird's global tokens, where pretrained encoders park mass.
      Window and global tokens go by position, padding included: a left-padded row (batched
      generation) has pads in its first positions, so its outputs can differ slightly from the same
      prompt alone (with right padding they are the same).
    - `routed_blocks`: bidirectional only: each block of `query_block_size` queries also computes
      exactly its `routed_blocks` best key blocks of `route_block_size` keys (by the mean logit
      between the blocks). Causal models must keep it `0` (routing reads future tokens).
    - `route_group_size`: `G > 0`: routing scores only the key blocks of the `routed_blocks` groups of
      `G` consecutive key blocks that may hold the best ones (an upper bound from each group's mean and
      radius): the quadratic part of its cost (one bound per query block and group) is `G` times smaller;
      `0`: every key block is scored (quadratic in the length, `1 / (query_block_size * route_block_size)`
      of the logit matrix). The two
      choose the same blocks while the input has at most `routed_blocks * G * route_block_size` tokens.
    - `center_features`: centre queries and keys before the far-field kernel (the mean factor is kept
      exactly; the kernel only sees the smaller residuals). Bidirectional attention uses each
      sequence's own means; causal attention uses the fixed per-layer centres stored as the buffers
      `attention.query_center` / `attention.key_center` (measured at conversion; zeros until then),
      so that no position reads a later one.
    - `far_field_parameter`: FAVOR++'s `A` for `attention_kernel="softmax_opt"`: one number for every
      layer and head, or a `num_hidden_layers x num_attention_heads` list (calibrated at conversion).
      `None`: the closed-form optimum from each sequence's statistics (bidirectional only; causal
      models need fixed values).
    - `far_field_gain`: a positive factor on the hybrid's far-field kernel, against its exact support: one
      number for every layer and head, or a `num_hidden_layers x num_attention_heads` list (learned by
      attention transfer, which lowers it where the far field's estimate does more harm than good). `None`: 1.

    Example:

    ```python
    >>> from performer_hf import PerformerConfig, PerformerForMaskedLM
    >>> config = PerformerConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, nb_features=256)
    >>> model = PerformerForMaskedLM(config)
    ```
    """

    model_type = "performer"

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    use_cache: bool = True
    classifier_dropout: float | int | None = None
    is_decoder: bool = False
    tie_word_embeddings: bool = True

    layer_norm_position: str = "post"
    position_offset: int = 0

    attention_kernel: str = "softmax"
    nb_features: int = 256
    feature_coupling: str = "orthogonal"
    feature_row_norms: str = "chi"
    projection_seed: int = 0
    feature_redraw_interval: int | None = None
    causal_chunk_size: int = 128
    exact_max_length: int = 0

    local_window: int = 0
    num_global_tokens: int = 0
    routed_blocks: int = 0
    route_block_size: int = 8
    route_group_size: int = 0
    query_block_size: int = 16
    center_features: bool = False
    far_field_parameter: float | int | list[list[float | int]] | None = None
    far_field_gain: float | int | list[list[float | int]] | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def uses_hybrid_attention(self) -> bool:
        """Whether attention runs through the hybrid kernel (see the class docstring)."""
        if self.attention_kernel == "exact":
            return False
        return (
            self.attention_kernel not in FAVOR_KERNELS
            or self.local_window > 0
            or self.num_global_tokens > 0
            or self.routed_blocks > 0
            or self.center_features
            or self.far_field_parameter is not None
            or self.far_field_gain is not None
        )

    @property
    def attention_method(self) -> str:
        """The entry of ``attention_methods.ATTENTION_METHODS`` these settings select: ``"exact"``,
        ``"hybrid"`` (see :attr:`uses_hybrid_attention`) or ``"favor"``."""
        if self.attention_kernel == "exact":
            return "exact"
        return "hybrid" if self.uses_hybrid_attention else "favor"

    @property
    def has_attention_weights(self) -> bool:
        """Whether the model can return attention weights (``output_attentions``): only exact attention
        forms the (L x L) matrix; FAVOR+ and hybrid attention never do."""
        return ATTENTION_METHODS[self.attention_method].has_attention_weights

    def check_output_attentions(self, output_attentions: bool) -> None:
        """Raise a ``ValueError`` that names the fix when attention weights are asked of linear attention."""
        if output_attentions and not self.has_attention_weights:
            raise ValueError(
                f"output_attentions is not available for attention_kernel={self.attention_kernel!r}: linear "
                "attention never forms the attention matrix (config.has_attention_weights is False). Use "
                "attention_kernel='exact' to inspect attention weights."
            )

    def validate_output_attentions(self):
        """Part of `@strict` validation: as transformers refuses ``output_attentions`` for attention
        implementations that form no weights."""
        super().validate_output_attentions()
        self.check_output_attentions(self.output_attentions)

    @property
    def layer_types(self) -> list[str]:
        """Cache layer type per block, the attention method's: FAVOR+ keeps a constant-size recurrent
        state (``"favor_attention"``), hybrid attention that state plus its window and global keys
        (``"hybrid_attention"``; both in ``cache_performer.py``), exact attention a key/value cache."""
        return [ATTENTION_METHODS[self.attention_method].cache_layer_type] * self.num_hidden_layers

    def validate_layer_type(self):
        """Part of `@strict` validation. `layer_types` is derived from `attention_kernel` (checked in
        `validate_architecture`); its `"favor_attention"` / `"hybrid_attention"` entries name cache
        layer types that `cache_performer.py` registers, outside transformers' list of built-in types."""

    def layer_far_field_parameter(self, layer_idx: int) -> float | list[float] | None:
        """FAVOR++'s `A` for layer `layer_idx`: one number, one per head, or None (closed form per sequence)."""
        if isinstance(self.far_field_parameter, list):
            return self.far_field_parameter[layer_idx]
        return self.far_field_parameter

    def layer_far_field_gain(self, layer_idx: int) -> float | list[float] | None:
        """The far-field gain of layer `layer_idx`: one number, one per head, or None (1)."""
        if isinstance(self.far_field_gain, list):
            return self.far_field_gain[layer_idx]
        return self.far_field_gain

    def validate_architecture(self):
        """Part of `@strict` validation: reject settings the model cannot be built with."""
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )
        choices = {
            "attention_kernel": ATTENTION_KERNELS,
            "feature_coupling": FEATURE_COUPLINGS,
            "feature_row_norms": FEATURE_ROW_NORMS,
            "layer_norm_position": LAYER_NORM_POSITIONS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported; choose one of {allowed}.")
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "max_position_embeddings", "nb_features", "causal_chunk_size")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        if self.type_vocab_size < 0 or self.position_offset < 0:
            raise ValueError("type_vocab_size and position_offset must be >= 0.")
        if self.exact_max_length < 0:
            raise ValueError(f"exact_max_length must be >= 0 tokens (0: never exact), got {self.exact_max_length}.")
        if self.is_decoder and self.exact_max_length and self.attention_method == "favor":
            raise ValueError(
                f"exact_max_length={self.exact_max_length} with is_decoder=True needs the hybrid method (its cache "
                f"keeps the first positions' keys until the sequence passes them); FAVOR+ (attention_kernel="
                f"{self.attention_kernel!r}) keeps only its constant-size state. Set exact_max_length=0."
            )
        if self.feature_redraw_interval is not None and self.feature_redraw_interval < 1:
            raise ValueError(
                "feature_redraw_interval must be a positive number of steps or None, "
                f"got {self.feature_redraw_interval}."
            )
        self._validate_hybrid()

    def _validate_hybrid(self):
        """The hybrid-attention fields: ranges, kernels that can be a far field, causal restrictions."""
        for name in ("local_window", "num_global_tokens", "routed_blocks", "route_group_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 switches it off), got {getattr(self, name)}.")
        for name in ("route_block_size", "query_block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        self._validate_far_field_parameter()
        self._validate_far_field_gain()
        if not self.uses_hybrid_attention:
            return
        if self.attention_kernel not in HYBRID_KERNELS:
            raise ValueError(
                f"attention_kernel={self.attention_kernel!r} cannot be the far field of hybrid attention "
                "(local_window, num_global_tokens, routed_blocks, center_features, far_field_parameter or "
                f"far_field_gain is set); "
                f"choose one of {HYBRID_KERNELS}, or set those fields to 0 / False / None for plain FAVOR+."
            )
        if self.is_decoder and self.routed_blocks:
            raise ValueError(
                f"routed_blocks={self.routed_blocks} with is_decoder=True: routing reads every query and key of "
                "a block, which leaks future tokens in causal attention. Set routed_blocks=0 for causal models."
            )
        if self.is_decoder and self.attention_kernel == "softmax_opt" and self.far_field_parameter is None:
            raise ValueError(
                "attention_kernel='softmax_opt' with is_decoder=True needs a fixed far_field_parameter (FAVOR++'s A): "
                "the per-sequence optimum would read future tokens. Convert with --calibrate (or set "
                "far_field_parameter, e.g. -0.5)."
            )

    def _validate_far_field_parameter(self):
        value = self.far_field_parameter
        if value is None:
            return
        if self.attention_kernel not in ("softmax_opt", "exact"):
            raise ValueError(
                f"far_field_parameter is FAVOR++'s A and only applies to attention_kernel='softmax_opt' "
                f"(got attention_kernel={self.attention_kernel!r}); set it to None."
            )
        largest = max(self._per_head_values("far_field_parameter"))
        if largest >= 0.125:
            raise ValueError(f"far_field_parameter (FAVOR++'s A) must be below 1/8 (finite variance); got {largest}.")

    def _validate_far_field_gain(self):
        if self.far_field_gain is None:
            return
        if min(self._per_head_values("far_field_gain")) <= 0:
            raise ValueError(
                f"far_field_gain must be positive (a factor on the far-field kernel); got {self.far_field_gain}. "
                "Use None for 1."
            )

    def _per_head_values(self, name: str) -> list[float]:
        """The numbers of a field given as one number or per layer and head (checking the shape)."""
        value = getattr(self, name)
        if not isinstance(value, list):
            return [value]
        if len(value) != self.num_hidden_layers or any(len(row) != self.num_attention_heads for row in value):
            raise ValueError(
                f"{name} given per layer must be a list of num_hidden_layers={self.num_hidden_layers} lists of "
                f"num_attention_heads={self.num_attention_heads} numbers."
            )
        return [number for row in value for number in row]


__all__ = ["PerformerConfig"]
