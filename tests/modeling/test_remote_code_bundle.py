"""The remote-code bundle (``src/performer_hf/modeling/``) is what saved checkpoints ship: a Performer-family
checkpoint the modules of its model classes, a model converted in place those of ``modeling_in_place.py``, and every
module of the bundle serves one or the other."""

import re
from pathlib import Path

import pytest
from transformers.dynamic_module_utils import get_relative_import_files

import performer_hf.modeling
from performer_hf import PerformerForCausalLM, PerformerForMaskedLM

from ..tiny_models import METHODS, tiny_config

BUNDLE = Path(performer_hf.modeling.__file__).parent


def _python_files(folder: Path) -> set[str]:
    return {path.name for path in folder.glob("*.py")} - {"__init__.py"}


def _shipped_with(entry_point: str) -> set[str]:
    """``entry_point`` and every module it imports, as transformers' remote-code loader follows them."""
    return {entry_point} | {Path(path).name for path in get_relative_import_files(str(BUNDLE / entry_point))}


@pytest.mark.parametrize("model_class", [PerformerForMaskedLM, PerformerForCausalLM])
@pytest.mark.parametrize("method", METHODS)
def test_a_saved_checkpoint_ships_its_model_classes_modules(method, model_class, tmp_path):
    model_class(tiny_config(**METHODS[method])).save_pretrained(tmp_path)
    assert _python_files(tmp_path) == _shipped_with("modeling_performer.py")


def test_every_module_of_the_bundle_is_shipped():
    """The model classes' modules and the in-place conversions' (tested in
    ``tests/integrations/test_remote_code_in_place.py``) are the whole bundle: nothing in it is dead."""
    shipped = _shipped_with("modeling_performer.py") | _shipped_with("modeling_in_place.py")
    assert shipped == _python_files(BUNDLE)


def test_the_bundle_imports_only_its_own_files():
    """transformers' remote-code loader follows only flat sibling imports (``from .x import y``)."""
    outside = re.compile(r"^\s*(from \.\.|from performer_hf|import performer_hf)", re.MULTILINE)
    for path in sorted(BUNDLE.glob("*.py")):
        assert not outside.search(path.read_text()), path.name
