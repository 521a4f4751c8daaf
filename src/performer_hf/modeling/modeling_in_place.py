"""The remote code of a model converted in place (Llama, Mistral, Qwen2, Qwen3, Gemma3).

A converted folder ships this module with its siblings and names its class here in ``config.json``'s ``auto_map``, so
that ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads it where performer_hf is not
installed. Where it is imported, the folder loads without the flag, as the source's own class.

Each class is the source's transformers class under the same name, so that ``architectures`` stays the source's, and
``save_pretrained`` of a loaded model ships this code again. Importing this module registers the Performer attention
implementations and their masks with the installed transformers, except names registered already: after ``import
performer_hf`` the package's own serve, with its compiled CPU kernels (a folder's copy carries no C++ source and runs
the PyTorch paths, with the same outputs).
"""

import transformers

from .attention_interface import register_attention_implementations
from .attention_methods import ATTENTION_FIELDS
from .attention_settings import CONFIG_ATTRIBUTE, IMPLEMENTATIONS, attach_learned_attention, resolved_settings

register_attention_implementations(replace=False)


def record_attention(config) -> None:
    """Write the config's Performer attention (``attn_implementation`` and every setting) into it, as the first forward
    otherwise does: transformers does not save the implementation a model was loaded with, so a model saved before it
    runs would load with softmax attention. Nothing for another implementation."""
    if config._attn_implementation in IMPLEMENTATIONS:
        resolved_settings(config, config._attn_implementation, causal=True)


def _refuse_settings_as_keywords(name: str, config, kwargs: dict) -> None:
    """Refuse Performer settings given as ``from_pretrained`` keywords (``local_window=16``, as the Performer family
    takes them), which the source's config has no fields for: transformers hands them to the model's constructor,
    whose ``TypeError`` named neither the config's dict nor how to change it."""
    given = {key: value for key, value in kwargs.items() if key in ATTENTION_FIELDS}
    if not given:
        return
    current = getattr(config, CONFIG_ATTRIBUTE, None) or {}
    update = ", ".join(f"{key}={value!r}" for key, value in given.items())
    replaced = {key: current[key] for key in ("attention_method",) if key in current} | given
    raise ValueError(
        f"{name} (converted in place) keeps its Performer settings in config.{CONFIG_ATTRIBUTE}, not as fields of "
        f"its own: {', '.join(given)} cannot be given as keywords. Change them in the folder's settings: "
        f"config = AutoConfig.from_pretrained(folder); config.{CONFIG_ATTRIBUTE}.update({update}); "
        f"AutoModelForCausalLM.from_pretrained(folder, config=config). (The keyword {CONFIG_ATTRIBUTE}={replaced!r} "
        "replaces them whole: the settings it does not name take the method's preset.)"
    )


class _RecordsItsAttention:
    """Records the config's Performer attention on construction (:func:`record_attention`), and declares the
    tensors attention transfer trained, so that ``from_pretrained`` loads them with the other weights."""

    def __init__(self, config, *args, **kwargs):
        _refuse_settings_as_keywords(type(self).__name__, config, kwargs)
        super().__init__(config, *args, **kwargs)
        record_attention(config)
        attach_learned_attention(self, read=False)


class LlamaForCausalLM(_RecordsItsAttention, transformers.LlamaForCausalLM):
    """``transformers.LlamaForCausalLM`` with the Performer attention its config names."""


class MistralForCausalLM(_RecordsItsAttention, transformers.MistralForCausalLM):
    """``transformers.MistralForCausalLM`` with the Performer attention its config names."""


class Qwen2ForCausalLM(_RecordsItsAttention, transformers.Qwen2ForCausalLM):
    """``transformers.Qwen2ForCausalLM`` with the Performer attention its config names."""


class Qwen3ForCausalLM(_RecordsItsAttention, transformers.Qwen3ForCausalLM):
    """``transformers.Qwen3ForCausalLM`` with the Performer attention its config names."""


class Gemma3ForCausalLM(_RecordsItsAttention, transformers.Gemma3ForCausalLM):
    """``transformers.Gemma3ForCausalLM`` with the Performer attention its config names."""


IN_PLACE_CLASSES = {
    model_class.__name__: model_class
    for model_class in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM)
}
for _model_class in IN_PLACE_CLASSES.values():
    _model_class.register_for_auto_class("AutoModelForCausalLM")  # save_pretrained ships this module
