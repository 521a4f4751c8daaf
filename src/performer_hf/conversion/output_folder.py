"""Writing an output folder all at once: checks before the work starts, one move after it succeeds.

The converter and the zoo builder write into a staging folder beside the output and only then
:func:`publish` it, so a failure never leaves a half-written output and never touches what was there.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from performer_hf_cli import output_replaces_source

from .errors import ConversionError


def check_output_dir(output_dir: Path, overwrite: bool, source: Path | None = None) -> None:
    """Refuse an output that is a file or lies under one, the ``source`` folder or a folder holding it (replacing it
    would delete the source, even with ``overwrite``), or a non-empty folder unless ``overwrite``."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConversionError(f"output {output_dir} exists and is not a folder.")
    if blocking := next((parent for parent in output_dir.parents if parent.is_file()), None):
        raise ConversionError(f"output folder {output_dir} cannot be made: {blocking} is a file, not a folder.")
    if source is not None and (replaced := output_replaces_source(output_dir, source)):
        raise ConversionError(replaced)
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise ConversionError(f"output folder {output_dir} exists and is not empty; pass --overwrite to replace it.")


def publish(staging: Path, output_dir: Path) -> None:
    """Move the finished ``staging`` folder to ``output_dir``, replacing what was there only now."""
    if output_dir.exists():
        backup = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
        output_dir.rename(backup / output_dir.name)
        staging.rename(output_dir)
        shutil.rmtree(backup)
    else:
        staging.rename(output_dir)
