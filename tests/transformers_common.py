"""transformers' own common model tests, fetched for the installed transformers at test time.

``ModelTesterMixin`` and ``ConfigTester`` live in transformers' source distribution
(``tests/test_modeling_common.py``, ``tests/test_configuration_common.py``), not in its wheel. This
module downloads the sdist of exactly the installed version from the package index once (cached under
``~/.cache/performer_hf/transformers-tests/<version>``), extracts those two files into a package and
imports them, so the checks always match the transformers being tested, and none of its code is kept
in this repository.

The sdist omits three modules those files import. They are replaced by stand-ins, stated here:
- ``generation/test_utils.py`` (``GenerationTesterMixin``): an empty class. Our tests do not inherit it;
  ``test_modeling_performer_generation.py`` checks cached decoding against full recomputation for every
  method (greedy, sampling, beam search, padded and unpadded).
- ``exporters/test_export.py`` (``ExportTesterMixin``): an empty class; ``torch.export`` is tested in
  ``test_modeling_performer_common.py`` directly.
- ``utils/test_configuration_utils.py`` (``config_common_kwargs``): our own set of common
  ``PreTrainedConfig`` arguments with non-default values, for ``ConfigTester``'s argument check.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

PACKAGE = "transformers_common_tests"
_FILES = ("test_modeling_common.py", "test_configuration_common.py")
_STAND_INS = {
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    "utils/test_configuration_utils.py": (
        "import torch\n\n"
        "config_common_kwargs = {\n"
        '    "return_dict": False,\n'
        '    "output_hidden_states": True,\n'
        '    "dtype": torch.float16,\n'
        '    "tie_word_embeddings": False,\n'
        '    "chunk_size_feed_forward": 5,\n'
        '    "architectures": ["PerformerForMaskedLM"],\n'
        '    "id2label": {0: "no", 1: "yes"},\n'
        '    "label2id": {"no": 0, "yes": 1},\n'
        '    "problem_type": "regression",\n'
        '    "bos_token_id": 3,\n'
        '    "eos_token_id": 4,\n'
        "}\n"
    ),
}


def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "performer_hf" / "transformers-tests" / transformers.__version__


def _download_sdist(into: Path) -> Path:
    version = transformers.__version__
    # pip prepares the sdist's metadata in an isolated build environment: the test environment's own setuptools may
    # predate bdist_wheel (68.0, the oldest leg's bound, needs the wheel package for it)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
    command += ["-d", str(into), f"transformers=={version}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    archives = list(into.glob("transformers-*.tar.gz"))
    if result.returncode != 0 or not archives:
        raise RuntimeError(
            f"Could not download the transformers {version} source distribution (its tests/ hold the common "
            f"model tests): {result.stderr.strip()[-2000:]}"
        )
    return archives[0]


def _build(target: Path) -> None:
    """Write the package (sdist files + stand-ins) to a temporary folder, then move it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        work = Path(work)
        archive = _download_sdist(work)
        package = work / PACKAGE
        package.mkdir()
        with tarfile.open(archive) as tar:
            for name in _FILES:
                member = next(m for m in tar.getmembers() if m.name.endswith(f"/tests/{name}"))
                (package / name).write_bytes(tar.extractfile(member).read())
        (package / "__init__.py").write_text("")
        for relative, text in _STAND_INS.items():
            path = package / relative
            path.parent.mkdir(exist_ok=True)
            (path.parent / "__init__.py").touch()
            path.write_text(text)
        try:
            package.rename(target)
        except OSError:  # unless another process (a pytest-xdist worker) built it meanwhile
            if not (target / _FILES[-1]).exists():
                raise


def load(module: str):
    """Import ``module`` (e.g. ``"test_modeling_common"``) from the installed version's common tests."""
    root = _cache_dir()
    if not (root / PACKAGE / _FILES[-1]).exists():
        _build(root / PACKAGE)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"{PACKAGE}.{module}")
