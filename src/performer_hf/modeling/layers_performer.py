"""The building blocks of a Performer: embeddings, attention (dispatched to the attention-method
registry), MLP, the Transformer layer, the layer stack, the pooler and the masked-LM head. The model
classes that assemble them are in ``modeling_performer.py``. Only sibling imports (``from .x import y``),
so the Hub's remote-code loader can copy this file next to a checkpoint.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention_methods import ATTENTION_METHODS
from .compiled_lengths import traced
from .configuration_performer import PerformerConfig
from .favor_projection import draw_projection
from .implied_attention import implied_attention
from .sink_order import EVERY_REAL_KEY, sinks_first
from .vocabulary_projection import plain_linear, vocabulary_logits


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

    def _check_position(self, largest_id: int, smallest_id: int = 0) -> None:
        if largest_id >= self.max_positions:
            raise ValueError(
                f"Position id {largest_id} is out of range: this model has max_position_embeddings="
                f"{self.max_positions}. Shorten the input, or convert with a larger --max-position-embeddings."
            )
        if smallest_id < 0:
            raise ValueError(
                f"Position id {smallest_id} is negative: position_ids count from 0 (a packing collator's or a "
                "padding's -1 needs clamping to 0 where the attention mask leaves the token out)."
            )

    @staticmethod
    def _check_ids(ids: torch.Tensor, name: str, table: nn.Embedding, field: str, hint: str = "") -> None:
        """Ids out of an embedding table's range end here, by name, not in torch's index error (one host read,
        skipped while tracing)."""
        if not ids.numel() or traced():
            return
        smallest, largest = (int(bound) for bound in torch.aminmax(ids))
        count = table.num_embeddings
        if smallest < 0 or largest >= count:
            raise ValueError(
                f"{name} hold {smallest if smallest < 0 else largest}, out of range: this model has {field}={count} "
                f"(ids 0 to {count - 1}).{hint}"
            )

    def forward(
        self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, past_length: int = 0
    ) -> torch.Tensor:
        if inputs_embeds is None:
            hint = " Is the tokenizer the checkpoint's?"
            self._check_ids(input_ids, "input_ids", self.word_embeddings, "vocab_size", hint)
            inputs_embeds = self.word_embeddings(input_ids)  # (B, L, hidden)
        batch, length = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = self.make_position_ids(input_ids, batch, length, past_length, inputs_embeds.device)
            # the largest derived id is at most past_length + length + position_offset - 1: a check on shapes only,
            # unless that bound is out of range where RoBERTa-style ids count the real tokens alone (padding may
            # take the rest): then the ids themselves (one host read, skipped while tracing)
            largest = past_length + length + self.position_offset - 1
            counts_real = self.position_offset > 0 and input_ids is not None
            if largest >= self.max_positions and counts_real and not traced():
                largest = int(position_ids.max())
            self._check_position(largest)
        elif position_ids.numel() and not traced():
            smallest, largest = torch.aminmax(position_ids)  # data-dependent: skipped while tracing
            self._check_position(int(largest), int(smallest))
        embeddings = inputs_embeds + self.position_embeddings(position_ids)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(position_ids)
            else:
                self._check_ids(token_type_ids, "token_type_ids", self.token_type_embeddings, "type_vocab_size")
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.LayerNorm is not None:
            embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


# buffers that a cast of the model to bfloat16 / float16 leaves in their (float32) precision
_FULL_PRECISION_BUFFERS = ("projection", "query_center", "key_center")


class AttentionMethodState(nn.Module):
    """What an attention method needs besides q, k and v (see ``attention_methods.py``): its function
    (``attend``), its settings, and the buffers it owns. Those are one random projection
    ``(nb_features, head_dim)`` shared by the heads, a persistent buffer (so a saved checkpoint reproduces its
    outputs) that changes only through :meth:`redraw_projection`; and, with ``center_features``, the fixed
    centres ``query_center`` / ``key_center`` ``(heads, head_dim)`` (in units of the queries and keys times
    ``head_dim ** -0.25``) that causal hybrid attention centres on.

    :class:`PerformerAttention` is one; the transformers attention implementations of
    ``performer_hf.integrations`` keep one beside each attention module of other model classes.
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
        config.check_attention_settings()
        method = ATTENTION_METHODS[config.attention_method]
        self.attention_method, self.attend = config.attention_method, method.attend
        if method.layer_settings is not None:  # e.g. the hybrid's HybridSpec, A and gain
            for name, value in method.layer_settings(config, layer_idx).items():
                setattr(self, name, value)
        self.dropout_prob = config.attention_probs_dropout_prob
        self.exact_max_length = config.exact_max_length
        self.accelerator_exact_max_length = config.accelerator_exact_max_length
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
            self.nb_features,
            self.head_dim,
            coupling=self.feature_coupling,
            row_norms=self.feature_row_norms,
            generator=generator,
            device="cpu",
            dtype=torch.float32,
        )

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

    def sinks_moved_per_call(self, causal: bool) -> int:
        """How many first real keys of each left-padded row a call moves in front of its pads
        (:func:`.sinks_first`): the hybrid's and the sparse method's global tokens, read exactly for every query;
        bidirectionally, every real key (queries move with their keys), so that the hybrid's global tokens, window,
        routed blocks and their groups are the row's as alone; none for FAVOR+ and exact attention, nor for a causal
        hybrid with an exact prefix, which orders its keys itself where a call passes the prefix
        (:func:`.method_hybrid._causal_exact_prefix`)."""
        if self.attention_method == "sparse":
            return self.sparse_spec.num_global_tokens
        if self.attention_method == "hybrid" and not causal:
            return EVERY_REAL_KEY if self.hybrid_spec.num_global_tokens or self.hybrid_spec.routed_blocks else 0
        if self.attention_method == "hybrid" and not self.exact_max_length:
            return self.hybrid_spec.num_global_tokens
        return 0


class PerformerAttention(AttentionMethodState):
    """Multi-head self-attention computed by FAVOR+, by hybrid attention (exact on a sparse support,
    a linear far field elsewhere; see ``PerformerConfig``) or exactly (``attention_kernel="exact"``),
    with the method's projection and centres (:class:`AttentionMethodState`).
    """

    def __init__(self, config: PerformerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)

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
            output_attentions: also return the weights (B, H, L, P + L): exact attention's, or the matrix linear
                attention implies (:func:`.implied_attention`: inputs of at most 1,024 tokens, no cached ones).

        Returns:
            The output (B, L, hidden) and the attention weights or None.
        """
        q = self._split_heads(self.query(hidden_states))  # (B, H, L, D)
        k = self._split_heads(self.key(hidden_states))
        v = self._split_heads(self.value(hidden_states))
        layer_cache = None if cache is None else cache.layers[self.layer_idx]
        past = 0 if layer_cache is None else layer_cache.get_seq_length()
        attend = partial(self.attend, self)
        # a left-padded row's global tokens: its first real tokens, as alone
        attend = sinks_first(attend, self.sinks_moved_per_call(causal), key_mask, q.shape[2], k.shape[2])
        context, weights = attend(q, k, v, key_mask, causal, layer_cache, output_attentions)  # (B, H, L, D)
        if output_attentions and weights is None:  # linear attention: the matrix it implies, (B, H, L, L)
            weights = implied_attention(lambda values: attend(q, k, values, key_mask, causal)[0], v, past)
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

    def forward(self, hidden_states: torch.Tensor, **attention_inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states: (B, L, hidden) -> (B, L, hidden), attention weights or None. ``attention_inputs``: the
        keywords of :meth:`PerformerAttention.forward` (``key_mask``, ``causal``, ``cache``, ``output_attentions``),
        passed through (``cache`` by name, so that gradient checkpointing drops it as it does for every layer)."""
        if self.pre_norm:
            attended, weights = self.attention(self.attention_norm(hidden_states), **attention_inputs)
            hidden_states = hidden_states + self.dropout(attended)
            return hidden_states + self.dropout(self.mlp(self.mlp_norm(hidden_states))), weights
        attended, weights = self.attention(hidden_states, **attention_inputs)
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

    def forward(self, hidden_states: torch.Tensor, output_hidden_states: bool = False, **attention_inputs):
        """Returns the last hidden state and the per-layer hidden states / attention weights (or None).
        ``attention_inputs``: the keywords of :meth:`PerformerAttention.forward`, for every layer."""
        output_attentions = attention_inputs.get("output_attentions", False)
        all_hidden = [hidden_states] if output_hidden_states else None
        all_weights = [] if output_attentions else None
        for layer in self.layer:
            hidden_states, weights = layer(hidden_states, **attention_inputs)
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
        if plain_linear(self.decoder):  # the product and the bias in one call (addmm), as the source's decoder
            return vocabulary_logits(hidden_states, self.decoder.weight, self.bias)  # (B, L, vocab)
        # a decoder wrapped (an adapter, a quantized or hooked layer): its own call, the bias added out of place (a
        # full backward hook returns its output as a view that autograd forbids changing in place)
        return self.decoder(hidden_states) + self.bias  # (B, L, vocab)

    @torch.no_grad()
    def resize_bias(self, vocab_size: int) -> None:
        """Cut or zero-pad the output bias to ``vocab_size`` entries (after the decoder was resized)."""
        old = self.bias
        new = torch.zeros(vocab_size, device=old.device, dtype=old.dtype)
        keep = min(vocab_size, old.shape[0])
        new[:keep] = old[:keep]
        self.bias = nn.Parameter(new, requires_grad=old.requires_grad)
