"""The names the README and the model cards tell users to import exist where they say: every ``from performer_hf...
import ...`` / ``import performer_hf...`` line of their code, and every ``performer_hf.<name>`` they mention."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "model_cards").glob("*.md"))]
IMPORT_LINE = re.compile(r"^\s*((?:from performer_hf[\w.]* import [\w, ()]+)|(?:import performer_hf[\w.]*))\s*$", re.M)
DOTTED_NAME = re.compile(r"`(performer_hf(?:\.\w+)+)")


def _imports() -> list[str]:
    return sorted({line for doc in DOCS for line in IMPORT_LINE.findall(doc.read_text())})


def _dotted_names() -> list[str]:
    return sorted({name for doc in DOCS for name in DOTTED_NAME.findall(doc.read_text())})


def test_the_docs_name_something():
    assert "import performer_hf" in _imports() and "performer_hf.convert" in _dotted_names()


@pytest.mark.parametrize("line", _imports())
def test_every_import_line_runs(line):
    exec(line, {})


@pytest.mark.parametrize("name", _dotted_names())
def test_every_dotted_name_resolves(name):
    """``performer_hf.a.b``: a module, or an attribute of the longest module prefix."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return
    raise AssertionError(f"{name} names no module")


def test_the_cache_names_import_from_the_top_level():
    """The README names PerformerCache and CACHE_KEYWORD together (issue: they once lived apart)."""
    exec("from performer_hf import PerformerCache, CACHE_KEYWORD, held_bytes", {})
