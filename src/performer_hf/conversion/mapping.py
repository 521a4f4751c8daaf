"""Per-architecture tables that turn BERT / RoBERTa / GPT-2 checkpoints into Performer ones.

Everything a conversion needs to know about a source family lives in one :class:`Family` entry of
:data:`FAMILIES`: how its config maps to :class:`~performer_hf.PerformerConfig` fields, and one
:class:`Rule` per source tensor name (after the base-model prefix, e.g. ``"bert."``, is stripped).
A rule either fills Performer tensors (``copy``, ``transpose`` for GPT-2's Conv1D, ``split_qkv``
for GPT-2's fused ``c_attn``), drops a tensor for a stated reason (buffers, the NSP head), or checks
that a tensor an old checkpoint saved twice equals the one it is tied to. Where a checkpoint with untied
output embeddings holds two candidates for one target (the MLM heads' output biases), the one the source's
forward reads fills it and the other is dropped.

Templates use ``{i}`` for a layer index and ``{p}`` for ``weight`` / ``bias``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConversionError
from .in_place import IN_PLACE_ARCHITECTURES

COPY, TRANSPOSE, SPLIT_QKV, DROP, TIED = "copy", "transpose", "split_qkv", "drop", "tied"
POSITION_TABLE = "performer.embeddings.position_embeddings.weight"
_PLACEHOLDERS = {"{i}": r"(?P<i>\d+)", "{p}": r"(?P<p>weight|bias)"}


@dataclass(frozen=True)
class Rule:
    """What happens to the source tensors whose (prefix-stripped) name matches ``source``.

    Attributes:
        source: name template, e.g. ``"encoder.layer.{i}.attention.self.query.{p}"``.
        action: ``copy`` / ``transpose`` / ``split_qkv`` fill ``targets``; ``drop`` discards the tensor
            (``note`` says why); ``tied`` checks it equals ``tied_to`` (a source template) when the
            weights are tied, and otherwise copies it to ``targets``.
        targets: Performer state-dict name templates (three for ``split_qkv``: query, key, value).
        note: the reason a tensor is dropped, tied or superseded, shown in the conversion report.
        tied_to: for ``tied``: the source name it duplicates.
        superseded_by: a source name that, when the weights are untied and the checkpoint holds it, fills
            ``targets`` instead of this tensor (which the source's forward then does not read; it is dropped).
    """

    source: str
    action: str
    targets: tuple[str, ...] = ()
    note: str = ""
    tied_to: str = ""
    superseded_by: str = ""

    @property
    def pattern(self) -> re.Pattern:
        regex = re.escape(self.source)
        for placeholder, group in _PLACEHOLDERS.items():
            regex = regex.replace(re.escape(placeholder), group)
        return re.compile(regex + r"\Z")


def _fill(template: str, groups: dict[str, str]) -> str:
    for name, value in groups.items():
        template = template.replace("{" + name + "}", value)
    return template


@dataclass(frozen=True)
class Head:
    """A supported source architecture: the Performer class it becomes and its head's rules."""

    target_class: str
    rules: tuple[Rule, ...] = ()
    pooler: bool = False  # the target keeps BERT's pooler (sequence classification / bare model)


@dataclass(frozen=True)
class Family:
    """A source model family: config mapping, base-model prefix, body rules and supported heads."""

    model_type: str
    base_prefix: str
    body: tuple[Rule, ...]
    heads: dict[str, Head]
    map_config: Callable[[Any], dict[str, Any]]

    def rules_for(self, architecture: str) -> tuple[Rule, ...]:
        return self.body + self.heads[architecture].rules


def _p(name: str) -> str:
    return f"performer.{name}"


_BERT_BODY = (
    Rule("embeddings.word_embeddings.weight", COPY, (_p("embeddings.word_embeddings.weight"),)),
    Rule("embeddings.position_embeddings.weight", COPY, (POSITION_TABLE,)),
    Rule("embeddings.token_type_embeddings.weight", COPY, (_p("embeddings.token_type_embeddings.weight"),)),
    Rule("embeddings.LayerNorm.{p}", COPY, (_p("embeddings.LayerNorm.{p}"),)),
    Rule("encoder.layer.{i}.attention.self.query.{p}", COPY, (_p("encoder.layer.{i}.attention.query.{p}"),)),
    Rule("encoder.layer.{i}.attention.self.key.{p}", COPY, (_p("encoder.layer.{i}.attention.key.{p}"),)),
    Rule("encoder.layer.{i}.attention.self.value.{p}", COPY, (_p("encoder.layer.{i}.attention.value.{p}"),)),
    Rule("encoder.layer.{i}.attention.output.dense.{p}", COPY, (_p("encoder.layer.{i}.attention.output.{p}"),)),
    Rule("encoder.layer.{i}.attention.output.LayerNorm.{p}", COPY, (_p("encoder.layer.{i}.attention_norm.{p}"),)),
    Rule("encoder.layer.{i}.intermediate.dense.{p}", COPY, (_p("encoder.layer.{i}.mlp.fc_in.{p}"),)),
    Rule("encoder.layer.{i}.output.dense.{p}", COPY, (_p("encoder.layer.{i}.mlp.fc_out.{p}"),)),
    Rule("encoder.layer.{i}.output.LayerNorm.{p}", COPY, (_p("encoder.layer.{i}.mlp_norm.{p}"),)),
    Rule("embeddings.position_ids", DROP, note="buffer (position ids are computed)"),
    Rule("embeddings.token_type_ids", DROP, note="buffer (all-zero token types)"),
)
_POOLER_KEEP = Rule("pooler.dense.{p}", COPY, (_p("pooler.dense.{p}"),))
_POOLER_DROP = Rule("pooler.dense.{p}", DROP, note="pooler: unused by this head")

_BERT_MLM = (
    Rule("cls.predictions.transform.dense.{p}", COPY, ("lm_head.dense.{p}",)),
    Rule("cls.predictions.transform.LayerNorm.{p}", COPY, ("lm_head.layer_norm.{p}",)),
    # untied (transformers 5), the head keeps two output biases and its forward adds the decoder's
    Rule(
        "cls.predictions.bias",
        COPY,
        ("lm_head.bias",),
        "unused when untied: the forward adds cls.predictions.decoder.bias",
        superseded_by="cls.predictions.decoder.bias",
    ),
    Rule(
        "cls.predictions.decoder.weight",
        TIED,
        ("lm_head.decoder.weight",),
        "tied output embeddings",
        tied_to="embeddings.word_embeddings.weight",
    ),
    Rule("cls.predictions.decoder.bias", TIED, ("lm_head.bias",), "tied output bias", tied_to="cls.predictions.bias"),
    _POOLER_DROP,
)
_BERT_NSP = Rule("cls.seq_relationship.{p}", DROP, note="next-sentence-prediction head (pre-training only)")
_SEQUENCE_CLASSIFIER = (Rule("classifier.{p}", COPY, ("classifier.{p}",)),)

_ROBERTA_MLM = (
    Rule("lm_head.dense.{p}", COPY, ("lm_head.dense.{p}",)),
    Rule("lm_head.layer_norm.{p}", COPY, ("lm_head.layer_norm.{p}",)),
    Rule(
        "lm_head.bias",
        COPY,
        ("lm_head.bias",),
        "unused when untied: the forward adds lm_head.decoder.bias",
        superseded_by="lm_head.decoder.bias",
    ),
    Rule(
        "lm_head.decoder.weight",
        TIED,
        ("lm_head.decoder.weight",),
        "tied output embeddings",
        tied_to="embeddings.word_embeddings.weight",
    ),
    Rule("lm_head.decoder.bias", TIED, ("lm_head.bias",), "tied output bias", tied_to="lm_head.bias"),
    _POOLER_DROP,
)
# RoBERTa's classification head is dense + tanh on <s>, then out_proj: exactly BERT's pooler + classifier.
_ROBERTA_CLASSIFIER = (
    Rule("classifier.dense.{p}", COPY, (_p("pooler.dense.{p}"),)),
    Rule("classifier.out_proj.{p}", COPY, ("classifier.{p}",)),
    _POOLER_DROP,
)

_GPT2_LAYER = "encoder.layer.{i}"
_GPT2_BODY = (
    Rule("wte.weight", COPY, (_p("embeddings.word_embeddings.weight"),)),
    Rule("wpe.weight", COPY, (POSITION_TABLE,)),
    Rule("h.{i}.ln_1.{p}", COPY, (_p(f"{_GPT2_LAYER}.attention_norm.{{p}}"),)),
    Rule(
        "h.{i}.attn.c_attn.weight",
        SPLIT_QKV,
        tuple(_p(f"{_GPT2_LAYER}.attention.{name}.weight") for name in ("query", "key", "value")),
    ),
    Rule(
        "h.{i}.attn.c_attn.bias",
        SPLIT_QKV,
        tuple(_p(f"{_GPT2_LAYER}.attention.{name}.bias") for name in ("query", "key", "value")),
    ),
    Rule("h.{i}.attn.c_proj.weight", TRANSPOSE, (_p(f"{_GPT2_LAYER}.attention.output.weight"),)),
    Rule("h.{i}.attn.c_proj.bias", COPY, (_p(f"{_GPT2_LAYER}.attention.output.bias"),)),
    Rule("h.{i}.ln_2.{p}", COPY, (_p(f"{_GPT2_LAYER}.mlp_norm.{{p}}"),)),
    Rule("h.{i}.mlp.c_fc.weight", TRANSPOSE, (_p(f"{_GPT2_LAYER}.mlp.fc_in.weight"),)),
    Rule("h.{i}.mlp.c_fc.bias", COPY, (_p(f"{_GPT2_LAYER}.mlp.fc_in.bias"),)),
    Rule("h.{i}.mlp.c_proj.weight", TRANSPOSE, (_p(f"{_GPT2_LAYER}.mlp.fc_out.weight"),)),
    Rule("h.{i}.mlp.c_proj.bias", COPY, (_p(f"{_GPT2_LAYER}.mlp.fc_out.bias"),)),
    Rule("ln_f.{p}", COPY, (_p("encoder.final_norm.{p}"),)),
    Rule("h.{i}.attn.bias", DROP, note="buffer (causal mask of old checkpoints)"),
    Rule("h.{i}.attn.masked_bias", DROP, note="buffer (mask fill value of old checkpoints)"),
)
_GPT2_LM = (Rule("lm_head.weight", TIED, ("lm_head.weight",), "tied output embeddings", tied_to="wte.weight"),)


def _reject(condition: bool, message: str) -> None:
    if condition:
        raise ConversionError(message)


def _common_bert_fields(config) -> dict[str, Any]:
    position_type = getattr(config, "position_embedding_type", "absolute")
    _reject(
        position_type not in (None, "absolute"),
        f"position_embedding_type={position_type!r} is not supported; only learned absolute positions convert.",
    )
    _reject(getattr(config, "add_cross_attention", False), "cross-attention (add_cross_attention=True) is unsupported.")
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "hidden_dropout_prob": config.hidden_dropout_prob,
        "attention_probs_dropout_prob": config.attention_probs_dropout_prob,
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": config.type_vocab_size,
        "initializer_range": config.initializer_range,
        "layer_norm_eps": config.layer_norm_eps,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": getattr(config, "bos_token_id", None),
        "eos_token_id": getattr(config, "eos_token_id", None),
        "classifier_dropout": getattr(config, "classifier_dropout", None),
        "is_decoder": bool(getattr(config, "is_decoder", False)),
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", True)),
        "layer_norm_position": "post",
    }


def bert_config(config) -> dict[str, Any]:
    """PerformerConfig fields for a ``BertConfig``: post-LN, positions from 0."""
    return {**_common_bert_fields(config), "position_offset": 0}


def roberta_config(config) -> dict[str, Any]:
    """PerformerConfig fields for a ``RobertaConfig``: post-LN, positions from ``pad_token_id + 1``."""
    _reject(config.pad_token_id is None, "a RoBERTa config needs pad_token_id (positions start at pad_token_id + 1).")
    return {**_common_bert_fields(config), "position_offset": config.pad_token_id + 1}


def gpt2_config(config) -> dict[str, Any]:
    """PerformerConfig fields for a ``GPT2Config``: pre-LN with a final LayerNorm, causal, no token types."""
    _reject(not config.scale_attn_weights, "GPT-2 with scale_attn_weights=False is unsupported (Performers scale).")
    _reject(config.scale_attn_by_inverse_layer_idx, "GPT-2 with scale_attn_by_inverse_layer_idx=True is unsupported.")
    _reject(getattr(config, "add_cross_attention", False), "cross-attention (add_cross_attention=True) is unsupported.")
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "intermediate_size": config.n_inner if config.n_inner is not None else 4 * config.n_embd,
        "hidden_act": config.activation_function,
        "hidden_dropout_prob": config.resid_pdrop,
        "attention_probs_dropout_prob": config.attn_pdrop,
        "max_position_embeddings": config.n_positions,
        "type_vocab_size": 0,
        "initializer_range": config.initializer_range,
        "layer_norm_eps": config.layer_norm_epsilon,
        "pad_token_id": getattr(config, "pad_token_id", None),
        "bos_token_id": getattr(config, "bos_token_id", None),
        "eos_token_id": getattr(config, "eos_token_id", None),
        "is_decoder": True,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", True)),
        "layer_norm_position": "pre",
        "position_offset": 0,
    }


FAMILIES: dict[str, Family] = {
    "bert": Family(
        model_type="bert",
        base_prefix="bert",
        body=_BERT_BODY,
        heads={
            "BertModel": Head("PerformerModel", (_POOLER_KEEP,), pooler=True),
            # bert-base-uncased, a BertForMaskedLM, still ships its pre-training NSP head
            "BertForMaskedLM": Head("PerformerForMaskedLM", (*_BERT_MLM, _BERT_NSP)),
            "BertForPreTraining": Head("PerformerForMaskedLM", (*_BERT_MLM, _BERT_NSP)),
            "BertForSequenceClassification": Head(
                "PerformerForSequenceClassification", (_POOLER_KEEP, *_SEQUENCE_CLASSIFIER), pooler=True
            ),
        },
        map_config=bert_config,
    ),
    "roberta": Family(
        model_type="roberta",
        base_prefix="roberta",
        body=_BERT_BODY,
        heads={
            "RobertaModel": Head("PerformerModel", (_POOLER_KEEP,), pooler=True),
            "RobertaForMaskedLM": Head("PerformerForMaskedLM", _ROBERTA_MLM),
            "RobertaForSequenceClassification": Head(
                "PerformerForSequenceClassification", _ROBERTA_CLASSIFIER, pooler=True
            ),
        },
        map_config=roberta_config,
    ),
    "gpt2": Family(
        model_type="gpt2",
        base_prefix="transformer",
        body=_GPT2_BODY,
        heads={
            "GPT2Model": Head("PerformerModel"),
            "GPT2LMHeadModel": Head("PerformerForCausalLM", _GPT2_LM),
        },
        map_config=gpt2_config,
    ),
}

# the families above, and the architectures converted in place (their class kept, only the attention swapped)
SUPPORTED_ARCHITECTURES = (*(arch for family in FAMILIES.values() for arch in family.heads), *IN_PLACE_ARCHITECTURES)


def find_family(architecture: str) -> Family:
    """The family that converts ``architecture`` (e.g. ``"BertForMaskedLM"``)."""
    for family in FAMILIES.values():
        if architecture in family.heads:
            return family
    raise ConversionError(
        f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
    )


def normalize_source_name(name: str, base_prefix: str) -> str:
    """Strip the base-model prefix (``bert.``, ``roberta.``, ``transformer.``) and rename the
    ``LayerNorm.gamma`` / ``.beta`` of old TF-converted checkpoints to ``weight`` / ``bias``."""
    if name.startswith(base_prefix + "."):
        name = name[len(base_prefix) + 1 :]
    if "LayerNorm." in name or "layer_norm." in name:
        name = re.sub(r"\.gamma\Z", ".weight", re.sub(r"\.beta\Z", ".bias", name))
    return name


def split_qkv(tensor: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, ...]:
    """GPT-2's fused ``c_attn``: weight (hidden, 3 * hidden) Conv1D layout or bias (3 * hidden,)
    -> three ``nn.Linear`` tensors: weights (hidden, hidden), biases (hidden,)."""
    if tensor.dim() == 2:
        return tuple(part.t().contiguous() for part in tensor.split(hidden_size, dim=1))  # each (out, in)
    return tuple(part.clone() for part in tensor.split(hidden_size, dim=0))


def extend_positions(table: torch.Tensor, rows: int, offset: int) -> torch.Tensor:
    """Grow a learned position table (old_rows, hidden) to (rows, hidden) by tiling it.

    The first ``offset`` rows (RoBERTa's padding / unused positions) are kept as they are; the
    pretrained positions after them are repeated, as Longformer and BigBird warm-start long models:
    new row ``offset + j`` is pretrained row ``offset + j % (old_rows - offset)``.
    """
    old_rows = table.shape[0]
    if rows < old_rows:
        raise ConversionError(
            f"max_position_embeddings can only grow the pretrained table ({old_rows - offset} positions), "
            f"asked for {rows - offset}."
        )
    source_index = offset + torch.arange(rows - offset) % (old_rows - offset)  # (rows - offset,)
    return torch.cat([table[:offset], table[source_index]], dim=0)  # (rows, hidden)


@dataclass
class MappingResult:
    """Target tensors plus a record of what happened to every source tensor."""

    tensors: dict[str, torch.Tensor]
    used: dict[str, list[str]]  # source name -> target names
    dropped: dict[str, str]  # source name -> reason

    def strip_target_prefix(self, prefix: str) -> None:
        """Rename the targets for a bare model, whose state dict has no ``performer.`` prefix."""
        self.tensors = {name.removeprefix(prefix): tensor for name, tensor in self.tensors.items()}
        self.used = {source: [name.removeprefix(prefix) for name in targets] for source, targets in self.used.items()}


def _superseded(rule: Rule, match: re.Match, names: dict[str, str]) -> bool:
    """Whether the checkpoint holds the tensor that fills ``rule``'s targets instead when untied."""
    return bool(rule.superseded_by) and _fill(rule.superseded_by, match.groupdict()) in names


def map_weights(
    source: dict[str, torch.Tensor], family: Family, architecture: str, hidden_size: int, tie_word_embeddings: bool
) -> MappingResult:
    """Apply the rules of ``family`` / ``architecture`` to a source state dict.

    Every source tensor must match exactly one rule; a tensor that matches none is an error (the
    checkpoint holds something this table does not know, e.g. the head of another architecture).
    """
    rules = family.rules_for(architecture)
    normalized = {normalize_source_name(name, family.base_prefix): name for name in source}
    if len(normalized) != len(source):
        raise ConversionError("the checkpoint holds the same tensor with and without its base-model prefix.")
    compiled = [(rule, rule.pattern) for rule in rules]
    result = MappingResult({}, {}, {})
    unknown = []
    for name, original in sorted(normalized.items()):
        matches = [(rule, m) for rule, pattern in compiled if (m := pattern.match(name))]
        if not matches:
            unknown.append(original)
            continue
        rule, match = matches[0]
        tensor = source[original]
        targets = [_fill(t, match.groupdict()) for t in rule.targets]
        if rule.action == DROP:
            result.dropped[original] = rule.note
            continue
        if not tie_word_embeddings and _superseded(rule, match, normalized):
            result.dropped[original] = rule.note
            continue
        if rule.action == TIED and tie_word_embeddings:
            twin_name = _fill(rule.tied_to, match.groupdict())
            twin = source.get(normalized.get(twin_name, ""))
            if twin is None or twin.shape != tensor.shape or not torch.equal(twin, tensor):
                raise ConversionError(
                    f"{original} should equal {twin_name} (tied weights) but differs or is missing: the config does "
                    "not match the weights (set tie_word_embeddings=false in config.json if they are untied)."
                )
            result.dropped[original] = f"{rule.note}: equal to {twin_name}"
            continue
        if rule.action == SPLIT_QKV:
            values = split_qkv(tensor, hidden_size)
        elif rule.action == TRANSPOSE:
            values = (tensor.t().contiguous(),)
        else:
            values = (tensor,)
        for target, value in zip(targets, values, strict=True):
            result.tensors[target] = value
        result.used[original] = targets
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ConversionError(
            f"the checkpoint has tensors that a {architecture} does not: {shown}. The weights do not match the "
            "architecture named in config.json."
        )
    return result


def rules_markdown() -> str:
    """The mapping tables as Markdown (``conversion/MAPPING.md`` embeds this output)."""
    lines = []
    for family in FAMILIES.values():
        lines.append(f"### {family.model_type} (source prefix `{family.base_prefix}.` stripped)\n")
        lines.append("| source | action | Performer target / note |")
        lines.append("| --- | --- | --- |")
        for rule in family.body:
            lines.append(_rule_row(rule))
        for architecture, head in family.heads.items():
            lines.append(f"| **{architecture}** | → | **{head.target_class}** |")
            for rule in head.rules:
                lines.append(_rule_row(rule))
        lines.append("")
    lines.append("### Converted in place (class and weights kept; the config names the attention implementation)\n")
    lines.append("| source | model_type | loaded by |")
    lines.append("| --- | --- | --- |")
    for architecture, row in IN_PLACE_ARCHITECTURES.items():
        lines.append(f"| **{architecture}** | `{row.model_type}` | `{row.auto_class}` |")
    lines.append("")
    return "\n".join(lines)


def _rule_row(rule: Rule) -> str:
    detail = ", ".join(f"`{t}`" for t in rule.targets)
    if rule.action == TIED:
        detail = f"{detail + ' if untied; ' if detail else ''}must equal `{rule.tied_to}`"
    elif rule.superseded_by:
        detail = f"{detail}; dropped if untied and `{rule.superseded_by}` is present (the one the forward adds)"
    elif rule.action == DROP:
        detail = rule.note
    return f"| `{rule.source}` | {rule.action} | {detail} |"
