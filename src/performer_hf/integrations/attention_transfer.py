"""Attention transfer: train the small learnable parts of Performer attention to match the source's softmax
attention, label-free, with the rest of the model frozen (after LoLCATs, arXiv 2410.10254, and Hedgehog,
arXiv 2402.04347, which learn linear attention's feature maps by matching softmax attention).

What is learned, per attention layer (an :class:`~performer_hf.modeling.layers_performer.AttentionMethodState`):

- the feature projection ``(m, d)`` of FAVOR+ and of the hybrid's random-feature far fields: it starts as the
  seeded orthogonal draw and becomes a learned positive feature map;
- the hybrid's fixed centres ``query_center`` / ``key_center`` ``(H, d)`` (``center_features``);
- FAVOR++'s ``A`` per head (``attention_kernel="softmax_opt"``), kept below 1/8;
- the hybrid's far-field gain per head (``far_field_gain``, learned as its log at ``GAIN_LEARNING_RATE_FACTOR``
  times the learning rate): the far field's weight against the exact support, set by the same per-layer
  objective (on SmolLM2 it ends between 0.14 and 27; see benchmarks/README.md for what that does to perplexity).

The objective: for every layer, the mean squared error between the method's output and softmax attention's
on the same queries, keys and values, relative to the mean square of softmax attention's output (so layers
weigh alike), summed over the layers. The model runs with its own softmax attention (teacher forcing), so
each layer learns from the inputs it sees in the source model, and one forward and backward trains every
layer at once at the cost of the source's forward plus the method's.

After :func:`transfer_attention`, ``config.performer_learned_attention`` is True, ``A`` and the gains are written
to the config's ``performer_attention`` (per layer and head) and the learned tensors ride in the model's state
dict (submodule ``performer_attention`` of each attention module): ``save_pretrained`` writes them, and
``from_pretrained`` (which reports them as keys the source class does not know) reads them back on the first
forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from math import inf

import torch
from torch import nn
from tqdm.auto import tqdm

from ..modeling.attention_interface import transfer_hooked
from ..modeling.attention_settings import (
    CONFIG_ATTRIBUTE,
    LEARNED_ATTRIBUTE,
    LEARNED_DIGEST_ATTRIBUTE,
    LEARNED_SUBMODULE,
    METHOD_STATE_ATTRIBUTE,
    learned_digest,
    mark_current,
)
from ..modeling.far_fields import get_far_field
from ..modeling.favor_hybrid import fixed_centres
from ..modeling.method_exact import exact_max_length, softmax_attention
from ..modeling.modeling_performer import PerformerPreTrainedModel

logger = logging.getLogger(__name__)

MAX_FAR_FIELD_PARAMETER = 0.12  # FAVOR++'s A must stay below 1/8 (finite variance)
# The far-field gains' log moves this many times faster than the rest: a few hundred steps must be able to turn
# a far field down by orders of magnitude, while the centres and projections take small steps.
GAIN_LEARNING_RATE_FACTOR = 10.0
TRAINABLE_METHODS = {"favor", "hybrid"}  # the methods with learnable parts (the sparse method and exact have none)
# (config field, the learned tensor's name, the field's neutral value): per-head values that transfer learns and
# writes to the config
_CONFIG_VALUES = (("far_field_parameter", "far_field_parameter", 0.0), ("far_field_gain", "far_field_log_gain", 1.0))


@dataclass
class TransferReport:
    """What :func:`transfer_attention` did: steps, tokens, seconds, and the relative error per layer on the first
    ``window`` batches before any update (``error_first``) and as the model ends (``error_last``); ``restored``
    where the transfer ended above its start and the model kept the attention it had (then the two are equal)."""

    steps: int
    tokens: int
    seconds: float
    error_first: dict[int, float]
    error_last: dict[int, float]
    restored: bool = False

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 1),
            "relative_error_first": self.error_first,
            "relative_error_last": self.error_last,
            "restored": self.restored,
        }


@contextmanager
def _frozen(model: nn.Module):
    """``model`` in eval mode with its own parameters frozen; both as they were on exit, however it comes."""
    was_training = model.training
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.eval()
    for parameter in trainable:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in trainable:
            parameter.requires_grad_(True)
        model.train(was_training)


def _token_count(batch: Mapping[str, torch.Tensor]) -> int:
    """The tokens of a batch of ``input_ids`` (B, L) or ``inputs_embeds`` (B, L, hidden)."""
    if "input_ids" in batch:
        return int(batch["input_ids"].numel())
    return int(batch["inputs_embeds"].shape[:-1].numel())


def _states(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(attention module, its method state) for every module that has run Performer attention."""
    return [(m, m.__dict__[METHOD_STATE_ATTRIBUTE]) for m in model.modules() if METHOD_STATE_ATTRIBUTE in m.__dict__]


def _as_parameter(state: nn.Module, name: str) -> nn.Parameter:
    """Turn the buffer ``name`` of ``state`` into a trainable parameter (float32)."""
    tensor = state._buffers.pop(name).detach().float()
    parameter = nn.Parameter(tensor.clone())
    state.register_parameter(name, parameter)
    return parameter


def _as_buffer(state: nn.Module, name: str) -> None:
    tensor = state._parameters.pop(name).detach()
    state.register_buffer(name, tensor, persistent=True)


def _learnable(state: nn.Module) -> dict[str, nn.Parameter]:
    """Make the state's learnable parts parameters; returns them by name."""
    spec = getattr(state, "hybrid_spec", None)
    names = []
    if spec is None or spec.uses_projection:
        names.append("projection")
    if spec is not None and spec.center:
        names += ["query_center", "key_center"]
    learned = {name: _as_parameter(state, name) for name in names}
    if spec is not None and get_far_field(spec.far_field).uses_parameter:
        value = torch.as_tensor(state.far_field_parameter, dtype=torch.float32).expand(state.num_heads).clone()
        state.far_field_parameter = learned["far_field_parameter"] = nn.Parameter(value)  # (H,)
    if spec is not None:
        gain = torch.as_tensor(1.0 if state.far_field_gain is None else state.far_field_gain, dtype=torch.float32)
        learned["far_field_log_gain"] = nn.Parameter(gain.expand(state.num_heads).log())  # (H,)
        _use_gain(state, learned["far_field_log_gain"])
    return learned


def _use_gain(state: nn.Module, log_gain: nn.Parameter) -> None:
    """The gain the next forward uses, from its learned log (recomputed after every optimizer step)."""
    state.far_field_gain = log_gain.exp()  # (H,)


def _freeze(state: nn.Module, learned: dict[str, nn.Parameter]) -> dict[str, list[float]]:
    """Back to buffers; A (kept below 1/8 by the training loop) and the gains become plain numbers on the state,
    returned by config field."""
    values = {}
    for field, name, _ in _CONFIG_VALUES:
        if name in learned:
            numbers = learned[name].detach().exp() if name == "far_field_log_gain" else learned[name].detach()
            values[field] = [float(number) for number in numbers]
            state._parameters.pop(name, None)  # A was a registered parameter
            setattr(state, field, values[field])
    for name in learned:
        if name in state._parameters:
            _as_buffer(state, name)
    return values


def _relative_error(prediction: torch.Tensor, target: torch.Tensor, key_mask) -> torch.Tensor:
    """mean |prediction - target|^2 / mean |target|^2 over the real tokens; (B, H, L, D) inputs."""
    squared, reference = (prediction - target).pow(2).sum(-1), target.pow(2).sum(-1)  # (B, H, L)
    if key_mask is not None:
        weight = key_mask[:, None, -target.shape[2] :].to(squared.dtype)  # (B, 1, L): the queries' own tokens
        squared, reference = squared * weight, reference * weight
    return squared.sum() / reference.sum().clamp_min(1e-12)


def transfer_attention(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    steps: int,
    learning_rate: float = 1e-2,
    window: int = 10,
    progress: bool = True,
) -> TransferReport:
    """Train the Performer attention of ``model`` (loaded with ``attn_implementation="performer"`` or
    ``"performer_hybrid"``) to match its softmax attention on ``batches`` of unlabelled text.

    Args:
        model: the model; its own weights are frozen (and left untouched).
        batches: model inputs (``input_ids`` or ``inputs_embeds``, optionally ``attention_mask``); step ``i``
            takes batch ``i % len(batches)``.
            Inputs longer than the hybrid's window, so that its far field is in use.
        steps: optimizer steps (Adam).
        learning_rate: Adam's learning rate.
        window: the first ``window`` batches measure the report's errors, before any update and after the last
            one. Where the error after is the larger, the model keeps its attention as it was, with a warning.
        progress: show a tqdm bar.

    Returns:
        A :class:`TransferReport`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1, got {steps!r}.")
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, int | float) or not 0 <= learning_rate < inf:
        raise ValueError(f"learning_rate must be a finite number >= 0, got {learning_rate!r}.")
    batches = list(batches)
    if not batches:
        raise ValueError("no batches to train on.")
    if not all(isinstance(batch, Mapping) for batch in batches):
        raise ValueError(
            "each batch is a dict of the model's inputs ({'input_ids': ..., 'attention_mask': ...}, as text_batches() "
            f"gives them), got a {type(next(b for b in batches if not isinstance(b, Mapping))).__name__}."
        )
    if isinstance(model, PerformerPreTrainedModel):
        raise ValueError(
            f"{type(model).__name__} is a Performer-family model (converted from BERT / RoBERTa / GPT-2): attention "
            "transfer trains the attention of models that keep their class (Llama, Mistral, Qwen, Gemma3: "
            "performer_hf.convert, or attn_implementation='performer_hybrid'); the family calibrates its far field "
            "at conversion instead (performer-hf convert SRC OUT --calibrate)."
        )
    if getattr(model, "peft_config", None):  # a PeftModel, or a model peft injected adapters into
        raise ValueError(
            "this model carries peft adapters: their save (the adapter) would hold none of what the transfer learns "
            "(the trained attention tensors, A and the far-field gains go to the base model's weights and config), "
            "so PeftModel.from_pretrained(base, adapter) would run other attention. Transfer the base model, save it "
            "(save_pretrained), then add LoRA on the saved model."
        )
    _check_inputs(model, batches)
    # (under the caller's no_grad or inference_mode too: the transfer trains)
    with _frozen(model), torch.inference_mode(False), torch.enable_grad():
        with torch.no_grad():
            model(**batches[0])  # builds every layer's method state
        states = _states(model)
        if not states:
            raise ValueError(
                "the model runs no Performer attention: load it with attn_implementation='performer_hybrid' (or "
                "'performer'), or convert it with performer_hf.convert."
            )
        untrainable = sorted({state.attention_method for _, state in states} - TRAINABLE_METHODS)
        if untrainable:
            raise ValueError(
                f"attention transfer trains the far field's parts, and the {untrainable[0]!r} method has none: load "
                "the model with attn_implementation='performer_hybrid' (or 'performer') to transfer."
            )
        measured = batches[: max(1, min(window, len(batches)))]
        # a refused, diverged or interrupted transfer, or one that ends worse than it began, leaves them as they were
        with _restored_on_failure(states) as restore:
            before = _measure(model, measured)
            learned, tokens, start = _train(model, batches, steps, learning_rate, progress, states)
            after = _measure(model, measured)
            worse = _overall(after) > _overall(before)
            if worse:
                restore()
    if worse:
        logger.warning(
            "attention transfer ended with a larger error than it began with (mean relative error per layer %.3g -> "
            "%.3g on the first %d batches): the model keeps the attention it had. Its far field may be near-exact "
            "already; otherwise try fewer steps or a lower learning_rate (it was %g).",
            _overall(before),
            _overall(after),
            len(measured),
            learning_rate,
        )
    else:
        _record(model, states, learned)
    report = TransferReport(
        steps, tokens, time.perf_counter() - start, before, before if worse else after, restored=worse
    )
    logger.info(
        "attention transfer: %d steps, %d tokens, %.0f s; mean relative error %.4f -> %.4f",
        report.steps,
        tokens,
        report.seconds,
        _overall(report.error_first),
        _overall(report.error_last),
    )
    return report


def _matching_softmax(layer_errors: dict[int, torch.Tensor]):
    """The transfer hook: each layer's method against softmax attention on its inputs, its relative error recorded
    in ``layer_errors`` by layer; the layer passes softmax attention's output on (teacher forcing)."""

    def match_softmax(state, attend, q, k, v, key_mask, causal, window):
        with torch.no_grad():  # (B, H, L, D): the source's attention (within Mistral's window, where it has one)
            target, _ = softmax_attention(q, k, v, key_mask, causal, window=window)
        prediction, _ = attend(q, k, v, key_mask, causal)  # the method as the model runs it
        layer_errors[state.layer_idx] = _relative_error(prediction, target, key_mask)
        return target

    return match_softmax


@torch.no_grad()
def _measure(model: nn.Module, batches: list) -> dict[int, float]:
    """Each layer's relative error on ``batches`` (their mean), as the transfer trains it, with no update."""
    records, layer_errors = [], {}
    with transfer_hooked(_matching_softmax(layer_errors)):
        for batch in batches:
            layer_errors.clear()
            model(**batch)
            records.append(dict(layer_errors))
    return _mean([{layer: float(error) for layer, error in record.items()} for record in records])


def _check_inputs(model: nn.Module, batches: list) -> None:
    """Refuse, before any forward, batches that would fail with another reason: token ids outside the model's
    vocabulary (another model's tokenizer), or a batch whose attention_mask leaves no real token (a row of padding
    alone trains beside the others)."""
    vocabulary = getattr(getattr(model, "config", None), "get_text_config", lambda: None)()
    vocabulary = getattr(vocabulary, "vocab_size", None)
    for index, batch in enumerate(batches):
        ids = batch.get("input_ids")
        if vocabulary is not None and ids is not None and ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= vocabulary:
                raise ValueError(
                    f"batch {index} holds token ids from {low} to {high}, outside the model's vocabulary (0 to "
                    f"{vocabulary - 1}): tokenize the text with the model's own tokenizer."
                )
        mask = batch.get("attention_mask")
        if mask is not None and not bool(mask.bool().any()):
            raise ValueError(
                f"batch {index}'s attention_mask is all zeros: it has no real token to train on. Leave it out, or give "
                "it text."
            )


def _nothing_approximated(states, batch: Mapping[str, torch.Tensor]) -> str:
    """Why no layer's approximation was in use on ``batch``: a bidirectional model's exact dispatch
    (``exact_max_length``) or the hybrid's exact support, with the fix for each."""
    length = (batch["input_ids"] if "input_ids" in batch else batch["inputs_embeds"]).shape[1]
    bidirectional = [state for _, state in states if not state.performer_key[1]]
    if bidirectional:
        state = bidirectional[0]
        reach = exact_max_length(state, state.projection.device)
        if length <= reach:
            field = "exact_max_length" if reach == state.exact_max_length else "accelerator_exact_max_length"
            return (
                f"no layer's approximation was in use: {field}={reach} keeps bidirectional inputs of at most {reach} "
                f"tokens exact, and these have {length}. Set it to 0 in config.performer_attention to transfer (the "
                "model then approximates at every length)."
            )
    return (
        "no layer's approximation was in use (the inputs are within the hybrid's exact window, or attention_kernel "
        "is 'exact'): train on longer inputs."
    )


def _train(model: nn.Module, batches: list, steps: int, learning_rate: float, progress: bool, states):
    """:func:`transfer_attention`'s optimisation: returns the learned tensors per state, the tokens read and the
    start time."""
    _centre_on_the_source(model, batches[0], states)
    learned = [_learnable(state) for _, state in states]
    gains = [
        (state, parameters["far_field_log_gain"])
        for (_, state), parameters in zip(states, learned, strict=True)
        if "far_field_log_gain" in parameters
    ]
    tensors = [p for parameters in learned for name, p in parameters.items() if name != "far_field_log_gain"]
    optimizer = torch.optim.Adam(
        [
            {"params": tensors},
            {"params": [log_gain for _, log_gain in gains], "lr": learning_rate * GAIN_LEARNING_RATE_FACTOR},
        ],
        lr=learning_rate,
    )
    far_field_parameters = [
        parameters["far_field_parameter"] for parameters in learned if "far_field_parameter" in parameters
    ]
    layer_errors: dict[int, torch.Tensor] = {}
    start, tokens = time.perf_counter(), 0
    with transfer_hooked(_matching_softmax(layer_errors)):
        for step in tqdm(range(steps), desc="attention transfer", disable=not progress):
            batch = batches[step % len(batches)]
            layer_errors.clear()
            model(**batch)
            loss = torch.stack(list(layer_errors.values())).sum()
            if not loss.requires_grad:
                raise ValueError(_nothing_approximated(states, batch))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for parameter in far_field_parameters:
                    parameter.clamp_(max=MAX_FAR_FIELD_PARAMETER)
            used_gains = [log_gain.exp() for _, log_gain in gains]  # a gain of 0 or inf stops the far field
            healthy = [torch.isfinite(t).all() for t in (loss, *tensors, *used_gains)]
            healthy += [(gain > 0).all() for gain in used_gains]
            if not bool(torch.stack(healthy).all()):  # one read of the device per step
                raise ValueError(
                    f"attention transfer diverged at step {step + 1} (a loss or a learned tensor is not finite): "
                    f"lower learning_rate (it was {learning_rate})."
                )
            for state, log_gain in gains:
                _use_gain(state, log_gain)
            tokens += _token_count(batch)
            logger.debug("transfer step %d: summed relative error %.4f", step + 1, float(loss.detach()))
    return learned, tokens, start


_RESTORED_BUFFERS = ("projection", "query_center", "key_center")  # what the transfer may turn into parameters
_RESTORED_VALUES = ("far_field_parameter", "far_field_gain")  # and the plain values it replaces


@contextmanager
def _restored_on_failure(states):
    """The states' learnable tensors and values as they were, should the block raise (a refusal, a diverged loss, an
    interruption): a retry starts from the model the user had. Yields the function that restores them."""
    saved = [
        (
            state,
            {name: state._buffers[name].clone() for name in _RESTORED_BUFFERS if state._buffers.get(name) is not None},
            {name: getattr(state, name) for name in _RESTORED_VALUES if hasattr(state, name)},
        )
        for _, state in states
    ]

    def restore() -> None:
        for state, buffers, values in saved:
            for name, tensor in buffers.items():
                state._parameters.pop(name, None)
                state.register_buffer(name, tensor, persistent=True)
            for name, value in values.items():
                state._parameters.pop(name, None)
                setattr(state, name, value)

    try:
        yield restore
    except BaseException:
        restore()
        raise


@torch.no_grad()
def _centre_on_the_source(model: nn.Module, batch: dict[str, torch.Tensor], states) -> None:
    """Start the hybrid's fixed centres at the source's mean scaled query and key per head on ``batch``
    (as the converter's calibration does): gradient steps alone would move them from zero far too slowly."""
    centred = [state for _, state in states if getattr(getattr(state, "hybrid_spec", None), "center", False)]
    if not centred:
        return
    means = {}

    def record_means(state, attend, q, k, v, key_mask, causal, window):
        means[state.layer_idx] = fixed_centres(q.float(), k.float(), key_mask)  # (H, d) each
        return softmax_attention(q, k, v, key_mask, causal, window=window)[0]

    with transfer_hooked(record_means):
        model(**batch)
    for state in centred:
        query_mean, key_mean = means[state.layer_idx]
        state.query_center.copy_(query_mean)
        state.key_center.copy_(key_mean)


def text_batches(tokenizer, texts: Iterable[str], length: int, count: int) -> list[dict[str, torch.Tensor]]:
    """Up to ``count`` batches for :func:`transfer_attention`: consecutive ``length``-token windows
    ``{"input_ids": (1, length)}`` of ``texts`` joined by blank lines (fewer when the text runs out)."""
    if isinstance(texts, str | bytes):
        raise ValueError(
            "texts is a list of texts, got a single string (it would be read character by character): pass [text]."
        )
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"length is the tokens of a window, at least 2, got {length!r}.")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count is the number of windows, at least 1, got {count!r}.")
    ids = tokenizer("\n\n".join(texts), return_tensors="pt", verbose=False).input_ids[0]  # (N,)
    windows = min(count, ids.numel() // length)
    if windows == 0:
        raise ValueError(
            f"the transfer text has {ids.numel()} tokens, fewer than one window of {length}: give more text or "
            "a shorter length."
        )
    return [{"input_ids": ids[i * length : (i + 1) * length][None]} for i in range(windows)]


def _record(model: nn.Module, states, learned: list[dict[str, nn.Parameter]]) -> None:
    """Learned tensors into the state dict (submodules), A and the gains into the config, the flag that says so."""
    config = model.config.get_text_config()
    per_layer: dict[str, dict[int, list[float]]] = {}  # config field -> layer -> one number per head
    for (module, state), parameters in zip(states, learned, strict=True):
        for field, values in _freeze(state, parameters).items():
            per_layer.setdefault(field, {})[state.layer_idx] = values
        module.add_module(LEARNED_SUBMODULE, state)
    if per_layer:
        settings = dict(getattr(config, CONFIG_ATTRIBUTE))
        heads = states[0][1].num_heads
        for field, _, neutral in _CONFIG_VALUES:
            if field in per_layer:
                default = settings.get(field, neutral)
                layers = range(config.num_hidden_layers)
                settings[field] = [per_layer[field].get(i, _row(default, neutral, i, heads)) for i in layers]
        setattr(config, CONFIG_ATTRIBUTE, settings)
    setattr(config, LEARNED_ATTRIBUTE, True)
    setattr(config, LEARNED_DIGEST_ATTRIBUTE, learned_digest([state for _, state in states]))
    for _, state in states:  # the settings changed on purpose: keep the learned states
        mark_current(state, config, config._attn_implementation, state.performer_key[1])


def _row(default, neutral: float, layer: int, heads: int) -> list[float]:
    """A layer transfer did not train (one that keeps its own attention): its configured values per head."""
    if isinstance(default, list):
        return list(default[layer])
    return [float(neutral if default is None else default)] * heads


def _mean(records: list[dict[int, float]]) -> dict[int, float]:
    layers = sorted({layer for record in records for layer in record})
    return {layer: sum(r[layer] for r in records) / len(records) for layer in layers}


def _overall(errors: dict[int, float]) -> float:
    return sum(errors.values()) / max(len(errors), 1)
