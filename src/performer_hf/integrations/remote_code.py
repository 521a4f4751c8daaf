"""Shipping the code of a transformers model that runs Performer attention, so that its saved folder loads where
performer_hf is not installed (``trust_remote_code=True``)."""

from __future__ import annotations

from transformers import PreTrainedModel

from ..modeling.attention_settings import IMPLEMENTATIONS, attach_learned_attention
from ..modeling.modeling_in_place import IN_PLACE_CLASSES, record_attention


def ship_remote_code(model: PreTrainedModel) -> PreTrainedModel:
    """Make ``model.save_pretrained`` and ``model.push_to_hub`` write the code that loads ``model`` without
    performer-hf: the folder then carries ``modeling_in_place.py`` and its sibling modules, and ``config.json``
    names the class in its ``auto_map``. ``performer_hf.convert`` does this for every model it converts in place;
    a model loaded from such a folder with ``trust_remote_code=True`` ships the code again by itself.

    ``model``'s class becomes the subclass of the same name in :mod:`performer_hf.modeling.modeling_in_place`, which
    adds nothing but the registration; its attention settings are recorded in its config now (as at its first
    forward), and a model trained with attention transfer reads its trained tensors now, so that a model saved
    before running carries them too.

    Args:
        model: a ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or
            ``Gemma3ForCausalLM`` loaded with ``attn_implementation`` ``"performer"``, ``"performer_hybrid"`` or
            ``"performer_sparse"``.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: another class, or a model loaded with another attention implementation.
    """
    shipped = IN_PLACE_CLASSES.get(type(model).__name__)
    if shipped is None or not isinstance(model, shipped.__bases__[-1]):  # the transformers class
        raise ValueError(
            f"ship_remote_code takes a model of the architectures converted in place ({', '.join(IN_PLACE_CLASSES)}), "
            f"got a {type(model).__module__}.{type(model).__name__}. Performer-family models ship their code already; "
            "a BERT, RoBERTa or GPT-2 model is published as one: convert its checkpoint with performer_hf.convert."
        )
    implementation = model.config._attn_implementation
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"this {type(model).__name__} runs attn_implementation={implementation!r}, not a Performer attention; "
            f"load it with attn_implementation in {sorted(IMPLEMENTATIONS)} (or convert it with performer_hf.convert)."
        )
    record_attention(model.config)
    attach_learned_attention(model, read=True)  # a model trained with attention transfer that has not run yet
    model.__class__ = shipped
    return model
