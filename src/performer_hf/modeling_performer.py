"""Performer model family: BERT / RoBERTa / GPT-2 style Transformers with FAVOR+ attention.

Read top to bottom: embeddings, attention, MLP, layer, encoder, pre-trained base class, the
bare model, then one class per task head. Only sibling imports (``from .x import y``) are
used, so the Hub's remote-code loader can copy this file next to a checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
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

from .configuration_performer import PerformerConfig
from .favor_attention import favor_attention
from .favor_projection import draw_projection

logger = logging.get_logger(__name__)


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

    def forward(
        self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, past_length: int = 0
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (B, L, hidden)
        batch, length = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = self.make_position_ids(input_ids, batch, length, past_length, inputs_embeds.device)
        if position_ids.numel() and int(position_ids.max()) >= self.max_positions:
            raise ValueError(
                f"Position id {int(position_ids.max())} is out of range: this model has max_position_embeddings="
                f"{self.max_positions}. Shorten the input, or convert with a larger --max-position-embeddings."
            )
        embeddings = inputs_embeds + self.position_embeddings(position_ids)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(position_ids)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.LayerNorm is not None:
            embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class PerformerAttention(nn.Module):
    """Multi-head self-attention computed by FAVOR+ (or exactly, for ``attention_kernel="exact"``).

    Owns one random projection ``(nb_features, head_dim)`` shared by its heads: a persistent buffer,
    so a saved checkpoint reproduces its outputs. It changes only through :meth:`redraw_projection`.
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
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_prob = config.attention_probs_dropout_prob
        self.register_buffer("projection", torch.empty(config.nb_features, self.head_dim), persistent=True)

    def draw_projection(self, seed: int) -> torch.Tensor:
        """A fresh ``(nb_features, head_dim)`` projection, reproducible from ``seed``."""
        fresh = draw_projection(
            self.projection.shape[0],
            self.head_dim,
            orthogonal=self.feature_coupling == "orthogonal",
            row_norms=self.feature_row_norms,
            generator=torch.Generator().manual_seed(seed),
        )
        return fresh.to(self.projection.device, self.projection.dtype)

    @torch.no_grad()
    def redraw_projection(self, seed: int) -> None:
        """Replace the random features by a fresh draw from ``seed``."""
        self.projection.copy_(self.draw_projection(seed))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)

    def _exact(self, q, k, v, key_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        length = q.shape[2]
        visible = None
        if key_mask is not None:
            visible = key_mask[:, None, None, :]  # (B, 1, 1, L)
        if causal:
            tril = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
            visible = tril if visible is None else visible & tril
            visible = visible | torch.eye(length, dtype=torch.bool, device=q.device)  # no empty rows
        dropout = self.dropout_prob if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout)

    def forward(self, hidden_states: torch.Tensor, key_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """hidden_states: (B, L, hidden); key_mask: (B, L) bool, True for real tokens."""
        q = self._split_heads(self.query(hidden_states))  # (B, H, L, D)
        k = self._split_heads(self.key(hidden_states))
        v = self._split_heads(self.value(hidden_states))
        if self.kernel == "exact":
            context = self._exact(q, k, v, key_mask, causal)
        else:
            context = favor_attention(
                q, k, v, self.projection, causal=causal, kernel=self.kernel,
                key_padding_mask=key_mask, chunk_size=self.chunk_size,
            )  # fmt: skip
        batch, _, length, _ = context.shape
        context = context.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)  # (B, L, hidden)
        return self.output(context)


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

    def forward(self, hidden_states: torch.Tensor, key_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        if self.pre_norm:
            hidden_states = hidden_states + self.dropout(
                self.attention(self.attention_norm(hidden_states), key_mask, causal)
            )
            return hidden_states + self.dropout(self.mlp(self.mlp_norm(hidden_states)))
        hidden_states = self.attention_norm(
            hidden_states + self.dropout(self.attention(hidden_states, key_mask, causal))
        )
        return self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states)))


class PerformerEncoder(nn.Module):
    def __init__(self, config: PerformerConfig):
        super().__init__()
        self.layer = nn.ModuleList(PerformerLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.layer_norm_position == "pre" else None
        )
        self.gradient_checkpointing = False

    def forward(self, hidden_states, key_mask, causal: bool, output_hidden_states: bool = False):
        all_hidden = [hidden_states] if output_hidden_states else None
        for layer in self.layer:
            hidden_states = layer(hidden_states, key_mask, causal)
            if output_hidden_states:
                all_hidden.append(hidden_states)
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states)
            if output_hidden_states:
                all_hidden[-1] = hidden_states
        return hidden_states, (tuple(all_hidden) if output_hidden_states else None)


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

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        causal: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPoolingAndCrossAttentions | tuple:
        """``causal`` overrides ``config.is_decoder`` (the task heads set it)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if output_attentions:
            raise ValueError(
                "output_attentions is not available: FAVOR+ never forms the attention matrix. "
                "Use attention_kernel='exact' to inspect attention weights."
            )
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        causal = self.config.is_decoder if causal is None else causal
        key_mask = None if attention_mask is None else attention_mask.to(torch.bool)  # (B, L)
        if key_mask is not None and key_mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be 2D (batch, seq) with 1 for real tokens; got {tuple(key_mask.shape)}."
            )

        hidden_states = self.embeddings(
            input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds,
        )  # fmt: skip
        sequence_output, all_hidden = self.encoder(hidden_states, key_mask, causal, output_hidden_states)
        pooled = self.pooler(sequence_output) if self.pooler is not None else None
        output = BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output, pooler_output=pooled, hidden_states=all_hidden
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
    ) -> MaskedLMOutput | tuple:
        """``labels``: (B, L) token ids, -100 where no prediction is scored."""
        outputs = self.performer(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, return_dict=True, causal=False, **kwargs,
        )  # fmt: skip
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))
        output = MaskedLMOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states)
        return output if return_dict is not False else output.to_tuple()


class PerformerForCausalLM(PerformerPreTrainedModel, GenerationMixin):
    """Always causal; the LM head is a plain (tied) linear map, as in GPT-2."""

    _tied_weights_keys = {"lm_head.weight": "performer.embeddings.word_embeddings.weight"}

    def __init__(self, config: PerformerConfig):
        super().__init__(config)
        self.performer = PerformerModel(config, add_pooling_layer=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

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
    ) -> CausalLMOutputWithCrossAttentions | tuple:
        """``labels``: (B, L) token ids (shifted inside), -100 where no prediction is scored."""
        outputs = self.performer(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, return_dict=True, causal=True, **kwargs,
        )  # fmt: skip
        logits = self.lm_head(outputs.last_hidden_state)  # (B, L, vocab)
        loss = None
        if labels is not None:
            shifted_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
            loss = F.cross_entropy(shifted_logits, labels[:, 1:].reshape(-1))
        output = CausalLMOutputWithCrossAttentions(loss=loss, logits=logits, hidden_states=outputs.hidden_states)
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
        output = SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states)
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
        **kwargs,
    ) -> TokenClassifierOutput | tuple:
        """``labels``: (B, L) class ids, -100 where no prediction is scored."""
        outputs = self.performer(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, return_dict=True, causal=False, **kwargs,
        )  # fmt: skip
        logits = self.classifier(self.dropout(outputs.last_hidden_state))  # (B, L, num_labels)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.num_labels).float(), labels.view(-1))
        output = TokenClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states)
        return output if return_dict is not False else output.to_tuple()


class PerformerForQuestionAnswering(PerformerPreTrainedModel):
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
            loss=loss, start_logits=start_logits, end_logits=end_logits, hidden_states=outputs.hidden_states
        )
        return output if return_dict is not False else output.to_tuple()


__all__ = [
    "PerformerForCausalLM",
    "PerformerForMaskedLM",
    "PerformerForQuestionAnswering",
    "PerformerForSequenceClassification",
    "PerformerForTokenClassification",
    "PerformerModel",
    "PerformerPreTrainedModel",
]
