"""What the three model-card writers say about a checkpoint's attention, read from one place
(``performer_hf.attention_card`` and the attention-method registry)."""

import pytest

from performer_hf import PerformerConfig
from performer_hf.modeling.attention_methods import ATTENTION_METHODS
from performer_hf.training.model_card import build_model_card

HYBRID = {"attention_kernel": "poly2", "center_features": True, "local_window": 5, "num_global_tokens": 1}


def _training_card(interval, **attention) -> str:
    config = PerformerConfig(num_hidden_layers=1, feature_redraw_interval=interval, **attention)
    return build_model_card("mlm", config, None, "a test corpus", {"eval_loss": 1.0}, {})


@pytest.mark.parametrize(
    ("attention", "method"), [({}, "favor"), (HYBRID, "hybrid"), ({"attention_kernel": "exact"}, "exact")]
)
def test_the_training_card_names_the_method_and_its_settings(attention, method):
    card = _training_card(None, **attention)
    assert ATTENTION_METHODS[method].description in card
    assert ("- exact local window: 5 tokens" in card) == (method == "hybrid")  # the hybrid settings are kept
    assert f'"attention_method": "{method}"' in card


def test_the_training_card_says_whether_features_were_redrawn():
    assert "were never redrawn during training" in _training_card(None)
    assert "redrawn every 100 optimizer steps" in _training_card(100)
    assert "redrawn every" not in _training_card(None)
