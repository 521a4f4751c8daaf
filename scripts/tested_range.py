"""Print what CI installs at one end of the ranges pyproject.toml declares.

`python scripts/tested_range.py PACKAGE oldest|newest`: one end of the range of transformers or torch, the lower or
the upper bound. Both bounds are inclusive (`>=A,<=B`) so that they name the two releases CI installs and tests; a
release outside them is never picked up silently.

`python scripts/tested_range.py --lower-bounds`: every other requirement users install (the dependencies and the
extras in LOWER_BOUND_EXTRAS) at its lower bound, one `name==version` a line. The oldest leg installs these beside the
oldest transformers and torch, so that each lower bound names a release the suite has passed with (the newest leg
takes the newest of each)."""

import re
import sys
from pathlib import Path

import tomllib

TESTED = ("transformers", "torch")
LOWER_BOUND_EXTRAS = ("train", "llm")  # test, bench and eval serve our own checks; demo's package is data
USAGE = f"usage: python scripts/tested_range.py {{{','.join(TESTED)}}} {{oldest,newest}} | --lower-bounds"
project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]


def name_of(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)


def tested_end(package: str, end: str) -> str:
    requirement = next(r for r in project["dependencies"] if name_of(r) == package)
    bounds = re.fullmatch(rf"{package}\s*>=\s*([\w.]+)\s*,\s*<=\s*([\w.]+)", requirement)
    if bounds is None:
        sys.exit(f"pyproject.toml must declare {package} as '>=OLDEST,<=NEWEST' (both tested), not {requirement!r}")
    return bounds.group(1) if end == "oldest" else bounds.group(2)


def lower_bounds() -> list[str]:
    extras = project["optional-dependencies"]
    requirements = project["dependencies"] + [r for extra in LOWER_BOUND_EXTRAS for r in extras[extra]]
    pins = []
    for requirement in requirements:
        name = name_of(requirement)
        if name in TESTED:
            continue
        lower = re.search(r">=\s*([\w.]+)", requirement.split(";")[0])
        if lower is None:
            sys.exit(f"pyproject.toml must give {name} a lower bound ('>=', tested by the oldest leg): {requirement!r}")
        pins.append(f"{name}=={lower.group(1)}")
    return pins


if sys.argv[1:] == ["--lower-bounds"]:
    print("\n".join(lower_bounds()))
elif len(sys.argv) == 3 and sys.argv[1] in TESTED and sys.argv[2] in ("oldest", "newest"):
    print(tested_end(*sys.argv[1:]))
else:
    sys.exit(USAGE)
