"""Tiny Performer configs, models and inputs shared by the model test modules (fast on one CPU thread)."""

import torch

from performer_hf import PerformerConfig, PerformerForCausalLM

VOCAB, HIDDEN, LAYERS, HEADS, FEATURES = 99, 32, 2, 4, 16
# the three attention methods: exact (key/value cache), FAVOR+ (recurrent state) and hybrid (window + global
# tokens + polynomial far field around fixed centres)
# the hybrid with every part of its support, bidirectional: window 5, the first token global, 2 routed blocks of 4
# keys per block of 4 queries
HYBRID_BIDIRECTIONAL = dict(
    attention_kernel="poly2",
    center_features=True,
    local_window=5,
    num_global_tokens=1,
    routed_blocks=2,
    route_block_size=4,
    query_block_size=4,
)
METHODS = {
    "exact": {"attention_kernel": "exact"},
    "favor": {"attention_kernel": "softmax"},
    "hybrid": {"attention_kernel": "poly2", "center_features": True, "local_window": 4, "num_global_tokens": 1},
}


def tiny_config(**overrides) -> PerformerConfig:
    """vocab 99, hidden 32, 2 layers, 4 heads, 16 features; no dropout; causal chunks of 4 positions
    so that short inputs cross chunk boundaries."""
    kwargs = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "intermediate_size": 37,
        "max_position_embeddings": 64,
        "nb_features": FEATURES,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "causal_chunk_size": 4,
        "num_labels": 3,
    }
    kwargs.update(overrides)
    return PerformerConfig(**kwargs)


def tiny_model(model_class=PerformerForCausalLM, seed=0, **overrides):
    """``model_class`` on ``tiny_config(**overrides)``, initialised from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    return model_class(tiny_config(**overrides)).eval()


def random_centres(model):
    """``model``, given random non-zero fixed centres (from torch's global generator) when its config centres the
    features, so that centring matters."""
    if model.config.center_features:
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "query_center"):
                    module.query_center.normal_(0, 0.5)
                    module.key_center.normal_(0, 0.5)
    return model


def random_ids(batch=2, length=11, seed=0) -> torch.Tensor:
    """(batch, length) token ids in [1, VOCAB): never the pad id 0."""
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


class Logits(torch.nn.Module):
    """A model's logits alone, without a cache (``use_cache=False``): what the ``torch.export`` tests trace."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits
