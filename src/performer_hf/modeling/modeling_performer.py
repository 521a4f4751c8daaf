"""Performer model family: BERT / RoBERTa / GPT-2 style Transformers with FAVOR+ (or hybrid) attention.

Read top to bottom: the pre-trained base class, the bare model, then one class per task head; their
building blocks (embeddings, attention, layers, pooler, MLM head) are in ``layers_performer.py``. Only
sibling imports (``from .x import y``) are used, so the Hub's remote-code loader can copy this file next
to a checkpoint.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from huggingface_hub.errors import StrictDataclassClassValidationError
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import ModelOutput, logging

from .attention_methods import ATTENTION_FIELDS, ATTENTION_METHODS
from .attention_settings import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from .cache_performer import check_no_static_layers, static_cache_refusal
from .compiled_lengths import traced
from .configuration_performer import PerformerConfig
from .layers_performer import (
    PerformerAttention,
    PerformerEmbeddings,
    PerformerEncoder,
    PerformerMaskedLMHead,
    PerformerPooler,
)
from .token_loss import IGNORE_INDEX, token_cross_entropy
from .vocabulary_projection import plain_linear, vocabulary_logits

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


# the config fields a model's attention modules read when they are built (``AttentionMethodState``); the redraw
# interval is the trainer's, read at each step
BUILT_ATTENTION_FIELDS = tuple(name for name in ATTENTION_FIELDS if name != "feature_redraw_interval")


def _attention_settings(config: PerformerConfig) -> dict:
    return {name: getattr(config, name) for name in BUILT_ATTENTION_FIELDS}


def _validate(config: PerformerConfig) -> None:
    """The config's checks (``@strict``'s class validators), failing with the check's own ``ValueError``."""
    try:
        config.validate()
    except StrictDataclassClassValidationError as error:
        raise ValueError(str(error.__cause__ or error)) from error


class PerformerPreTrainedModel(PreTrainedModel):
    config_class = PerformerConfig
    config: PerformerConfig
    base_model_prefix = "performer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["PerformerLayer"]

    def __init__(self, config: PerformerConfig, *inputs, **kwargs):
        # the config's checks again: settings applied after it was built (``from_pretrained(folder, **settings)``
        # sets them one by one, unchecked) fail here, by name, not deep inside a layer or a later save
        _validate(config)
        super().__init__(config, *inputs, **kwargs)

    def post_init(self):
        super().post_init()
        self.record_attention_settings()
        implementation = self.config._attn_implementation
        if implementation in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation={implementation!r} gives transformers models (Llama, BERT, ...) Performer "
                f"attention; a {type(self).__name__} runs the attention its config names "
                f"(attention_method={self.config.attention_method!r}, attention_kernel="
                f"{self.config.attention_kernel!r}). Leave attn_implementation out, and set those fields to run "
                "another (e.g. from_pretrained(folder, attention_kernel='exact'), or convert the source with "
                "method='hybrid')."
            )

    # the fields the random features are drawn with, saved with the weights (the ``projection`` buffers)
    _PROJECTION_FIELDS = ("projection_seed", "feature_coupling", "feature_row_norms", "nb_features")
    _HUB_ARGUMENTS = ("cache_dir", "force_download", "proxies", "token", "revision", "subfolder", "local_files_only")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``PreTrainedModel.from_pretrained``. The random features are saved with the weights: given here (or in the
        ``config`` given), a ``projection_seed``, ``feature_coupling`` or ``feature_row_norms`` other than the
        checkpoint's draws them anew from the settings given (with the checkpoint's features the config would name a
        draw the model does not run); another ``nb_features`` is refused (the checkpoint's features have their
        shape) unless ``ignore_mismatched_sizes``."""
        given = kwargs.get("config")  # AutoModel passes the config it built, with the settings given applied
        asked = {name: getattr(given, name) for name in cls._PROJECTION_FIELDS if isinstance(given, PerformerConfig)}
        asked.update({name: kwargs[name] for name in cls._PROJECTION_FIELDS if name in kwargs})
        changed = {}
        if asked and pretrained_model_name_or_path is not None:  # (None: weights given as a state dict)
            hub = {name: kwargs[name] for name in cls._HUB_ARGUMENTS if name in kwargs}
            saved, _ = cls.config_class.get_config_dict(pretrained_model_name_or_path, **hub)
            defaults = cls.config_class()
            saved = {name: saved.get(name, getattr(defaults, name)) for name in asked}
            changed = {name: value for name, value in asked.items() if value != saved[name]}
        if "nb_features" in changed and not kwargs.get("ignore_mismatched_sizes"):
            raise ValueError(
                f"nb_features={changed['nb_features']} differs from the checkpoint's {saved['nb_features']}: its "
                "random features are saved with its weights, in their shape. Convert the source again with "
                "nb_features set, or load the checkpoint as saved."
            )
        model = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if changed:
            logger.info("random features drawn anew with %s (the checkpoint's were drawn otherwise)", changed)
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(module, PerformerAttention):
                        module.redraw_projection(model.config.projection_seed + module.layer_idx)
        return model

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        """A family model runs the attention its config names, whatever ``attn_implementation`` says: transformers'
        kernels ("sdpa", flash attention) are refused naming the fix; "eager" is what transformers records for the
        family itself (its heads' base model is checked with it), so it passes; the Performer names are refused by
        :meth:`post_init`."""
        if attn_implementation not in (None, "eager", *ATTENTION_IMPLEMENTATIONS):
            raise ValueError(
                f"a {type(self).__name__} runs the attention its config names (attention_method, attention_kernel), "
                f"not attn_implementation={attn_implementation!r}: set attention_kernel='exact' for exact softmax "
                "attention (through SDPA), or leave it out."
            )
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    def _returned(self, output, return_dict: bool | None):
        """``output``, or its tuple where ``return_dict`` (default: the config's) is False (the transformers
        convention)."""
        return output if (self.config.return_dict if return_dict is None else return_dict) else output.to_tuple()

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
        if isinstance(seed, torch.Tensor) and seed.numel() == 1 and not seed.is_floating_point():
            seed = int(seed)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"redraw_projections takes a whole number >= 0 as seed (e.g. the step), got {seed!r}.")
        for module in self.modules():
            if isinstance(module, PerformerAttention):  # a generator seed is below 2**63
                module.redraw_projection((seed * 1_000_003 + module.layer_idx) % 2**63)

    def record_attention_settings(self) -> None:
        """Take the config's attention settings as the ones this model's attention modules run (done when it is
        built; the converter's calibration, which sets both, calls it again)."""
        self._attention_settings = _attention_settings(self.config)

    def check_attention_settings_unchanged(self) -> None:
        """Refuse a config whose attention settings were changed after the model was built: its attention modules
        read them when they were built, so the model would compute with the old ones and save the new ones (a
        checkpoint that loads as another model)."""
        built = self._attention_settings
        changed = {name: value for name, value in _attention_settings(self.config).items() if value != built[name]}
        if changed:
            then = ", ".join(f"{name}={built[name]!r}" for name in changed)
            now = ", ".join(f"{name}={value!r}" for name, value in changed.items())
            raise ValueError(
                f"config.{' / '.join(changed)} changed after this model was built: its attention runs {then} (read "
                f"when its layers were built), and would be saved as {now}. To run the new settings, load the model "
                f"with them, from_pretrained(folder, {now}) (or build it from the config); to keep the model as it "
                "runs, set them back."
            )

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` (safetensors + config + the modeling code), with every
        Performer class listed in ``config.auto_map``: any ``AutoModel*.from_pretrained(folder,
        trust_remote_code=True)`` then loads the folder where ``performer_hf`` is not installed. A config whose
        attention settings were changed after the model was built is refused before anything is written."""
        self.check_attention_settings_unchanged()
        _validate(self.config)
        module = self.__class__.__module__.rsplit(".", 1)[-1]
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        auto_map.update({auto: f"{module}.{cls.__name__}" for cls, auto in AUTO_CLASSES.items()})
        self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)


class PerformerModel(PerformerPreTrainedModel):
    """The bare Performer: embeddings, blocks and (optionally) the pooler.

    ``add_pooling_layer``: by default an encoder's (BERT's first-token pooler), none for a decoder
    (``config.is_decoder``, as GPT-2, whose conversion has none: ``from_pretrained`` then built a random one)."""

    def __init__(self, config: PerformerConfig, add_pooling_layer: bool | None = None):
        super().__init__(config)
        self.embeddings = PerformerEmbeddings(config)
        self.encoder = PerformerEncoder(config)
        if add_pooling_layer is None:
            add_pooling_layer = not config.is_decoder
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
        check_no_static_layers(cache.layers, "Leave cache_implementation unset: generate() builds the cache.")
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
            output_attentions: the attention weights of each layer: exact attention's, or the matrix linear
                attention implies (its output for identity values: inputs of at most 1,024 tokens, no cached ones).
            causal: overrides ``config.is_decoder`` (the task heads set it).
            past_key_values: the name of ``cache`` before transformers 5.24 (deprecated there).
        """
        cache = _cache_argument(cache, past_key_values, kwargs)
        if not traced():
            self.check_attention_settings_unchanged()
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        name, given = ("input_ids", input_ids) if input_ids is not None else ("inputs_embeds", inputs_embeds)
        if given.dim() != (2 if input_ids is not None else 3):
            raise ValueError(
                f"{name} must be a batch: (batch, length){'' if input_ids is not None else ' x hidden'}, got shape "
                f"{tuple(given.shape)} (one sequence: unsqueeze(0))."
            )
        batch, length = given.shape[:2]
        if not batch or not length:
            raise ValueError(
                f"{name} of shape {tuple(given.shape)} hold no token: pass at least one sequence of at least one token."
            )
        if inputs_embeds is not None and inputs_embeds.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"inputs_embeds must be (batch, length, hidden_size={self.config.hidden_size}), got shape "
                f"{tuple(inputs_embeds.shape)}."
            )
        for extra, ids in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
            # (batch, length), or one row for every sequence: (1, length) or (length,)
            if ids is not None and tuple(ids.shape) not in ((batch, length), (1, length), (length,)):
                raise ValueError(f"{extra} must be ({batch}, {length}) like {name}, got shape {tuple(ids.shape)}.")
        if token_type_ids is not None and not self.config.type_vocab_size:
            raise ValueError(
                "this model has no token type embeddings (type_vocab_size=0, as a GPT-2 conversion): leave "
                "token_type_ids out (GPT-2 added the word embeddings of token_type_ids; its conversion does not)."
            )
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
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

        # (B, P + L); a tensor of this forward's own (a view when the mask is bool already), so that what the layers
        # read from it once per forward (read_per_mask) is not taken for a later call's, whose caller may have
        # refilled the same buffer (numpy writes do not count as a version)
        key_mask = None if attention_mask is None else attention_mask.to(torch.bool)[:]
        if key_mask is not None and tuple(key_mask.shape) != (batch, past_length + length):
            raise ValueError(
                f"attention_mask must be 2D (batch, past + new tokens) = ({batch}, {past_length + length}) with 1 for "
                f"real tokens; got {tuple(key_mask.shape)}."
            )
        if key_mask is not None and not torch.compiler.is_compiling() and bool(key_mask.all()):
            # nothing padded (a tokenizer's mask of a batch of one length): the attention calls take their unmasked
            # paths (flash; the hybrid's mask looks no key up), as transformers drops such masks for SDPA
            key_mask = None

        hidden_states = self.embeddings(
            input_ids=input_ids,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            past_length=past_length,
        )
        sequence_output, all_hidden, all_weights = self.encoder(
            hidden_states,
            output_hidden_states,
            key_mask=key_mask,
            causal=causal,
            cache=cache,
            output_attentions=output_attentions,
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


class _BidirectionalHead(PerformerPreTrainedModel):
    """A task head on the bidirectional encoder: a subclass gives its logits (``_logits(outputs)``), its loss
    (``_loss(logits, labels, num_items_in_batch)``) and its output class; ``labels`` are the head's targets."""

    output_class: type

    def _encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs):
        """The encoder's outputs (``BaseModelOutputWithPooling``), bidirectional."""
        return self.performer(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            causal=False,
            **kwargs,
        )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        **kwargs,
    ) -> ModelOutput | tuple:
        outputs = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = self._logits(outputs)
        loss = None if labels is None else self._loss(logits, labels, num_items_in_batch)
        output = self.output_class(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return self._returned(output, return_dict)


class PerformerForMaskedLM(_BidirectionalHead):
    """The BERT / RoBERTa masked-LM head (dense, activation, LayerNorm, tied decoder); bidirectional. ``labels``:
    (B, L) token ids, -100 where no prediction is scored."""

    output_class = MaskedLMOutput
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

    def _logits(self, outputs):
        return self.lm_head(outputs.last_hidden_state)  # (B, L, vocab)

    def _loss(self, logits, labels, num_items_in_batch):
        return token_cross_entropy(logits, labels, num_items_in_batch)  # labels (B, L), -100 where unscored


class PerformerForCausalLM(PerformerPreTrainedModel, GenerationMixin):
    """Always causal; the LM head is a plain (tied) linear map, as in GPT-2.

    ``generate`` decodes with a constant-size cache: per layer the running FAVOR+ state
    (``FavorCacheLayer``), so each new token costs the same whatever the context length. The
    prompt is prefilled with the chunked causal kernel. ``attention_kernel="exact"`` uses a
    key/value ``DynamicCache``. Left-padded batches work: ``generate`` derives the position ids from
    the attention mask and padded keys are left out of the state. A left-padded row's global tokens (causal hybrid)
    are its first real tokens, as alone; its window goes by position (the same real keys), and so does the exact
    prefix (``exact_max_length``): a row padded by ``P`` attends exactly at ``P`` fewer of its positions, and one
    padded past it gets its first real tokens as global tokens all the same (a prefill in chunks that cannot give
    them is refused, naming the fix).
    """

    _tied_weights_keys = {"lm_head.weight": "performer.embeddings.word_embeddings.weight"}

    def __init__(self, config: PerformerConfig):
        if not config.is_decoder:  # it attends causally all the same: the decoders' checks apply
            as_decoder = copy.deepcopy(config)
            as_decoder.is_decoder = True
            try:
                _validate(as_decoder)
            except ValueError as error:  # an encoder's settings (a converted BERT's), which causal attention refuses
                raise ValueError(
                    "PerformerForCausalLM attends causally, and this config is a bidirectional encoder's "
                    f"(is_decoder=False) with a setting that causal attention refuses: {error} To use the encoder, "
                    "load it with AutoModel, AutoModelForMaskedLM or AutoModelForSequenceClassification; to make a "
                    "decoder of it, set is_decoder=True and the causal settings this names."
                ) from error
            logger.warning_once(
                "PerformerForCausalLM attends causally whatever its config says; this one has is_decoder=False, "
                "which a PerformerModel loaded from it would take as bidirectional: set is_decoder=True."
            )
        super().__init__(config)
        self.performer = PerformerModel(config, add_pooling_layer=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # a recurrent state cannot be rolled back to check draft tokens (assisted generation)
        self._is_stateful = config.attention_kernel != "exact"
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, *args, **kwargs):
        if generation_config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS:
            raise ValueError(
                static_cache_refusal(
                    f"cache_implementation={generation_config.cache_implementation!r}",
                    "Leave cache_implementation unset: generate() builds the cache.",
                )
            )
        return super()._prepare_cache_for_generation(generation_config, *args, **kwargs)

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
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            cache=_cache_argument(cache, past_key_values, kwargs),
            use_cache=use_cache,
            return_dict=True,
            causal=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state  # (B, L, hidden)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden_states = hidden_states[:, keep]  # (B, L or N, hidden)
        if plain_linear(self.lm_head):  # rows aligned for the matrix kernels (vocabulary_projection)
            logits = vocabulary_logits(hidden_states, self.lm_head.weight)  # (B, L or N, vocab)
        else:  # a wrapped or hooked head (an adapter, offloading): its own call
            logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None or shift_labels is not None:
            targets = shift_labels if shift_labels is not None else labels
            tokens = tuple(outputs.last_hidden_state.shape[:2])  # (B, L)
            if tuple(targets.shape) != tokens:
                raise ValueError(
                    f"labels must be token ids of shape {tokens} (one per input token), got {tuple(targets.shape)}."
                )
            if logits.shape[1] != targets.shape[1]:
                raise ValueError(f"labels need logits for every position; got logits_to_keep={logits_to_keep}.")
            if shift_labels is None:  # the labels move, not the logits: a slice of them would be copied whole
                shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            loss = token_cross_entropy(logits, shift_labels, num_items_in_batch)
        output = CausalLMOutputWithCrossAttentions(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )
        return self._returned(output, return_dict)


def _classification_loss(config: PerformerConfig, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The HF convention: regression for one label, single- or multi-label classification otherwise (recorded in
    ``config.problem_type`` at the first loss, from the labels' dtype). Labels that fit none are refused, before
    anything is recorded: (B,) or (B, 1) class ids, (B, num_labels) floats (multi-label), or numbers (regression:
    (B,) or (B, 1) for one label, (B, num_labels) for several)."""
    batch, classes = logits.shape[0], config.num_labels
    integer = not (labels.is_floating_point() or labels.is_complex())
    problem = config.problem_type
    if problem is None:
        problem = "single_label_classification" if integer else "multi_label_classification"
        problem = "regression" if classes == 1 else problem
    expected = {
        "regression": ((batch,), (batch, 1)) if classes == 1 else ((batch, classes),),
        "single_label_classification": ((batch,), (batch, 1)),
        "multi_label_classification": ((batch, classes),),
    }[problem]
    if tuple(labels.shape) not in expected or (problem == "single_label_classification" and not integer):
        kind = "class ids (integers)" if problem == "single_label_classification" else "numbers"
        raise ValueError(
            f"labels for {problem} with num_labels={classes} are {kind} of shape "
            f"{' or '.join(str(shape) for shape in expected)}, got {labels.dtype} labels of shape "
            f"{tuple(labels.shape)}."
        )
    config.problem_type = problem
    if problem == "regression":
        return F.mse_loss(logits.float().view(batch, -1), labels.float().view(batch, -1))
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, classes).float(), labels.view(-1).long())
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


class _PerformerClassifier(_BidirectionalHead):
    """The encoder, dropout and a linear classifier, bidirectional. A subclass says what is classified
    (``pooled``: the pooled first token, one prediction per sequence; else every token), its loss
    (``_loss(logits, labels, num_items_in_batch)``) and its output class."""

    pooled: bool

    def __init__(self, config: PerformerConfig):
        if config.num_labels < 1:
            raise ValueError(
                f"{type(self).__name__} predicts num_labels classes (1: a regression), got num_labels="
                f"{config.num_labels}: give num_labels (or id2label) in the config."
            )
        super().__init__(config)
        self.num_labels = config.num_labels
        self.performer = PerformerModel(config, add_pooling_layer=self.pooled)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def _logits(self, outputs):
        features = outputs.pooler_output if self.pooled else outputs.last_hidden_state
        return self.classifier(self.dropout(features))  # (B, num_labels) pooled, else (B, L, num_labels)


class PerformerForSequenceClassification(_PerformerClassifier):
    """Pooler (first token, dense + tanh) + dropout + linear classifier; bidirectional. ``labels``: (B,)."""

    pooled, output_class = True, SequenceClassifierOutput
    # the loss is a per-sequence mean: the Trainer scales it for gradient accumulation itself
    accepts_loss_kwargs = False

    def _loss(self, logits, labels, num_items_in_batch):
        return _classification_loss(self.config, logits, labels)


class PerformerForTokenClassification(_PerformerClassifier):
    """Dropout + linear classifier on every token; bidirectional. ``labels``: (B, L), -100 where unscored."""

    pooled, output_class = False, TokenClassifierOutput

    def _loss(self, logits, labels, num_items_in_batch):
        return token_cross_entropy(logits, labels, num_items_in_batch)


class PerformerForQuestionAnswering(_BidirectionalHead):
    # the loss is a per-sequence mean: the Trainer scales it for gradient accumulation itself
    accepts_loss_kwargs = False

    def __init__(self, config: PerformerConfig):
        super().__init__(config)
        self.performer = PerformerModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput | tuple:
        """``start_positions`` / ``end_positions``: (B,) token indices of the answer span (or (B, 1), as
        transformers' question-answering heads take them)."""
        outputs = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).unbind(dim=-1)  # (B, L) each
        loss = None
        if start_positions is not None and end_positions is not None:
            length = start_logits.shape[1]
            start_positions, end_positions = start_positions.reshape(-1), end_positions.reshape(-1)  # (B,)
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
        return self._returned(output, return_dict)


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
