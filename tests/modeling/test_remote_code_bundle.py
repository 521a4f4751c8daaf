"""The remote-code bundle (``src/performer_hf/modeling/``) is exactly what a saved checkpoint ships."""

import re
from pathlib import Path

import pytest

import performer_hf.modeling
from performer_hf import PerformerForCausalLM, PerformerForMaskedLM

from ..tiny_models import METHODS, tiny_config

BUNDLE = Path(performer_hf.modeling.__file__).parent


def _python_files(folder: Path) -> set[str]:
    return {path.name for path in folder.glob("*.py")} - {"__init__.py"}


@pytest.mark.parametrize("model_class", [PerformerForMaskedLM, PerformerForCausalLM])
@pytest.mark.parametrize("method", METHODS)
def test_a_saved_checkpoint_ships_exactly_the_bundle(method, model_class, tmp_path):
    model_class(tiny_config(**METHODS[method])).save_pretrained(tmp_path)
    assert _python_files(tmp_path) == _python_files(BUNDLE)


def test_the_bundle_imports_only_its_own_files():
    """transformers' remote-code loader follows only flat sibling imports (``from .x import y``)."""
    outside = re.compile(r"^\s*(from \.\.|from performer_hf|import performer_hf)", re.MULTILINE)
    for path in sorted(BUNDLE.glob("*.py")):
        assert not outside.search(path.read_text()), path.name
