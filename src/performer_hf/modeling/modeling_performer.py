"""Performer model family: BERT / RoBERTa / GPT-2 style Transformers with FAVOR+ (or hybrid) attention.

Read top to bottom: embeddings, attention, MLP, layer, encoder, pre-trained base class, the
bare model, then one class per task head. Only sibling imports (``from .x import y``) are
used, so the Hub's remote-code loader can copy this file next to a checkpoint.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

from .attention_methods import ATTENTION_METHODS
from .configuration_performer import PerformerConfig
from .favor_hybrid import HybridSpec, get_far_field
from .favor_projection import draw_projection

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the decoding cache from `past_key_values` to `cache`, in `forward`'s arguments
# (what `generate` passes) and in the model outputs; earlier 5.x releases pass and read `past_key_values`.
# Detected from the output classes, so this file also works where it is copied as remote code.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithCrossAttentions.__dataclass_fields__ else "past_key_values"


def _cache_argument(cache: Cache | None, past_key_values: Cache | None, kwargs: dict) -> Cache | None:
    """The decoding cache, passed as ``cache`` or under an older name: ``past_key_values`` or (what
    transformers passes for recurrent caches) ``cache_params``, popped from ``kwargs``."""
    old_names = {"past_key_values": past_key_values, "cache_params": kwargs.pop("cache_params", None)}
    for name, value in old_names.items():
        if value is None:
            continue
        if cache is not None and cache is not value:
            raise ValueError(f"Got both cache and {name}, two names for the decoding cache: pass it once, as cache=.")
        if CACHE_FIELD == "cache":
            warnings.warn(
                f"`{name}` is deprecated since transformers 5.24: pass the decoding cache as `cache=`.",
                FutureWarning,
                stacklevel=3,
            )
        cache = value
    return cache


class PerformerEmbeddings(nn.Module):
    """Word + learned absolute position (+ token type) embeddings; LayerNorm for post-LN models."""

    def __init__(self, config: PerformerConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size > 0 else None
        )
        self.LayerNorm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            if config.layer_norm_position == "post"
            else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.position_offset = config.position_offset
        self.pad_token_id = config.pad_token_id
        self.max_positions = config.max_position_embeddings

    def make_position_ids(self, input_ids, batch, length, past_length, device) -> torch.Tensor:
        """(batch, length) position ids; RoBERTa-style (counting real tokens) when position_offset > 0."""
        if self.position_offset > 0 and input_ids is not None:
            real = (input_ids != self.pad_token_id).long()  # (B, L)
            return torch.cumsum(real, dim=1) * real + (self.position_offset - 1) + past_length
        start = past_length + self.position_offset
        return torch.arange(start, start + length, device=device).expand(batch, length)

    def _check_position(self, largest_id: int) -> None:
        if largest_id >= self.max_positions:
            raise ValueError(
                f"Position id {largest_id} is out of range: this model has max_position_embeddings="
                f"{self.max_positions}. Shorten the input, or convert with a larger --max-position-embeddings."
            )

    def forward(
        self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, past_length: int = 0
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (B, L, hidden)
        batch, length = inputs_embeds.shape[:2]
        if position_ids is None:
            # the largest derived id is past_length + length + position_offset - 1: a check on shapes only
            self._check_position(past_length + length + self.position_offset - 1)
            position_ids = self.make_position_ids(input_ids, batch, length, past_length, inputs_embeds.device)
        elif position_ids.numel() and not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            self._check_position(int(position_ids.max()))  # data-dependent: skipped while tracing
        embeddings = inputs_embeds + self.position_embeddings(position_ids)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(position_ids)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.LayerNorm is not None:
            embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


# buffers that a cast of the model to bfloat16 / float16 leaves in their (float32) precision
_FULL_PRECISION_BUFFERS = ("projection", "query_center", "key_center")


class PerformerAttention(nn.Module):
    """Multi-head self-attention computed by FAVOR+, by hybrid attention (exact on a sparse support,
    a linear far field elsewhere; see ``PerformerConfig``) or exactly (``attention_kernel="exact"``).

    Owns one random projection ``(nb_features, head_dim)`` shared by its heads: a persistent buffer,
    so a saved checkpoint reproduces its outputs. It changes only through :meth:`redraw_projection`.
    With ``center_features`` it also owns the fixed centres ``query_center`` / ``key_center``
    ``(heads, head_dim)`` (in units of the queries and keys times ``head_dim ** -0.25``) that causal
    hybrid attention centres on.
    """

    def __init__(self, config: PerformerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.kernel = config.attention_kernel
        self.chunk_size = config.causal_chunk_size
        self.feature_coupling = config.feature_coupling
        self.feature_row_norms = config.feature_row_norms
        self.attend = ATTENTION_METHODS[config.attention_method].attend
        if config.attention_method == "hybrid":
            self.hybrid_spec = HybridSpec(
                far_field=config.attention_kernel, local_window=config.local_window,
                num_global_tokens=config.num_global_tokens, routed_blocks=config.routed_blocks,
                route_block_size=config.route_block_size, query_block_size=config.query_block_size,
                center=config.center_features, chunk_size=config.causal_chunk_size,
            )  # fmt: skip
            self.uses_projection = get_far_field(config.attention_kernel).uses_projection
            # FAVOR++'s A: a float, a list of one per head, or None; a plain value, as models are built on `meta`
            self.far_field_parameter = config.layer_far_field_parameter(layer_idx)
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_prob = config.attention_probs_dropout_prob
        self.nb_features = config.nb_features
        # drawn here and again in `_init_weights` (models are also built on `meta`): the same seeded draw
        self.register_buffer("projection", self._draw(config.projection_seed + layer_idx), persistent=True)
        if config.center_features:
            self.register_buffer(
                "query_center", torch.zeros(self.num_heads, self.head_dim, dtype=torch.float32), persistent=True
            )
            self.register_buffer(
                "key_center", torch.zeros(self.num_heads, self.head_dim, dtype=torch.float32), persistent=True
            )

    def _draw(self, seed: int) -> torch.Tensor:
        """A ``(nb_features, head_dim)`` float32 projection drawn on the CPU from ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        return draw_projection(
            self.nb_features, self.head_dim, coupling=self.feature_coupling, row_norms=self.feature_row_norms,
            generator=generator, device="cpu", dtype=torch.float32,
        )  # fmt: skip

    def draw_projection(self, seed: int) -> torch.Tensor:
        """A fresh ``(nb_features, head_dim)`` projection, reproducible from ``seed``, where the current one lives."""
        return self._draw(seed).to(self.projection.device, self.projection.dtype)

    def _apply(self, fn, recurse=True):
        """``Module._apply`` (``.to``, ``.half()``, ...), except that a cast to bfloat16 / float16 leaves the
        projection and centres in their precision: features are computed in float32, and a rounded
        projection would be a different draw whose rows are no longer orthogonal."""
        kept = {name: buffer for name, buffer in self._buffers.items() if name in _FULL_PRECISION_BUFFERS}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype in (torch.bfloat16, torch.float16) and before.dtype not in (torch.bfloat16, torch.float16):
                self._buffers[name] = before.to(after.device)
        return self

    @torch.no_grad()
    def redraw_projection(self, seed: int) -> None:
        """Replace the random features by a fresh draw from ``seed``."""
        self.projection.copy_(self.draw_projection(seed))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_mask: torch.Tensor | None,
        causal: bool,
        cache: Cache | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend over the new tokens and, when ``cache`` is given, the cached ones.

        Args:
            hidden_states: (B, L, hidden), the L new tokens.
            key_mask: (B, P + L) bool, True for real tokens, covering the P cached tokens too.
            causal: mask future keys.
            cache: causal only; this layer's entry is read and updated in place: a
                :class:`FavorCacheLayer` (constant-size state) for FAVOR+, a :class:`HybridCacheLayer`
                for hybrid attention, keys/values for ``"exact"``.
            output_attentions: ``"exact"`` only: also return the weights (B, H, L, P + L).

        Returns:
            The output (B, L, hidden) and the attention weights or None.
        """
        q = self._split_heads(self.query(hidden_states))  # (B, H, L, D)
        k = self._split_heads(self.key(hidden_states))
        v = self._split_heads(self.value(hidden_states))
        context, weights = self.attend(self, q, k, v, key_mask, causal, cache, output_attentions)  # (B, H, L, D)
        batch, _, length, _ = context.shape
        context = context.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)  # (B, L, hidden)
        return self.output(context), weights


class PerformerMLP(nn.Module):
    def __init__(self, config: PerformerConfig):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(hidden_states)))


class PerformerLayer(GradientCheckpointingLayer):
    """One Transformer block, post-LN (BERT / RoBERTa) or pre-LN (GPT-2)."""

    def __init__(self, config: PerformerConfig, layer_idx: int):
        super().__init__()
        self.pre_norm = config.layer_norm_position == "pre"
        self.attention = PerformerAttention(config, layer_idx)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = PerformerMLP(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_mask: torch.Tensor | None,
        causal: bool,
        cache: Cache | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states: (B, L, hidden) -> (B, L, hidden), attention weights or None."""
        if self.pre_norm:
            attended, weights = self.attention(
                self.attention_norm(hidden_states), key_mask, causal, cache, output_attentions
            )
            hidden_states = hidden_states + self.dropout(attended)
            return hidden_states + self.dropout(self.mlp(self.mlp_norm(hidden_states))), weights
        attended, weights = self.attention(hidden_states, key_mask, causal, cache, output_attentions)
        hidden_states = self.attention_norm(hidden_states + self.dropout(attended))
        return self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states))), weights


class PerformerEncoder(nn.Module):
    def __init__(self, config: PerformerConfig):
        super().__init__()
        self.layer = nn.ModuleList(PerformerLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.layer_norm_position == "pre" else None
        )
        self.gradient_checkpointing = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_mask: torch.Tensor | None,
        causal: bool,
        cache: Cache | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ):
        """Returns the last hidden state and the per-layer hidden states / attention weights (or None)."""
        all_hidden = [hidden_states] if output_hidden_states else None
        all_weights = [] if output_attentions else None
        for layer in self.layer:
            hidden_states, weights = layer(
                hidden_states, key_mask, causal, cache=cache, output_attentions=output_attentions
            )
            if output_hidden_states:
                all_hidden.append(hidden_states)
            if output_attentions:
                all_weights.append(weights)
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states)
            if output_hidden_states:
                all_hidden[-1] = hidden_states
        return (
            hidden_states,
            tuple(all_hidden) if output_hidden_states else None,
            tuple(all_weights) if output_attentions else None,
        )


class PerformerPooler(nn.Module):
    """dense + tanh on the first token (BERT's pooler; RoBERTa's classifier.dense maps here)."""

    def __init__(self, config: PerformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


class PerformerPreTrainedModel(PreTrainedModel):
    config_class = PerformerConfig
    config: PerformerConfig
    base_model_prefix = "performer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["PerformerLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, PerformerAttention):
            init.copy_(module.projection, module.draw_projection(self.config.projection_seed + module.layer_idx))
            if self.config.center_features:
                init.zeros_(module.query_center)
                init.zeros_(module.key_center)
        elif isinstance(module, PerformerMaskedLMHead):
            init.zeros_(module.bias)

    def redraw_projections(self, seed: int) -> None:
        """Redraw every layer's random features; layer ``i`` draws from ``(seed, i)``.

        Deterministic in ``seed``, so all ranks of a distributed run agree without communication.
        Training code calls this every ``config.feature_redraw_interval`` optimizer steps with the
        step as seed; ``forward`` never redraws.
        """
        for module in self.modules():
            if isinstance(module, PerformerAttention):
                module.redraw_projection(seed * 1_000_003 + module.layer_idx)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` (safetensors + config + the modeling code), with every
        Performer class listed in ``config.auto_map``: any ``AutoModel*.from_pretrained(folder,
        trust_remote_code=True)`` then loads the folder where ``performer_hf`` is not installed."""
        module = self.__class__.__module__.rsplit(".", 1)[-1]
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        auto_map.update({auto: f"{module}.{cls.__name__}" for cls, auto in AUTO_CLASSES.items()})
        self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)


class PerformerModel(PerformerPreTrainedModel):
    """The bare Performer: embeddings, blocks and (optionally) the pooler."""

    def __init__(self, config: PerformerConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = PerformerEmbeddings(config)
        self.encoder = PerformerEncoder(config)
        self.pooler = PerformerPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def _check_cache(self, cache) -> None:
        if not isinstance(cache, Cache):
            raise ValueError(
                f"cache must be a transformers Cache, got {type(cache).__name__}: "
                "pass DynamicCache(config=model.config) (what generate builds)."
            )
        expected = ATTENTION_METHODS[self.config.attention_method].cache_layer
        if expected is None:  # a key/value cache: any transformers Cache
            return
        layers = cache.layers
        # compared by layer type, not class: each copy of this code (package, remote-code folders) has its own class
        is_expected = [getattr(c, "_layer_type", None) == expected._layer_type for c in layers]
        if len(layers) != self.config.num_hidden_layers or not all(is_expected):
            raise ValueError(
                f"cache holds {[type(c).__name__ for c in layers]}, but this attention needs one "
                f"{expected.__name__} per layer ({self.config.num_hidden_layers}): build it with "
                "DynamicCache(config=model.config)."
            )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        causal: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPoolingAndCrossAttentions | tuple:
        """Encode ``input_ids`` (B, L) or ``inputs_embeds`` (B, L, hidden).

        Args:
            attention_mask: (B, P + L), 1 for real tokens, 0 for padding; with a cache it covers the P
                cached tokens too (the Hugging Face convention).
            position_ids: (B, L); by default ``P, P + 1, ...`` (RoBERTa style when ``position_offset > 0``).
            cache: causal only: the cache of the preceding tokens, updated in place. FAVOR+
                keeps a constant-size state per layer (see ``cache_performer.py``), ``"exact"`` keys and values.
            use_cache: causal only: return the cache (a new ``DynamicCache(config)`` when none is passed).
                Defaults to ``config.use_cache`` for causal attention in eval mode.
            output_attentions: only where ``config.has_attention_weights`` (exact attention); linear attention
                never forms the attention matrix.
            causal: overrides ``config.is_decoder`` (the task heads set it).
            past_key_values: the name of ``cache`` before transformers 5.24 (deprecated there).
        """
        cache = _cache_argument(cache, past_key_values, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        self.config.check_output_attentions(output_attentions)
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        causal = self.config.is_decoder if causal is None else causal
        if not causal and cache is not None:
            raise ValueError("A cache needs causal attention: use PerformerForCausalLM or is_decoder=True.")
        if not causal:
            use_cache = False  # nothing to cache for a bidirectional model (as in transformers' encoders)
        elif use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if (use_cache or cache is not None) and self.encoder.gradient_checkpointing and self.training:
            # the backward replay of a checkpointed layer would update the cache a second time
            logger.warning_once("A cache is incompatible with gradient checkpointing in training; not using one.")
            use_cache, cache = False, None
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None:
            self._check_cache(cache)
        past_length = cache.get_seq_length() if cache is not None else 0

        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        key_mask = None if attention_mask is None else attention_mask.to(torch.bool)  # (B, P + L)
        if key_mask is not None and (key_mask.dim() != 2 or key_mask.shape[1] != past_length + length):
            raise ValueError(
                f"attention_mask must be 2D (batch, past + new tokens) = (batch, {past_length + length}) with 1 for "
                f"real tokens; got {tuple(key_mask.shape)}."
            )

        hidden_states = self.embeddings(
            input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, past_length=past_length,
        )  # fmt: skip
        sequence_output, all_hidden, all_weights = self.encoder(
            hidden_states, key_mask, causal, cache, output_hidden_states, output_attentions
        )
        pooled = self.pooler(sequence_output) if self.pooler is not None else None
        output = BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output,
            pooler_output=pooled,
            hidden_states=all_hidden,
            attentions=all_weights,
            **{CACHE_FIELD: cache if use_cache else None},
        )
        return output if return_dict else output.to_tuple()


class PerformerMaskedLMHead(nn.Module):
    """dense + activation + LayerNorm, then the (tied) decoder: BERT's and RoBERTa's MLM head."""

    def __init__(self, config: PerformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.layer_norm(self.act(self.dense(hidden_states)))
        return self.decoder(hidden_states) + self.bias  # (B, L, vocab)

    @torch.no_grad()
    def resize_bias(self, vocab_size: int) -> None:
        """Cut or zero-pad the output bias to ``vocab_size`` entries (after the decoder was resized)."""
        old = self.bias
        new = torch.zeros(vocab_size, device=old.device, dtype=old.dtype)
        keep = min(vocab_size, old.shape[0])
        new[:keep] = old[:keep]
        self.bias = nn.Parameter(new, requires_grad=old.requires_grad)


def _token_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Cross entropy of (..., C) logits against (...) labels, -100 ignored.

    The mean over scored tokens; with ``num_items_in_batch`` (passed by the HF ``Trainer``) the sum
    divided by it, which keeps gradient accumulation exact.
    """
    labels = labels.to(logits.device).reshape(-1)
    logits = logits.reshape(-1, logits.shape[-1]).float()
    if num_items_in_batch is None:
        return F.cross_entropy(logits, labels)
    return F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch


class PerformerForMaskedLM(PerformerPreTrainedModel):
    _tied_weights_keys = {"lm_head.decoder.weight": "performer.embeddings.word_embeddings.weight"}

    def __init__(self, config: PerformerConfig):
        super().__init__(config)
        self.performer = PerformerModel(config, add_pooling_layer=False)
        self.lm_head = PerformerMaskedLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """``PreTrainedModel.resize_token_embeddings``, which resizes the decoder; the head's separate
        output bias (BERT's ``cls.predictions.bias``) follows: new tokens get a zero bias."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.lm_head.resize_bias(embeddings.num_embeddings)
        return embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        return_dict=None,
        num_items_in_batch=None,
        **kwargs,
    ) -> MaskedLMOutput | tuple:
        """``labels``: (B, L) token ids, -100 where no prediction is scored."""
        outputs = self.performer(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, return_dict=True, causal=False, **kwargs,
        )  # fmt: skip
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None if labels is None else _token_loss(logits, labels, num_items_in_batch)
        output = MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict is not False else output.to_tuple()


class PerformerForCausalLM(PerformerPreTrainedModel, GenerationMixin):
    """Always causal; the LM head is a plain (tied) linear map, as in GPT-2.

    ``generate`` decodes with a constant-size cache: per layer the running FAVOR+ state
    (``FavorCacheLayer``), so each new token costs the same whatever the context length. The
    prompt is prefilled with the chunked causal kernel. ``attention_kernel="exact"`` uses a
    key/value ``DynamicCache``. Left-padded batches work: ``generate`` derives the position ids from
    the attention mask and padded keys are left out of the state.
    """

    _tied_weights_keys = {"lm_head.weight": "performer.embeddings.word_embeddings.weight"}

    def __init__(self, config: PerformerConfig):
        super().__init__(config)
        self.performer = PerformerModel(config, add_pooling_layer=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # a recurrent state cannot be rolled back to check draft tokens (assisted generation)
        self._is_stateful = config.attention_kernel != "exact"
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        # `generate` numbers real tokens from 0; RoBERTa-style checkpoints count from position_offset.
        position_ids = super()._prepare_position_ids_for_generation(inputs_tensor, model_kwargs)
        return position_ids + self.config.position_offset

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        num_items_in_batch=None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithCrossAttentions | tuple:
        """``labels``: (B, L) token ids (shifted inside), -100 where no prediction is scored.
        ``shift_labels`` (a keyword, as in transformers' models: the ``Trainer`` takes every named ``*label*``
        argument for a required label): (B, L) labels already shifted (position i scores token i + 1), as
        sequence- and context-parallel training pass them; used instead of ``labels``.
        ``logits_to_keep``: compute logits for the last N positions only (0: all; ``generate`` uses 1),
        or for the positions in a 1D index tensor.
        ``cache``: the decoding cache (``past_key_values`` before transformers 5.24)."""
        shift_labels = kwargs.pop("shift_labels", None)
        outputs = self.performer(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, cache=_cache_argument(cache, past_key_values, kwargs), use_cache=use_cache,
            return_dict=True, causal=True, **kwargs,
        )  # fmt: skip
        hidden_states = outputs.last_hidden_state  # (B, L, hidden)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep])  # (B, L or N, vocab)
        loss = None
        if labels is not None or shift_labels is not None:
            targets = shift_labels if shift_labels is not None else labels
            if logits.shape[1] != targets.shape[1]:
                raise ValueError(f"labels need logits for every position; got logits_to_keep={logits_to_keep}.")
            if shift_labels is not None:
                loss = _token_loss(logits, shift_labels, num_items_in_batch)
            else:
                loss = _token_loss(logits[:, :-1], labels[:, 1:], num_items_in_batch)
        output = CausalLMOutputWithCrossAttentions(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )
        return output if return_dict is not False else output.to_tuple()


def _classification_loss(config: PerformerConfig, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The HF convention: regression for one label, single- or multi-label classification otherwise."""
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1))
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels).float(), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


class PerformerForSequenceClassification(PerformerPreTrainedModel):
    """Pooler (first token, dense + tanh) + dropout + linear classifier; bidirectional."""

    # the loss is a per-sequence mean: the Trainer scales it for gradient accumulation itself
    accepts_loss_kwargs = False

    def __init__(self, config: PerformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.performer = PerformerModel(config, add_pooling_layer=True)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        return_dict=None,
        **kwargs,
    ) -> SequenceClassifierOutput | tuple:
        """``labels``: (B,) class ids (float targets for regression / multi-label)."""
        outputs = self.performer(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, return_dict=True, causal=False, **kwargs,
        )  # fmt: skip
        logits = self.classifier(self.dropout(outputs.pooler_output))  # (B, num_labels)
        loss = None if labels is None else _classification_loss(self.config, logits, labels)
        output = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict is not False else output.to_tuple()


class PerformerForTokenClassification(PerformerPreTrainedModel):
    def __init__(self, config: PerformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.performer = PerformerModel(config, add_pooling_layer=False)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        return_dict=None,
        num_items_in_batch=None,
        **kwargs,
    ) -> TokenClassifierOutput | tuple:
        """``labels``: (B, L) class ids, -100 where no prediction is scored."""
        outputs = self.performer(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, return_dict=True, causal=False, **kwargs,
        )  # fmt: skip
        logits = self.classifier(self.dropout(outputs.last_hidden_state))  # (B, L, num_labels)
        loss = None if labels is None else _token_loss(logits, labels, num_items_in_batch)
        output = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict is not False else output.to_tuple()


class PerformerForQuestionAnswering(PerformerPreTrainedModel):
    # the loss is a per-sequence mean: the Trainer scales it for gradient accumulation itself
    accepts_loss_kwargs = False

    def __init__(self, config: PerformerConfig):
        super().__init__(config)
        self.performer = PerformerModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        start_positions=None,
        end_positions=None,
        return_dict=None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput | tuple:
        """``start_positions`` / ``end_positions``: (B,) token indices of the answer span."""
        outputs = self.performer(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, return_dict=True, causal=False, **kwargs,
        )  # fmt: skip
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).unbind(dim=-1)  # (B, L) each
        loss = None
        if start_positions is not None and end_positions is not None:
            length = start_logits.shape[1]
            start_loss = F.cross_entropy(start_logits.float(), start_positions.clamp(0, length), ignore_index=length)
            end_loss = F.cross_entropy(end_logits.float(), end_positions.clamp(0, length), ignore_index=length)
            loss = (start_loss + end_loss) / 2
        output = QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict is not False else output.to_tuple()


# The Auto class of each model class: `import performer_hf` registers them. Remote code: `save_pretrained`
# copies this file and its sibling imports next to the weights and writes an `auto_map`, so the checkpoint
# loads with `trust_remote_code=True` without performer_hf.
AUTO_CLASSES = {
    PerformerModel: "AutoModel",
    PerformerForMaskedLM: "AutoModelForMaskedLM",
    PerformerForCausalLM: "AutoModelForCausalLM",
    PerformerForSequenceClassification: "AutoModelForSequenceClassification",
    PerformerForTokenClassification: "AutoModelForTokenClassification",
    PerformerForQuestionAnswering: "AutoModelForQuestionAnswering",
}
PerformerConfig.register_for_auto_class()
for _model_class, _auto_class in AUTO_CLASSES.items():
    _model_class.register_for_auto_class(_auto_class)


__all__ = [
    "PerformerForCausalLM",
    "PerformerForMaskedLM",
    "PerformerForQuestionAnswering",
    "PerformerForSequenceClassification",
    "PerformerForTokenClassification",
    "PerformerModel",
    "PerformerPreTrainedModel",
]
