"""How close a converted Performer stays to its source model, measured on real text.

Three views, all on the real (non-padding) tokens of a sample batch:

- per layer, the relative error of the attention output of the converted (FAVOR+ or hybrid) model
  against the same weights with ``attention_kernel="exact"``: once with the same input (the error
  the approximation adds in that layer) and once along the converted model's forward pass (the error
  accumulated up to that layer);
- the final hidden states and head outputs (logits, labels) of the converted model against the source;
- the exact-kernel Performer against the source: the check that the weights were mapped correctly.

The converted model is measured in the dtype it is saved in (bfloat16, float16 or float32), the source in
float32; the mapping check is made in float32 as well, where rounding to a narrower dtype would hide a mistake.

The sample text is English prose from Python's own documentation (``pydoc_data.topics``), which
every CPython ships: the report needs no download.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..modeling.layers_performer import PerformerAttention

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_PLAIN_SENTENCE = re.compile(r"[A-Za-z ,;'\-]+\.")


def english_sentences(limit: int | None = None) -> list[str]:
    """Plain English sentences (8-30 words, no code) from ``pydoc_data.topics``, in a fixed order."""
    from pydoc_data.topics import topics

    text = re.sub(r"\s+", " ", " ".join(topics[name] for name in sorted(topics)))
    sentences = [s for s in _SENTENCE_END.split(text) if 8 <= len(s.split()) <= 30 and _PLAIN_SENTENCE.fullmatch(s)]
    return sentences[:limit]


def sample_passages(num_passages: int = 8, min_words: int = 24, max_words: int = 180) -> list[str]:
    """``num_passages`` passages of consecutive sentences, lengths spread from ``min_words`` to
    ``max_words`` so that a padded batch of them exercises the padding masks."""
    sentences = english_sentences()
    passages, start = [], 0
    for i in range(num_passages):
        target = min_words + (max_words - min_words) * i // max(num_passages - 1, 1)
        words: list[str] = []
        while len(words) < target:
            words += sentences[start % len(sentences)].split()
            start += 1
        passages.append(" ".join(words[:target]))
    return passages


def sample_batch(config, tokenizer=None, num_passages: int = 8, max_length: int = 256) -> dict[str, torch.Tensor]:
    """A padded batch for the fidelity report: ``input_ids``, ``attention_mask`` (and ``token_type_ids``).

    With a tokenizer: :func:`sample_passages` tokenized. Without one (tiny test checkpoints): random
    token ids of the same spread of lengths, avoiding the padding id.
    """
    max_length = min(max_length, config.max_position_embeddings - config.position_offset)
    if tokenizer is not None:
        if tokenizer.pad_token is None:  # GPT-2 has no padding token; any id works under the mask
            tokenizer.pad_token = tokenizer.eos_token
        encoded = tokenizer(
            sample_passages(num_passages), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        return {k: encoded[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in encoded}
    generator = torch.Generator().manual_seed(0)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    ids = torch.randint(0, config.vocab_size - 1, (num_passages, max_length), generator=generator)
    ids = torch.where(ids >= pad, ids + 1, ids)  # (B, L), never the padding id
    lengths = torch.linspace(max(max_length // 4, 2), max_length, num_passages).long()  # (B,)
    mask = torch.arange(max_length)[None, :] < lengths[:, None]  # (B, L), right padding
    return {"input_ids": ids.masked_fill(~mask, pad), "attention_mask": mask.long()}


def _relative_error(candidate: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> float:
    """||candidate - reference|| / ||reference|| over the real tokens; tensors (B, L, ...), mask (B, L)."""
    candidate, reference = candidate[mask].double(), reference[mask].double()
    return float((candidate - reference).norm() / reference.norm().clamp_min(1e-30))


def _mean_cosine(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean cosine similarity of the real tokens' vectors; a, b: (B, L, H), mask: (B, L)."""
    return float(nn.functional.cosine_similarity(a[mask].double(), b[mask].double(), dim=-1).mean())


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings (B, H): the mean of the real tokens' hidden states (B, L, H)."""
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, L, 1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation of two 1D tensors (continuous values: ties are not averaged)."""
    rank_x = x.double().argsort().argsort().double()
    rank_y = y.double().argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([rank_x, rank_y]))[0, 1])


@torch.no_grad()
def sentence_embeddings(
    model: nn.Module, tokenizer, sentences: list[str], batch_size: int = 32, max_length: int = 128
) -> torch.Tensor:
    """Mean-pooled last hidden states (N, H) of ``sentences`` (works for HF and Performer models)."""
    chunks = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(
            sentences[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        hidden = model(**batch, output_hidden_states=True).hidden_states[-1]  # (b, L, H)
        chunks.append(mean_pool(hidden, batch["attention_mask"]))
    return torch.cat(chunks)


def embedding_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    """Sentence-embedding agreement of two models on the same N sentences (embeddings (N, H)).

    ``mean_cosine``: mean cosine between each sentence's two embeddings. ``pairwise_spearman``: Spearman
    correlation of the two models' N(N-1)/2 pairwise cosine similarities (does the ranking of which
    sentences are similar survive?).
    """
    reference = nn.functional.normalize(reference.double(), dim=-1)
    candidate = nn.functional.normalize(candidate.double(), dim=-1)
    upper = torch.triu_indices(len(reference), len(reference), offset=1)  # (2, N(N-1)/2)
    pairs_ref = (reference @ reference.T)[upper[0], upper[1]]
    pairs_cand = (candidate @ candidate.T)[upper[0], upper[1]]
    return {
        "mean_cosine": float((reference * candidate).sum(-1).mean()),
        "pairwise_spearman": spearman(pairs_ref, pairs_cand),
    }


@dataclass
class FidelityReport:
    """Agreement figures measured at conversion time (see the module docstring)."""

    num_sequences: int
    num_tokens: int
    text: str
    attention_error_local: list[float]  # per layer, same input
    attention_error_propagated: list[float]  # per layer, along the FAVOR+ forward pass
    hidden_cosine: float  # FAVOR+ vs source, final hidden states
    hidden_relative_error: float
    exact_max_abs_diff: dict[str, float]  # exact-kernel Performer vs source
    head: dict[str, float] = field(default_factory=dict)  # top-1 agreement, label agreement, pooled cosine
    attention: dict = field(default_factory=dict)  # the attention settings measured (convert.attention_settings)
    dtype: str = "float32"  # the converted model's, as saved and measured
    mapping_max_abs_diff: dict[str, float] = field(default_factory=dict)  # exact-kernel vs source in float32

    def mapping_check(self) -> dict[str, float]:
        """The exact-kernel conversion's max abs differences from the source in float32: the mapping check."""
        return self.mapping_max_abs_diff or self.exact_max_abs_diff

    def to_dict(self) -> dict:
        return asdict(self)

    def exact_dispatch_note(self) -> str:
        """Where the model keeps exact attention for short inputs: that the figures are its approximation's (measured
        on every input, :func:`approximation_only`), not what it computes on inputs as short as the sample's; else
        ``""``."""
        if not self.attention.get("exact_max_length"):
            return ""
        return (
            f"the approximation on every input; the model keeps exact attention up to "
            f"{self.attention['exact_max_length']} tokens"
        )

    def format_table(self) -> str:
        """The report as a plain-text table."""
        note = self.exact_dispatch_note()
        lines = [
            f"Fidelity of the {self.dtype} weights on {self.num_sequences} sequences ({self.num_tokens} tokens) of "
            f"{self.text}",
            *(["attention: " + ", ".join(f"{k}={v}" for k, v in self.attention.items())] if self.attention else []),
            *([f"({note})"] if note else []),
            "layer | attention rel. error, same input | attention rel. error, propagated",
        ]
        for i, (local, propagated) in enumerate(
            zip(self.attention_error_local, self.attention_error_propagated, strict=True)
        ):
            lines.append(f"{i:>5} | {local:>32.4f} | {propagated:>32.4f}")
        lines.append(
            f"final hidden states vs source: cosine {self.hidden_cosine:.4f}, "
            f"rel. error {self.hidden_relative_error:.4f}"
        )
        lines += [f"{name.replace('_', ' ')} vs source: {value:.4f}" for name, value in self.head.items()]
        exact = ", ".join(f"{name} {value:.2e}" for name, value in self.exact_max_abs_diff.items())
        lines.append(f"exact-kernel conversion vs source, max |diff|: {exact}")
        if self.mapping_max_abs_diff:
            mapping = ", ".join(f"{name} {value:.2e}" for name, value in self.mapping_max_abs_diff.items())
            lines.append(f"exact-kernel conversion in float32 vs source, max |diff| (the mapping check): {mapping}")
        return "\n".join(lines)


def _attention_modules(model: nn.Module) -> list[PerformerAttention]:
    return [module for module in model.modules() if isinstance(module, PerformerAttention)]


@contextmanager
def approximation_only(model: nn.Module):
    """Within the block, ``model`` runs its approximation on every input: the exact dispatch of short inputs
    (``exact_max_length``, on accelerators too) is off, so that a report on short sample text measures what longer
    inputs get."""
    modules = _attention_modules(model)
    names = ("exact_max_length", "accelerator_exact_max_length")
    saved = [[getattr(module, name) for name in names] for module in modules]
    for module in modules:
        module.exact_max_length, module.accelerator_exact_max_length = 0, None
    try:
        yield model
    finally:
        for module, values in zip(modules, saved, strict=True):
            module.exact_max_length, module.accelerator_exact_max_length = values


@torch.no_grad()
def _forward(model: nn.Module, batch: dict[str, torch.Tensor]):
    return model(**batch, output_hidden_states=True, return_dict=True, use_cache=False)


def _exact_differences(out_source, out_exact, mask: torch.Tensor) -> dict[str, float]:
    """Max abs differences of the exact-kernel Performer's outputs from the source's: final hidden states (real
    tokens) and logits where the source has them; mask (B, L)."""
    hidden_source, hidden_exact = (o.hidden_states[-1].float() for o in (out_source, out_exact))
    diff = {"hidden states": float((hidden_exact - hidden_source)[mask].abs().max())}
    logits = getattr(out_source, "logits", getattr(out_source, "prediction_logits", None))  # BertForPreTraining
    if logits is not None:
        exact_logits = out_exact.logits.float()
        diff["logits"] = float(
            ((exact_logits - logits)[mask] if logits.dim() == 3 else exact_logits - logits).abs().max()
        )
    return diff


@torch.no_grad()
def mapping_check(source: nn.Module, exact: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """The max abs differences of the exact-kernel Performer ``exact`` from ``source`` on ``batch`` (both float32):
    a mapping mistake shows above float32's rounding."""
    mask = batch["attention_mask"].bool()  # (B, L)
    if "token_type_ids" in batch and getattr(exact.config, "type_vocab_size", 0) == 0:
        batch = {k: v for k, v in batch.items() if k != "token_type_ids"}
    return _exact_differences(_forward(source, batch), _forward(exact, batch), mask)


@torch.no_grad()
def measure_fidelity(
    source: nn.Module, favor: nn.Module, exact: nn.Module, batch: dict[str, torch.Tensor], text: str
) -> FidelityReport:
    """Compare the FAVOR+ Performer ``favor``, its exact-kernel twin ``exact`` (same weights, same dtype) and the
    ``source`` model (float32) on ``batch``. All three in eval mode. ``favor`` runs its approximation on every input
    (:func:`approximation_only`): the figures say what inputs longer than its ``exact_max_length`` get."""
    mask = batch["attention_mask"].bool()  # (B, L)
    if "token_type_ids" in batch and getattr(favor.config, "type_vocab_size", 0) == 0:
        batch = {k: v for k, v in batch.items() if k != "token_type_ids"}

    exact_calls: list[tuple[tuple, dict, torch.Tensor]] = []
    favor_outputs: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, a, kw, out: exact_calls.append((a, kw, out[0])), with_kwargs=True)
        for m in _attention_modules(exact)
    ]
    hooks += [
        m.register_forward_hook(lambda _m, _a, out: favor_outputs.append(out[0])) for m in _attention_modules(favor)
    ]
    with approximation_only(favor):
        try:
            out_source, out_exact, out_favor = (_forward(m, batch) for m in (source, exact, favor))
        finally:
            for hook in hooks:
                hook.remove()
        local = [
            _relative_error(module(*args, **kwargs)[0], reference, mask)
            for module, (args, kwargs, reference) in zip(_attention_modules(favor), exact_calls, strict=True)
        ]
    propagated = [
        _relative_error(candidate, reference, mask)
        for candidate, (_, _, reference) in zip(favor_outputs, exact_calls, strict=True)
    ]

    hidden_source, hidden_favor = out_source.hidden_states[-1], out_favor.hidden_states[-1].float()
    exact_diff = _exact_differences(out_source, out_exact, mask)
    head: dict[str, float] = {}
    logits = getattr(out_source, "logits", getattr(out_source, "prediction_logits", None))  # BertForPreTraining
    if logits is not None and logits.dim() == 3:  # token logits: masked / causal LM
        top1 = (out_favor.logits.argmax(-1) == logits.argmax(-1))[mask]
        head["top-1 token agreement"] = float(top1.double().mean())
    elif logits is not None:  # sequence classification
        head["label agreement"] = float((out_favor.logits.argmax(-1) == logits.argmax(-1)).double().mean())
        head["logits max abs diff"] = float((out_favor.logits.float() - logits).abs().max())
    else:
        pooled = embedding_agreement(mean_pool(hidden_source, mask), mean_pool(hidden_favor, mask))
        head["mean-pooled embedding cosine"] = pooled["mean_cosine"]
    return FidelityReport(
        num_sequences=int(mask.shape[0]),
        num_tokens=int(mask.sum()),
        text=text,
        attention_error_local=local,
        attention_error_propagated=propagated,
        hidden_cosine=_mean_cosine(hidden_favor, hidden_source, mask),
        dtype=str(next(favor.parameters()).dtype).removeprefix("torch."),
        hidden_relative_error=_relative_error(hidden_favor, hidden_source, mask),
        exact_max_abs_diff=exact_diff,
        head=head,
    )
