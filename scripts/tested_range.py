"""Print one end of the range that pyproject.toml declares for a dependency whose both ends CI tests (transformers,
torch): `python scripts/tested_range.py PACKAGE oldest|newest`, the lower or the upper bound. Both bounds are
inclusive (`>=A,<=B`) so that they name the two releases CI installs and tests; a release outside them is never
picked up silently."""

import re
import sys
from pathlib import Path

import tomllib

TESTED = ("transformers", "torch")

if len(sys.argv) != 3 or sys.argv[1] not in TESTED or sys.argv[2] not in ("oldest", "newest"):
    sys.exit(f"usage: python scripts/tested_range.py {{{','.join(TESTED)}}} {{oldest,newest}}")
package, end = sys.argv[1:]
project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
requirement = next(r for r in project["dependencies"] if re.match(rf"{package}\b(?![-_])", r))
bounds = re.fullmatch(rf"{package}\s*>=\s*([\w.]+)\s*,\s*<=\s*([\w.]+)", requirement)
if bounds is None:
    sys.exit(f"pyproject.toml must declare {package} as '>=OLDEST,<=NEWEST' (both tested), not {requirement!r}")
print(bounds.group(1) if end == "oldest" else bounds.group(2))
