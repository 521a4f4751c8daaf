"""Performer model configuration."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from .attention_methods import ATTENTION_METHODS, infer_method
from .far_fields import FAR_FIELDS
from .favor_features import FEATURE_MAPS
from .favor_projection import COUPLINGS, ROW_NORMS
from .sparse_spec import SparseSpec

LAYER_NORM_POSITIONS = ("post", "pre")


# the plain annotations of PerformerConfig's fields and the Python types each accepts (bool is not an int here)
_PLAIN_TYPES = {"int": (int,), "float": (float, int), "str": (str,), "bool": (bool,)}


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

    - `attention_method`: the attention that replaces softmax: `"favor"` (FAVOR+), `"hybrid"` (below), `"sparse"`
      (below, causal only) or `"exact"` (softmax attention with the same weights, the reference the
      approximations are measured against; it ignores every field below). Each method reads its own fields; a
      config of one method that sets another's (a FAVOR+ config with a `local_window`, say) is refused with the
      fix. `None` (configs
      saved before the field existed, or built without it) takes the method those fields always selected:
      `attention_kernel="exact"` is exact attention, a kernel that only the hybrid has (`"softmax_opt"`,
      `"taylor2"`, `"poly2"`) or any hybrid field away from its default the hybrid, anything else FAVOR+;
      the config then records it. `attention_kernel="exact"` always means exact attention.

    FAVOR+ fields (the hybrid's random-feature far fields read them too):

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
    - `accelerator_exact_max_length`: the same bidirectional crossover on accelerators (CUDA and the other non-CPU
      devices), where fused exact kernels (flash attention) stay faster than the approximations to longer inputs
      than on a CPU. `None`: `exact_max_length` there too. Bidirectional models only.

    Hybrid attention (`attention_method="hybrid"`, `performer_hf.favor.hybrid_attention`): exact softmax on a
    sparse support per query plus the `attention_kernel` as a linear-time far field for every other key,
    sharing one normaliser (its settings as a `HybridSpec`: `HybridSpec.from_config(config)`).

    - `local_window`: `w` keys around each query computed exactly (bidirectional: `(w - 1) // 2`
      before, the rest after; causal: the query and the `w - 1` before). `0`: no window.
    - `num_global_tokens`: the first `g` tokens are exact keys for every query (and, bidirectionally,
      attend exactly to everything): BigBird's global tokens, where pretrained encoders park mass.
      Causal, a left-padded row's (batched generation) global tokens are its first real tokens, as
      alone; windows go by position (the same real keys).
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

    Sparse attention (`attention_method="sparse"`, causal only; `performer_hf.modeling.sparse_attention`): exact
    softmax over a sparse support per query and nothing else (no far field). `local_window` and
    `num_global_tokens` as above, except that the window is whole key blocks: the query's own block and the
    `local_window // select_block_size` blocks before it (`local_window` must be a multiple of `select_block_size`).

    - `select_blocks`: each query also reads exactly the `select_blocks` earlier key blocks that hold the most of
      its attention (the log-sum-exp of its logits over each block's keys). `0`: the window and the global tokens
      only (StreamingLLM's shape).
    - `select_block_size`: keys per block.
    - `select_budget`: `0` keeps every key block that leaves the window (memory grows as a key/value cache does;
      what each query reads does not); `n` keeps `n` blocks, so that decoding memory stops growing (in the
      method's cache layer: plain `generate()` puts it in its cache after the prompt, `PerformerCache` holds it
      from the start).
    - `select_ranking`: which `n` blocks: `"window"` the ones that received the most attention while they were in
      the window (causal: cached decoding computes what a full forward does); `"latest"` the ones the last queries
      of each call (the end of the prompt, then each decoding step) attend to most, as SnapKV: a prefill computes
      what keeping every block does, and decoding reads the blocks the prompt's end chose.

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
    max_position_embeddings: int = field(
        default=512, metadata={"help": "tokens the model reads; the pretrained position table is tiled to fill it"}
    )
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

    # the attention fields: their help is the converter's command line (performer-hf convert --help)
    attention_method: str | None = field(default=None, metadata={"help": "favor, hybrid, sparse or exact"})
    attention_kernel: str = field(
        default="softmax",
        metadata={"help": "FAVOR+ kernel, hybrid far field (softmax_opt = FAVOR++, poly2, ...) or exact"},
    )
    nb_features: int = field(default=256, metadata={"help": "random features per head"})
    feature_coupling: str = field(default="orthogonal", metadata={"help": "orthogonal, simplex or iid"})
    feature_row_norms: str = field(default="chi", metadata={"help": "chi (unbiased) or sqrt_d"})
    projection_seed: int = field(default=0, metadata={"help": "seed of the random features"})
    feature_redraw_interval: int | None = field(
        default=None, metadata={"help": "optimizer steps between feature redraws in training (None: never)"}
    )
    causal_chunk_size: int = field(default=128, metadata={"help": "positions per chunk of the causal scan"})
    exact_max_length: int = field(
        default=0,
        metadata={
            "help": "bidirectional: inputs of at most this many tokens keep exact attention; causal: the "
            "first this many positions attend exactly; 0: never"
        },
    )
    accelerator_exact_max_length: int | None = field(
        default=None,
        metadata={"help": "bidirectional, on accelerators: exact_max_length there (None: the same as on a CPU)"},
    )
    local_window: int = field(
        default=0, metadata={"help": "hybrid, sparse: keys around (sparse: before) each query computed exactly"}
    )
    num_global_tokens: int = field(
        default=0, metadata={"help": "hybrid, sparse: first tokens attended exactly by every query"}
    )
    routed_blocks: int = field(
        default=0, metadata={"help": "hybrid, bidirectional: key blocks per query block chosen by content"}
    )
    route_block_size: int = field(default=8, metadata={"help": "hybrid: keys per routed block"})
    route_group_size: int = field(
        default=0, metadata={"help": "hybrid: key blocks per routing group, scored together first (0: every block)"}
    )
    query_block_size: int = field(default=16, metadata={"help": "hybrid: queries per routing block"})
    center_features: bool = field(
        default=False, metadata={"help": "hybrid: centre queries and keys before the far field"}
    )
    far_field_parameter: float | int | list[list[float | int]] | None = field(
        default=None, metadata={"help": "hybrid: FAVOR++'s A for attention_kernel softmax_opt (None: closed form)"}
    )
    far_field_gain: float | int | list[list[float | int]] | None = field(
        default=None, metadata={"help": "hybrid: a factor on the far-field kernel against the exact support"}
    )

    select_blocks: int = field(
        default=0, metadata={"help": "sparse: earlier key blocks each query selects and reads exactly"}
    )
    select_block_size: int = field(default=64, metadata={"help": "sparse: keys per selectable block"})
    select_budget: int = field(
        default=0, metadata={"help": "sparse: key blocks kept once they leave the window (0: every block)"}
    )
    select_ranking: str = field(
        default="window",
        metadata={
            "help": "sparse, with select_budget: keep the blocks of most attention in the window (window, causal) "
            "or from each call's last queries (latest: the prompt's end chooses, as SnapKV)"
        },
    )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self, **kwargs):
        if self.attention_kernel == "exact" or self.attention_method is None:
            self.attention_method = infer_method(self.__dict__)  # recorded: saved configs name their method
        self._check_method_name()  # before any validator looks the method up
        super().__post_init__(**kwargs)

    def _check_method_name(self):
        if self.attention_method not in ATTENTION_METHODS:
            raise ValueError(
                f"attention_method={self.attention_method!r} is not supported; choose one of "
                f"{tuple(ATTENTION_METHODS)}."
            )

    @property
    def uses_hybrid_attention(self) -> bool:
        """Whether attention runs through the hybrid kernel (``attention_method == "hybrid"``)."""
        return self.attention_method == "hybrid"

    @property
    def has_attention_weights(self) -> bool:
        """Whether attention forms its weights as it attends (exact attention). FAVOR+, the hybrid and the sparse
        method never do; ``output_attentions`` gives the matrix they imply (``implied_attention.py``) for inputs of at
        most 1,024 tokens."""
        return ATTENTION_METHODS[self.attention_method].has_attention_weights

    @property
    def layer_types(self) -> list[str]:
        """Cache layer type per block, the attention method's: FAVOR+ keeps a constant-size recurrent
        state (``"favor_attention"``), hybrid attention that state plus its window and global keys
        (``"hybrid_attention"``; both in ``cache_performer.py``), exact attention a key/value cache."""
        return [ATTENTION_METHODS[self.attention_method].cache_layer_type] * self.num_hidden_layers

    def validate_layer_type(self):
        """Part of `@strict` validation. `layer_types` is derived from `attention_method` (checked in
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
        self._validate_types()
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )
        choices = {
            # FAVOR+'s feature maps, the hybrid's far fields, and "exact" (exact attention)
            "attention_kernel": tuple(dict.fromkeys([*FEATURE_MAPS, *FAR_FIELDS, "exact"])),
            "feature_coupling": COUPLINGS,
            "feature_row_norms": ROW_NORMS,
            "layer_norm_position": LAYER_NORM_POSITIONS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported; choose one of {allowed}.")
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "nb_features",
            "causal_chunk_size",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} is a probability, between 0 and 1; got {getattr(self, name)}.")
        if self.hidden_act not in ACT2FN:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not an activation of transformers; choose one of {sorted(ACT2FN)}."
            )
        if self.type_vocab_size < 0 or self.position_offset < 0:
            raise ValueError("type_vocab_size and position_offset must be >= 0.")
        self._validate_numbers()
        if self.exact_max_length < 0:
            raise ValueError(f"exact_max_length must be >= 0 tokens (0: never exact), got {self.exact_max_length}.")
        if self.accelerator_exact_max_length is not None and self.accelerator_exact_max_length < 0:
            raise ValueError(
                f"accelerator_exact_max_length must be >= 0 tokens or None, got {self.accelerator_exact_max_length}."
            )
        if self.is_decoder and self.accelerator_exact_max_length is not None:
            raise ValueError(
                f"accelerator_exact_max_length={self.accelerator_exact_max_length} with is_decoder=True: causal "
                "models attend exactly at their first exact_max_length positions on every device (so that cached "
                "decoding equals a full forward). Set accelerator_exact_max_length=None."
            )
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
        self.check_attention_settings()

    def _validate_numbers(self):
        """Numbers that would fail later, deep in torch, or give NaN outputs without an error."""
        if not 0 <= self.layer_norm_eps < math.inf:  # (NaN fails the comparison too)
            raise ValueError(f"layer_norm_eps must be a finite number >= 0 (e.g. 1e-12), got {self.layer_norm_eps}.")
        if not 0 <= self.initializer_range < math.inf:
            raise ValueError(f"initializer_range must be a finite number >= 0, got {self.initializer_range}.")
        if self.pad_token_id is not None and not -self.vocab_size <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id={self.pad_token_id} is not a token of the vocabulary (vocab_size={self.vocab_size}): "
                "give the tokenizer's pad token id, or None."
            )
        if self.position_offset and self.pad_token_id is None:
            raise ValueError(
                f"position_offset={self.position_offset} numbers the real tokens RoBERTa's way, which tells them from "
                "padding by pad_token_id: give pad_token_id, or set position_offset=0."
            )
        last_seed = self.projection_seed + self.num_hidden_layers - 1  # layer i draws from projection_seed + i
        if not -(2**63) <= self.projection_seed or last_seed >= 2**64:
            raise ValueError(
                f"projection_seed={self.projection_seed}: layer i draws its features from projection_seed + i, a "
                f"seed torch takes from -2**63 to 2**64 - 1; choose one from 0 to {2**64 - self.num_hidden_layers}."
            )
        problem_types = (None, "regression", "single_label_classification", "multi_label_classification")
        if getattr(self, "problem_type", None) not in problem_types:
            raise ValueError(f"problem_type={self.problem_type!r} is not supported; choose one of {problem_types}.")

    def _validate_types(self):
        """Each field this class declares with plain types (int, float, str, bool, or None) holds one of them: a
        string where a number belongs would fail later, deep inside a comparison, without the field's name."""
        for name, annotation in type(self).__annotations__.items():
            kinds = [kind.strip() for kind in str(annotation).split("|")]
            if not set(kinds) <= {*_PLAIN_TYPES, "None"}:  # lists, literals: their validators read them
                continue
            value = getattr(self, name)
            if value is None and "None" in kinds:
                continue
            allowed = tuple(python_type for kind in kinds if kind != "None" for python_type in _PLAIN_TYPES[kind])
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise ValueError(f"{name} must be {' or '.join(kinds)}, got {type(value).__name__} {value!r}.")

    def check_attention_settings(self):
        """Refuse attention settings the method cannot run, or fields it would ignore. Part of `@strict`
        validation, and run again when a model is built: a field set after the config was (a FAVOR+ config given a
        `local_window`) fails there, with the fix, instead of being ignored. `attention_kernel="exact"` set after the
        config was built is exact attention, as at construction."""
        if self.attention_kernel == "exact":
            self.attention_method = "exact"
        self._check_method_name()
        self._validate_ranges()
        self._validate_method()
        self._validate_hybrid()
        if self.attention_method == "sparse":
            SparseSpec.from_config(self)  # checks the window against the block size, and the budget

    def _validate_method(self):
        """The attention method against the fields it reads: one of its kernels, and no field of another method
        away from its default (it would be ignored)."""
        method = ATTENTION_METHODS[self.attention_method]
        if not method.fields:  # exact attention reads none of them
            return
        if method.kernels is not None and self.attention_kernel not in method.kernels:
            others = [
                name
                for name, entry in ATTENTION_METHODS.items()
                if entry.kernels and self.attention_kernel in entry.kernels
            ]
            raise ValueError(
                f"attention_kernel={self.attention_kernel!r} is not a kernel of attention_method="
                f"{self.attention_method!r}; choose one of {sorted(method.kernels)}"
                + (f", or set attention_method={others[0]!r}." if others else ".")
            )
        defaults = {f.name: f.default for f in dataclasses.fields(PerformerConfig)}
        every_field = dict.fromkeys(name for entry in ATTENTION_METHODS.values() for name in entry.fields)
        foreign = [name for name in every_field if name not in method.fields and getattr(self, name) != defaults[name]]
        if foreign:
            owners = [name for name, entry in ATTENTION_METHODS.items() if set(foreign) <= set(entry.fields)]
            if self.is_decoder and "exact_max_length" in foreign:  # a causal exact prefix is the hybrid's alone
                owners = [name for name in owners if name != "favor"] or owners
            owner = owners[0]
            raise ValueError(
                f"{', '.join(foreign)} {'is' if len(foreign) == 1 else 'are'} not read by attention_method="
                f"{self.attention_method!r} (the fields of {owner!r}): set attention_method={owner!r}, or leave "
                f"{'it' if len(foreign) == 1 else 'them'} at the default."
            )

    def _validate_ranges(self):
        """The hybrid's integer fields and gains, whatever the method (a wrong value is wrong everywhere)."""
        for name in ("local_window", "num_global_tokens", "routed_blocks", "route_group_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 switches it off), got {getattr(self, name)}.")
        for name in ("route_block_size", "query_block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        self._validate_far_field_gain()

    def _validate_hybrid(self):
        """The hybrid's far field: FAVOR++'s A, and what causal attention cannot do."""
        if self.attention_method != "hybrid":
            return
        far = FAR_FIELDS[self.attention_kernel]
        if self.far_field_parameter is not None:
            if not far.uses_parameter:
                raise ValueError(
                    f"far_field_parameter is FAVOR++'s A and only applies to attention_kernel='softmax_opt' "
                    f"(got attention_kernel={self.attention_kernel!r}); set it to None."
                )
            values = self._per_head_values("far_field_parameter")
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
                raise ValueError(f"far_field_parameter (FAVOR++'s A) must be finite numbers; got {values}.")
            largest = max(values)
            if largest >= 0.125:
                raise ValueError(
                    f"far_field_parameter (FAVOR++'s A) must be below 1/8 (finite variance); got {largest}."
                )
        if self.is_decoder and self.routed_blocks:
            raise ValueError(
                f"routed_blocks={self.routed_blocks} with is_decoder=True: routing reads every query and key of "
                "a block, which leaks future tokens in causal attention. Set routed_blocks=0 for causal models."
            )
        if self.is_decoder and far.uses_parameter and self.far_field_parameter is None:
            raise ValueError(
                f"attention_kernel={far.name!r} with is_decoder=True needs a fixed far_field_parameter (FAVOR++'s "
                "A): the per-sequence optimum would read future tokens. Convert with --calibrate (or set "
                "far_field_parameter, e.g. -0.5)."
            )

    def _validate_far_field_gain(self):
        if self.far_field_gain is None:
            return
        values = self._per_head_values("far_field_gain")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values) or min(values) <= 0:
            raise ValueError(
                "far_field_gain must be positive and finite (a factor on the far-field kernel); got "
                f"{self.far_field_gain}. Use None for 1."
            )

    def _per_head_values(self, name: str) -> list[float]:
        """The numbers of a field given as one number or per layer and head (checking the shape)."""
        value = getattr(self, name)
        if not isinstance(value, list):
            return [value]
        rows_fit = all(isinstance(row, list) and len(row) == self.num_attention_heads for row in value)
        if len(value) != self.num_hidden_layers or not rows_fit:
            raise ValueError(
                f"{name} given per layer must be a list of num_hidden_layers={self.num_hidden_layers} lists of "
                f"num_attention_heads={self.num_attention_heads} numbers."
            )
        return [number for row in value for number in row]


__all__ = ["PerformerConfig"]
