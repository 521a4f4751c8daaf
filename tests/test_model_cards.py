"""What the three model-card writers say about a checkpoint's attention, read from one place
(``performer_hf.attention_card`` and the attention-method registry)."""

import json
from pathlib import Path

import pytest

from performer_hf import PerformerConfig
from performer_hf.conversion.convert import _TRANSFER_KEYWORDS
from performer_hf.modeling.attention_methods import ATTENTION_METHODS
from performer_hf.training.model_card import build_model_card
from performer_hf.zoo import get_entry, model_names
from performer_hf.zoo.card import _steps

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


@pytest.mark.parametrize(
    ("attention", "kernel"),
    [({"attention_method": "sparse", "is_decoder": True}, None), ({"attention_kernel": "elu"}, "elu")],
)
def test_the_training_card_states_no_random_features_a_method_does_not_use(attention, kernel):
    """The sparse method and the deterministic elu kernel draw no random features, but the card listed
    attention_kernel softmax (sparse), nb_features 256, the coupling and 'The random features were never redrawn'."""
    card = _training_card(None, **attention)
    section = card.split("## Attention settings")[1].split("## Architecture")[0]
    settings = json.loads(section.split("```json")[1].split("```")[0])
    expected = {"attention_method": attention.get("attention_method", "favor")}
    if kernel:
        expected["attention_kernel"] = kernel
    assert settings == expected
    assert "random features" not in section and "nb_features" not in section


def test_the_training_card_of_a_classifier_loads_it_with_its_head(tmp_path):
    """The Usage snippet of a trained classifier said AutoModel.from_pretrained, which drops the classification
    head; run, it now restores the trained classifier."""
    from performer_hf import PerformerForSequenceClassification

    config = PerformerConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=50, num_labels=3
    )
    PerformerForSequenceClassification(config).save_pretrained(tmp_path)
    card = build_model_card("classification", config, None, "a test corpus", {"eval_accuracy": 0.9}, {})
    snippet = card.split("## Usage")[1].split("```python")[1].split("```")[0]
    namespace = {}
    exec(snippet.replace("path/to/this/folder", str(tmp_path)), namespace)  # the card's own loading code
    assert isinstance(namespace["model"], PerformerForSequenceClassification)
    assert namespace["model"].config.num_labels == 3


CARDS = Path(__file__).parents[1] / "model_cards"


@pytest.mark.parametrize("name", model_names())
def test_the_stored_zoo_cards_are_those_the_registry_and_their_results_render(name):
    """The stored cards drifted from the registry: the SmolLM2 hybrid's said it was made with
    performer_hf.convert(..., transfer_steps=50, transfer_length=2048), keywords that now warn (deprecated). How it
    was made (rendered from the registry and the build's stored zoo_results.json), the description and the limits
    must be the current renderer's."""
    card = (CARDS / f"{name}.md").read_text()
    entry = get_entry(name)
    steps = _steps(entry, json.loads((CARDS / f"{name}.json").read_text()))
    made = card.split("## How it was made\n")[1].split("\n## ")[0]
    assert made == "".join(f"\n{index}. {step}" for index, step in enumerate(steps, 1)) + "\n"
    assert not any(f"{keyword}=" in made for keyword in _TRANSFER_KEYWORDS)  # the deprecated keywords
    assert f"\n{entry.description}.\n" in card
    assert all(f"- {limit}\n" in card for limit in entry.limits)
