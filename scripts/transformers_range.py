"""Print one end of the transformers range that pyproject.toml declares: `oldest` (the lower bound) or
`newest` (the upper bound). Both bounds are inclusive (`>=A,<=B`) so that they name the two releases CI
installs and tests; a release outside them is never picked up silently."""

import re
import sys
from pathlib import Path

import tomllib

project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
requirement = next(r for r in project["dependencies"] if re.match(r"transformers\b", r))
bounds = re.fullmatch(r"transformers\s*>=\s*([\w.]+)\s*,\s*<=\s*([\w.]+)", requirement)
if bounds is None:
    sys.exit(f"pyproject.toml must declare transformers as '>=OLDEST,<=NEWEST' (both tested), not {requirement!r}")
print(bounds.group(1) if sys.argv[1:] == ["oldest"] else bounds.group(2))
