"""Where the Performer attention of a transformers model class that is not ours keeps its settings.

A model loaded with ``attn_implementation="performer"``, ``"performer_hybrid"`` or ``"performer_sparse"`` (a
``LlamaForCausalLM``, a ``BertModel``, ...) has no Performer fields in its config and no Performer buffers in its
weights. Both are derived from one config attribute, ``performer_attention``: a dict of ``PerformerConfig``'s attention
fields (``attention_kernel``, ``nb_features``, ``projection_seed``, ``local_window``, ...). Fields it does
not name take the method's preset (:data:`IMPLEMENTATIONS`). On first use the resolved dict is written back
to the config, together with ``attn_implementation``, so that ``save_pretrained`` records both and the saved
folder loads with the same attention without being told (once ``performer_hf`` is imported).

Each attention module gets an :class:`~performer_hf.modeling.layers_performer.AttentionMethodState` beside
it (not a submodule: the model's weights stay the source's): the random projection drawn from
``projection_seed + layer_idx``, as in the Performer family, so the outputs are reproducible from the config.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import re
import weakref
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn

from .attention_methods import ATTENTION_FIELDS, ATTENTION_METHODS, preset_under
from .compiled_lengths import exporting
from .configuration_performer import PerformerConfig
from .far_fields import FAR_FIELDS
from .layers_performer import AttentionMethodState

logger = logging.getLogger(__name__)

CONFIG_ATTRIBUTE = "performer_attention"

_DEFAULTS = {name: getattr(PerformerConfig(), name) for name in ATTENTION_FIELDS if name != "attention_method"}

# attn_implementation name -> the method's presets for bidirectional and causal models. "performer": plain
# FAVOR+ (PerformerConfig's defaults). "performer_hybrid": the converter's hybrid presets, except that causal
# models get no exact prefix (exact_max_length=0), so that their decoding state is constant from the first
# token, and FAVOR++'s A is 0 (plain positive features) with zero centres until calibrated (A only where the far
# field is FAVOR++'s: another kernel has none, see resolved_settings). Settings that do not name their
# attention_method take the name's.
# "performer_sparse": the sparse method (causal only), whose decoding state stays per key/value head.
IMPLEMENTATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "performer": ATTENTION_METHODS["favor"].presets,
    "performer_sparse": {"causal": {"attention_method": "sparse", **ATTENTION_METHODS["sparse"].presets["causal"]}},
    "performer_hybrid": {
        "bidirectional": ATTENTION_METHODS["hybrid"].presets["bidirectional"],
        "causal": {**ATTENTION_METHODS["hybrid"].presets["causal"], "exact_max_length": 0, "far_field_parameter": 0.0},
    },
}


# the attention method each attn_implementation name runs (the "exact" kernel runs under any of them)
METHOD_OF_IMPLEMENTATION = {"performer": "favor", "performer_hybrid": "hybrid", "performer_sparse": "sparse"}
IMPLEMENTATION_OF_METHOD = {method: name for name, method in METHOD_OF_IMPLEMENTATION.items()}


# the config attribute holding the settings it had for other methods, set aside as its model switched methods
# (set_attn_implementation) and taken back when it switches back: {method: settings}. A config attribute, so that
# deepcopy, pickle and save_pretrained carry it (a folder saved after a switch loads back either method's settings).
SET_ASIDE_ATTRIBUTE = "performer_attention_set_aside"


def _set_aside(config, method: str, settings: dict[str, Any]) -> None:
    setattr(config, SET_ASIDE_ATTRIBUTE, {**_settings_set_aside(config), method: settings})


def _settings_set_aside(config) -> dict[str, dict[str, Any]]:
    kept = getattr(config, SET_ASIDE_ATTRIBUTE, None) or {}
    if not isinstance(kept, dict):
        raise ValueError(
            f"config.{SET_ASIDE_ATTRIBUTE} must be a dict of attention method name -> settings (written by "
            f"set_attn_implementation), got {type(kept).__name__} {kept!r}; delete it to start from the presets."
        )
    return kept


def resolved_settings(config, implementation: str, causal: bool) -> dict[str, Any]:
    """The attention fields for ``config``'s model under ``implementation``: the preset, overridden by
    ``config.performer_attention``; recorded on the config (with ``attn_implementation``) on first use. Settings
    that name another implementation's method (a converted folder loaded with another ``attn_implementation``) give
    way to ``implementation``'s preset, with a warning, or to the settings the config held for that method before
    its model switched to another (``set_attn_implementation``)."""
    given = getattr(config, CONFIG_ATTRIBUTE, None) or {}
    if not isinstance(given, dict):
        raise ValueError(
            f"config.{CONFIG_ATTRIBUTE} must be a dict of PerformerConfig's attention fields (e.g. "
            f"{{'local_window': 512}}), got {type(given).__name__} {given!r}."
        )
    named, wanted = given.get("attention_method"), METHOD_OF_IMPLEMENTATION[implementation]
    if named in METHOD_OF_IMPLEMENTATION.values() and named != wanted:
        earlier = _settings_set_aside(config).get(wanted)
        _set_aside(config, named, given)
        if earlier is None:
            logger.warning(
                "config.%s holds settings of the %r method, but the model was loaded with attn_implementation=%r: "
                "it runs the %r method with its preset (load it, or switch back, with attn_implementation=%r to "
                "keep those settings).",
                CONFIG_ATTRIBUTE,
                named,
                implementation,
                wanted,
                IMPLEMENTATION_OF_METHOD[named],
            )
        given = earlier or {}
    unknown = sorted(set(given) - set(ATTENTION_FIELDS))
    if unknown:
        raise ValueError(
            f"config.{CONFIG_ATTRIBUTE} has unknown fields {unknown}; it takes PerformerConfig's attention fields: "
            f"{', '.join(ATTENTION_FIELDS)}."
        )
    direction = "causal" if causal else "bidirectional"
    if direction not in IMPLEMENTATIONS[implementation]:
        raise ValueError(
            f"attn_implementation={implementation!r} is causal only; this {type(config).__name__} attends "
            "bidirectionally. Use attn_implementation='performer_hybrid' for encoders."
        )
    preset = preset_under(IMPLEMENTATIONS[implementation][direction], given)
    # every field explicit, so that a later release's defaults cannot change a saved model
    settings = {**_DEFAULTS, **preset, **given}
    far_field = FAR_FIELDS.get(settings.get("attention_kernel"))
    if "far_field_parameter" not in given and (far_field is None or not far_field.uses_parameter):
        # the preset's A is FAVOR++'s (softmax_opt): another far field takes none, and refuses one
        settings["far_field_parameter"] = _DEFAULTS["far_field_parameter"]
    if "attention_method" not in given and "attention_method" not in preset:
        # the implementation's method (or exact attention, under any name): fields it does not read are refused
        # with the fix (PerformerConfig), not read as another method's
        exact = settings.get("attention_kernel") == "exact"
        settings["attention_method"] = "exact" if exact else METHOD_OF_IMPLEMENTATION[implementation]
    if getattr(config, CONFIG_ATTRIBUTE, None) != settings:
        setattr(config, CONFIG_ATTRIBUTE, settings)
    if getattr(config, "attn_implementation", None) != implementation:
        # a plain attribute: saved to config.json, where transformers reads it back as the implementation
        config.attn_implementation = implementation
    _drop_shipped_class(config)
    return settings


SHIPPED_MODULE = "modeling_in_place"  # the module a converted folder's code names in config.json's auto_map


def _drop_shipped_class(config) -> None:
    """Remove the ``auto_map`` entries that name a converted folder's shipped class (kept in the config of a model
    loaded from the folder as transformers' own class): that class's ``save_pretrained`` writes no code, so they would
    name files its folder lacks (``trust_remote_code=True`` then fails there). The shipped class, whose
    ``save_pretrained`` writes its code, names itself again as it saves."""
    auto_map = getattr(config, "auto_map", None)
    if isinstance(auto_map, dict) and any(str(name).startswith(f"{SHIPPED_MODULE}.") for name in auto_map.values()):
        kept = {auto: name for auto, name in auto_map.items() if not str(name).startswith(f"{SHIPPED_MODULE}.")}
        if kept:
            config.auto_map = kept
        else:
            del config.auto_map


def mixes_sliding_and_full_layers(config) -> bool:
    """Whether the model's ``layer_types`` name sliding-window layers beside full-attention ones (Gemma3, a Qwen2 with
    ``max_window_layers`` between 0 and its depth). A model that slides on every layer (a Qwen2 with
    ``max_window_layers=0``, a Mistral config that names ``layer_types``) has no full layer to convert beside them: all
    its layers take Performer attention, as a Mistral whose config names only ``sliding_window``."""
    layer_types = getattr(config, "layer_types", None) or ()
    return "sliding_attention" in layer_types and any(kind != "sliding_attention" for kind in layer_types)


def keeps_own_attention(config, layer_idx: int) -> bool:
    """Whether the layer is a sliding-window layer of a model that mixes sliding and full layers."""
    return mixes_sliding_and_full_layers(config) and config.layer_types[layer_idx] == "sliding_attention"


def head_shape(config) -> tuple[int, int]:
    """(query heads, head dim) of a transformers text config."""
    text_config = config.get_text_config()
    heads = text_config.num_attention_heads
    return heads, getattr(text_config, "head_dim", None) or text_config.hidden_size // heads


def method_config(config, implementation: str, causal: bool, num_heads: int, head_dim: int) -> PerformerConfig:
    """A ``PerformerConfig`` that carries only the attention method for a model with these head shapes (its
    validation checks the settings)."""
    settings = resolved_settings(config, implementation, causal)
    try:
        return PerformerConfig(
            hidden_size=num_heads * head_dim,
            num_attention_heads=num_heads,
            num_hidden_layers=config.get_text_config().num_hidden_layers,
            is_decoder=causal,
            attention_probs_dropout_prob=0.0,
            **settings,
        )
    except (ValueError, StrictDataclassError) as error:  # the validation's own reason, without its traceback
        # here the attn_implementation names the method, not a field
        reason = re.sub(
            r"set attention_method='(\w+)'",
            lambda match: f"load the model with attn_implementation={IMPLEMENTATION_OF_METHOD.get(match[1])!r}",
            str(error.__cause__ or error),
        )
        raise ValueError(f"config.{CONFIG_ATTRIBUTE} under attn_implementation={implementation!r}: {reason}") from None


def is_current(
    state: AttentionMethodState, config, implementation: str, causal: bool, num_heads: int, head_dim: int
) -> bool:
    """Whether ``state`` was built for these settings and head shapes (checked at every call: a dict
    comparison, cheaper than formatting the settings)."""
    return state.performer_key == (implementation, causal, num_heads, head_dim) and (
        state.performer_settings == getattr(config, CONFIG_ATTRIBUTE, None)
    )


def mark_current(state: AttentionMethodState, config, implementation: str, causal: bool) -> None:
    """Record what ``state`` is built from (see :func:`is_current`)."""
    state.performer_key = (implementation, causal, state.num_heads, state.head_dim)
    state.performer_settings = copy.deepcopy(getattr(config, CONFIG_ATTRIBUTE, None))


METHOD_STATE_ATTRIBUTE = "_performer_method_state"  # where an attention module keeps its method's state


def method_state(module: nn.Module, implementation: str, causal: bool, query: torch.Tensor) -> AttentionMethodState:
    """The :class:`AttentionMethodState` kept beside ``module`` (built on first use, rebuilt when the settings,
    the head shapes or the implementation change), on ``query``'s device. A model whose attention parameters
    were trained (``config.performer_learned_attention``, see ``attention_transfer.py``) keeps its state as the
    submodule ``performer_attention``, whose tensors the checkpoint holds."""
    num_heads, head_dim = query.shape[1], query.shape[-1]
    config = module.config
    state = module.__dict__.get(METHOD_STATE_ATTRIBUTE)
    emptied = state is not None and state.projection.is_meta and not query.is_meta  # a forward on "meta" took it
    with _real_tensors():
        if state is None or emptied or not is_current(state, config, implementation, causal, num_heads, head_dim):
            state = _build_state(module, implementation, causal, num_heads, head_dim)
        if state.projection.device != query.device:
            state.to(query.device)
    return state


def _real_tensors() -> contextlib.AbstractContextManager:
    """Where a state is built or moved to another device while ``torch.export`` traces the model: tensors made there
    are fake (shapes without data), and a state of fake tensors kept beside the module left every later call computing
    on garbage (an in-place Llama: NaN logits from the exported program and from eager calls after it). Built with
    fake tensors off, its tensors are real, and the exported program holds them as constants."""
    # (under torch.export(strict=True) dynamo traces instead, and refuses the build, which it cannot trace, by name)
    if not exporting():
        return contextlib.nullcontext()
    # (no public form, torch 2.11 to 2.15: with the fake mode alone off, the tracing mode recorded the draw into the
    # program, which then drew features anew at every call)
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


# traced, building (the features' draw, host reads) broke the graph a dozen times a layer
@torch.compiler.disable(
    reason="the attention method's state (its random features) is built at the first forward: under "
    "torch.export(strict=True), call the model once before exporting, or export with strict=False (the default)"
)
def _build_state(
    module: nn.Module, implementation: str, causal: bool, num_heads: int, head_dim: int
) -> AttentionMethodState:
    """A new :class:`AttentionMethodState` for ``module`` (see :func:`method_state`), kept beside it."""
    config = module.config
    built = method_config(config, implementation, causal, num_heads, head_dim)
    with torch.device("cpu"):
        state = AttentionMethodState(built, module.layer_idx)
    if getattr(config, LEARNED_ATTRIBUTE, False) and not _take_learned_tensors(module, state):
        if module.layer_idx == 0:  # once per model, not per layer
            logger.warning(
                "this model's trained attention tensors are another method's than the %r it runs now "
                "(attn_implementation=%r): it runs that method's own preset without them",
                built.attention_method,
                implementation,
            )
    mark_current(state, config, implementation, causal)
    # otherwise a plain attribute, not a submodule: the model's state dict stays the source's
    module.__dict__[METHOD_STATE_ATTRIBUTE] = state
    logger.debug("layer %d: %s attention, %s", module.layer_idx, implementation, built.attention_method)
    return state


def attach_learned_attention(model: nn.Module, read: bool) -> None:
    """Give each Performer attention module of a model trained with attention transfer
    (``config.performer_learned_attention``) its learned tensors' submodule ``performer_attention`` now rather than
    at its first forward: built from the settings (``read=False``, at construction: ``from_pretrained`` then loads
    the checkpoint's tensors into it as into any weights, from wherever it loads those, a subfolder or a revision
    too), or read from the checkpoint the model was loaded from (``read=True``: before a model that has not run is
    saved). Nothing for other models, for modules that have it, or for another method's tensors (the first
    forward warns)."""
    for module in model.modules():
        config, layer_idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
        if config is None or layer_idx is None or not type(module).__name__.endswith("Attention"):
            continue
        implementation = getattr(config, "_attn_implementation", None)
        if not getattr(config, LEARNED_ATTRIBUTE, False) or LEARNED_SUBMODULE in module._modules:
            continue
        if implementation not in IMPLEMENTATIONS or keeps_own_attention(config, layer_idx):
            continue
        with torch.device("cpu"):
            state = AttentionMethodState(method_config(config, implementation, True, *head_shape(config)), layer_idx)
        if read:
            _take_learned_tensors(module, state)
        else:
            module.add_module(LEARNED_SUBMODULE, state)


def _take_learned_tensors(module: nn.Module, state: AttentionMethodState) -> bool:
    """Load ``state`` with ``module``'s trained tensors (its ``performer_attention`` submodule's, else those of the
    checkpoint it was loaded from) and make it that submodule, so that ``save_pretrained`` keeps them. False, with
    ``state`` untouched, where they are another method's."""
    config, learned = module.config, module._modules.get(LEARNED_SUBMODULE)
    if learned is not None:
        tensors = learned.state_dict()
    else:
        path = _checkpoint_path(config)
        tensors = _checkpoint_tensors(config, path, module.layer_idx)
        if path not in _REPORTED_CHECKPOINTS:  # once per checkpoint, not per layer
            _REPORTED_CHECKPOINTS.add(path)
            logger.info(
                "read the trained Performer attention tensors from %s (transformers' load report lists them as "
                "unexpected keys: the model class does not declare them)",
                path,
            )
    if not _fits(state, tensors):
        return False
    if learned is None:
        _check_same_checkpoint(config, path)
    state.load_state_dict(tensors)
    module.add_module(LEARNED_SUBMODULE, state)
    return True


def _fits(state: AttentionMethodState, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether ``tensors`` are ``state``'s own: the same names and shapes (a trained hybrid's centres do not fit the
    FAVOR+ state of a model loaded with another attn_implementation)."""
    own = state.state_dict()
    return own.keys() == tensors.keys() and all(own[name].shape == tensors[name].shape for name in own)


LEARNED_ATTRIBUTE = "performer_learned_attention"
LEARNED_DIGEST_ATTRIBUTE = "performer_learned_digest"  # which trained tensors the config goes with


def learned_digest(states) -> str:
    """A digest of the trained tensors of ``states`` (method states, any order): the config records it, so that a
    checkpoint's tensors are known to be the ones its config was saved with."""
    digest = hashlib.sha256()
    for state in sorted(states, key=lambda state: state.layer_idx):
        for name, tensor in sorted(state.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


_REPORTED_CHECKPOINTS: set[str] = set()
LEARNED_SUBMODULE = "performer_attention"


def _checkpoint_tensors_of(path: str, layer_idx: int) -> dict[str, torch.Tensor]:
    """Layer ``layer_idx``'s learned attention tensors in the checkpoint at ``path`` (a folder or Hub id): the
    entries ``<...>.<layer index>.<...>.performer_attention.<name>`` of its safetensors weights."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    single = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False)
    if single is not None:
        files = [single]
    else:
        index = cached_file(path, "model.safetensors.index.json")
        with open(index) as handle:
            weight_map = json.load(handle)["weight_map"]
        names = sorted({file for key, file in weight_map.items() if f".{LEARNED_SUBMODULE}." in key})
        files = [cached_file(path, name) for name in names]
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                match = _LEARNED_KEY.search(key)
                if match and int(match["layer"]) == layer_idx:
                    tensors[match["name"]] = handle.get_tensor(key)
    return tensors


_LEARNED_KEY = re.compile(rf"\.(?P<layer>\d+)\.(?:[^.]+\.)*?{LEARNED_SUBMODULE}\.(?P<name>\w+)$")


# the settings attention transfer trains beside the tensors: a checkpoint whose config holds others is another one
_TRAINED_SETTINGS = ("far_field_parameter", "far_field_gain")

# the checkpoint folder found under a model's recorded path: {id(config): (recorded path, folder)}, dropped with it
_FOUND_CHECKPOINTS: dict[int, tuple[str, str]] = {}


def _saved_config(path: str) -> dict[str, Any] | None:
    """The config.json of the checkpoint at ``path`` (a folder or Hub id), or None where it cannot be read."""
    from transformers.utils import cached_file

    try:
        file = cached_file(path, "config.json")
        if file is None:  # (a local folder without one)
            return None
        with open(file) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _checkpoint_path(config) -> str:
    """The checkpoint that ``config``'s model was loaded from: ``config._name_or_path``, or, where that is a local
    folder whose config.json does not record the model's trained tensors (their digest), the folder under it whose
    config.json does. transformers records the path alone, not the ``subfolder=`` the model was loaded from."""
    recorded, digest = str(config._name_or_path), getattr(config, LEARNED_DIGEST_ATTRIBUTE, None)
    found = _FOUND_CHECKPOINTS.get(id(config))
    if found is not None and found[0] == recorded:
        return found[1]
    if digest is None or not os.path.isdir(recorded) or _digest_at(recorded) == digest:
        return recorded
    for folder, subfolders, files in os.walk(recorded):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))  # (.git, caches)
        if folder != recorded and "config.json" in files and _digest_at(folder) == digest:
            if id(config) not in _FOUND_CHECKPOINTS:
                weakref.finalize(config, _FOUND_CHECKPOINTS.pop, id(config), None)
            _FOUND_CHECKPOINTS[id(config)] = (recorded, folder)
            return folder
    return recorded  # (no folder under it: reading it refuses with the reason)


def _digest_at(path: str) -> str | None:
    """The trained tensors' digest that the checkpoint at ``path`` records, if any."""
    return (_saved_config(path) or {}).get(LEARNED_DIGEST_ATTRIBUTE)


def _check_same_checkpoint(config, path: str) -> None:
    """Refuse to read the trained tensors from the checkpoint at ``path`` (see :func:`_checkpoint_path`) whose trained
    settings are not the model's: transformers records the path alone, so a model loaded from a subfolder of a Hub
    repo or another revision of it would run with the tensors of the checkpoint at the path's root, or of its main
    revision."""
    checkpoint = _saved_config(path)
    if checkpoint is None:  # out of reach now: reading its tensors says so
        return
    saved, own = checkpoint.get(CONFIG_ATTRIBUTE) or {}, getattr(config, CONFIG_ATTRIBUTE, None) or {}
    digest = getattr(config, LEARNED_DIGEST_ATTRIBUTE, None)  # (configs saved before it: the settings alone)
    other_tensors = digest is not None and checkpoint.get(LEARNED_DIGEST_ATTRIBUTE) != digest
    if other_tensors or any(name in saved and name in own and saved[name] != own[name] for name in _TRAINED_SETTINGS):
        raise ValueError(
            f"this model's trained attention tensors are read from its checkpoint at the first forward, but the "
            f"checkpoint at {path!r} is not the one it was loaded from (another subfolder or "
            "revision: its trained tensors or settings differ). Load it with trust_remote_code=True (the folder's "
            "class loads the trained tensors with the weights), or from the checkpoint folder's own path."
        )


def _checkpoint_tensors(config, path: str, layer_idx: int) -> dict[str, torch.Tensor]:
    """Layer ``layer_idx``'s trained tensors in the checkpoint at ``path``, refused with the reason where it holds
    none or cannot be read."""
    try:
        tensors = _checkpoint_tensors_of(path, layer_idx)
    except OSError as error:  # the folder moved or deleted, a Hub id out of reach, or a Hub subfolder's model
        raise ValueError(
            f"this model's trained attention parameters are read from its checkpoint at the first forward, and "
            f"{path!r} cannot be read now ({type(error).__name__}). transformers records the path alone: a model "
            "loaded with subfolder= (from a Hub repo, or from a folder whose copy of it has gone) loads with "
            "trust_remote_code=True (the folder's class loads the trained tensors with the weights) or from the "
            "subfolder's own path; otherwise load the model again from where its folder is (or keep the folder "
            "until the model has run once)."
        ) from error
    if not tensors:
        _check_same_checkpoint(config, path)  # a subfolder's model under an untransferred root: that says so
        raise ValueError(
            f"config.{LEARNED_ATTRIBUTE} says this model's attention parameters were trained, but its checkpoint "
            f"({path!r}) holds no '{LEARNED_SUBMODULE}' tensors. Save the model with save_pretrained "
            "after its first forward (or after transfer_attention) so that they are written."
        )
    return tensors
