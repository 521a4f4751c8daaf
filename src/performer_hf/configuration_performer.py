"""Performer model configuration."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

# Kept literal (not imported from the kernels) so this file stays self-contained when the
# Hub's remote-code loader copies it next to a checkpoint.
FAVOR_KERNELS = ("softmax", "softmax_hyperbolic", "softmax_trig", "relu", "elu")
ATTENTION_KERNELS = (*FAVOR_KERNELS, "exact")
FEATURE_COUPLINGS = ("orthogonal", "iid")
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
      features, `"softmax_hyperbolic"`, `"softmax_trig"`, `"relu"`, `"elu"`) or `"exact"` for plain
      softmax attention with the same weights (the reference the approximation is measured against).
    - `nb_features`: number of random features `m` per head (the paper's default 256).
    - `feature_coupling`: `"orthogonal"` (orthogonal random features) or `"iid"`.
    - `feature_row_norms`: `"chi"` (unbiased) or `"sqrt_d"` (regularised softmax kernel).
    - `projection_seed`: seed of the initial projections; layer `i` draws from `projection_seed + i`.
    - `feature_redraw_interval`: optimizer steps between feature redraws during training, applied
      by training code (`model.redraw_projections(seed)`); `None` keeps the features fixed.
      Forward never redraws.
    - `causal_chunk_size`: positions per chunk of the causal prefix-sum scan (speed/memory only).

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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layer_types(self) -> list[str]:
        """Cache layer type per block: FAVOR+ keeps a constant-size recurrent state
        (``"favor_attention"``, see ``cache_performer.py``), exact attention a key/value cache."""
        layer_type = "full_attention" if self.attention_kernel == "exact" else "favor_attention"
        return [layer_type] * self.num_hidden_layers

    def validate_layer_type(self):
        """Part of `@strict` validation. `layer_types` is derived from `attention_kernel` (checked in
        `validate_architecture`); its `"favor_attention"` entries name a cache layer type that
        `cache_performer.py` registers, outside transformers' list of built-in types."""

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
        if self.feature_redraw_interval is not None and self.feature_redraw_interval < 1:
            raise ValueError(
                "feature_redraw_interval must be a positive number of steps or None, "
                f"got {self.feature_redraw_interval}."
            )


__all__ = ["PerformerConfig"]
