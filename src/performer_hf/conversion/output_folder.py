"""Writing an output folder all at once: checks before the work starts, one move after it succeeds.

The converter and the zoo builder write into a staging folder beside the output and only then
:func:`publish` it, so a failure never leaves a half-written output and never touches what was there. An output
that is a mount point (a Docker volume, a mounted disk) cannot be renamed or replaced: the staging folder is made
inside it, and its entries are moved up once the work is done (what was there set aside inside it first).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

from performer_hf_cli import in_place_of_link, output_entries, output_replaces_source, staging_prefix

from .errors import ConversionError

logger = logging.getLogger(__name__)


def check_output_dir(output_dir: Path, overwrite: bool, source: Path | None = None) -> None:
    """Refuse an output that is a file or lies under one, the ``source`` folder or a folder holding it (replacing it
    would delete the source, even with ``overwrite``), or a non-empty folder unless ``overwrite``."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConversionError(f"output {output_dir} exists and is not a folder.")
    if blocking := next((parent for parent in output_dir.parents if parent.is_file()), None):
        raise ConversionError(f"output folder {output_dir} cannot be made: {blocking} is a file, not a folder.")
    if source is not None and (replaced := output_replaces_source(output_dir, source)):
        raise ConversionError(replaced)
    if output_dir.is_dir() and output_entries(output_dir) and not overwrite:
        raise ConversionError(
            f"output folder {output_dir} exists and is not empty; pass overwrite=True (on the command line: "
            "--overwrite) to replace it."
        )
    _check_writable(output_dir)


def _check_writable(output_dir: Path) -> None:
    """Refuse, before any work, an output whose staging folder's home (its nearest existing parent, or itself for a
    mount point) takes no new folder (read-only, another user's, a system tree)."""
    output_dir = in_place_of_link(output_dir.absolute())
    if _is_mount(output_dir):
        nearest = output_dir
    else:
        nearest = next(folder for folder in output_dir.parents if folder.exists())
    try:
        Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.probe-", dir=nearest)).rmdir()
    except OSError as error:
        raise ConversionError(
            f"output folder {output_dir} cannot be written ({error.strerror or error} in {nearest}): choose a "
            "writable location."
        ) from None


def _is_mount(output_dir: Path) -> bool:
    """Whether ``output_dir`` is a mount point (a Docker volume, a mounted disk): a folder that cannot be renamed
    away, nor replaced by one from its parent's filesystem."""
    return output_dir.is_dir() and os.path.ismount(output_dir)


def _staging_home(output_dir: Path) -> Path:
    """Where the staging folder of ``output_dir`` is made: beside it, or inside it for a mount point."""
    return output_dir if _is_mount(output_dir) else output_dir.parent


def _folder_mode(output_dir: Path) -> int:
    """The permissions of the folder ``output_dir`` replaces, or of a new folder under the process's umask (the
    staging folder's own, ``tempfile.mkdtemp``'s, are 0700)."""
    if output_dir.is_dir():
        return stat.S_IMODE(output_dir.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def staging_folder(output_dir: Path) -> Path:
    """A new empty folder beside ``output_dir`` (beside the folder it links to, for a symbolic link; inside it, for a
    mount point) to write it in (:func:`publish` moves it into place). Its name records this host and process:
    staging folders of earlier runs for the same output whose process is gone (killed before it could remove its
    own) are deleted; others (another run may still be writing one, here or on another host sharing the folder) are
    named in a warning."""
    output_dir = in_place_of_link(output_dir)
    home = _staging_home(output_dir)
    home.mkdir(parents=True, exist_ok=True)
    prefix = staging_prefix(output_dir)
    leftovers = sorted(path for path in home.glob(f"{prefix}*") if path.is_dir())
    for leftover in [path for path in leftovers if _writer_is_gone(path.name.removeprefix(prefix))]:
        logger.info("Deleting %s, left by a run that was killed before it finished.", leftover)
        shutil.rmtree(leftover, ignore_errors=True)
        leftovers.remove(leftover)
    if leftovers:
        logger.warning(
            "%s holds staging folders of earlier conversions to %s that did not finish (%s): delete them if no "
            "conversion is running there.",
            home,
            output_dir.name,
            ", ".join(path.name for path in leftovers),
        )
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{socket.gethostname()}-{os.getpid()}-", dir=home))


def _writer_is_gone(suffix: str) -> bool:
    """Whether the staging folder named ``suffix`` (after its prefix: ``host-pid-random``) was made by a process of
    this host that no longer runs."""
    host_and_pid, _, _ = suffix.rpartition("-")
    host, _, pid = host_and_pid.rpartition("-")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it runs, under another user
        return False
    return False


def publish(staging: Path, output_dir: Path) -> None:
    """Move the finished ``staging`` folder to ``output_dir`` (to the folder it links to, for a symbolic link), with
    the permissions of the folder it replaces or of a new one, replacing what was there only now. A mount point
    keeps its folder: the staged entries are moved into it. A move the system refuses is undone (what was there is
    put back, no backup left) and raised as a :class:`ConversionError`."""
    output_dir = in_place_of_link(output_dir)
    try:
        if staging.parent == output_dir:  # made inside a mount point by staging_folder
            _publish_into(staging, output_dir)
        else:
            _publish_beside(staging, output_dir)
    except OSError as error:
        raise ConversionError(
            f"cannot move the finished checkpoint into {output_dir} ({error.strerror or error}); nothing there was "
            "changed. Choose another output folder, e.g. a subfolder of it."
        ) from None


def _publish_beside(staging: Path, output_dir: Path) -> None:
    """Rename ``staging`` (beside ``output_dir``) to ``output_dir``, the folder there renamed away first and deleted
    after; a refused rename puts it back."""
    staging.chmod(_folder_mode(output_dir))
    if not output_dir.exists():
        staging.rename(output_dir)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
    try:
        output_dir.rename(backup / output_dir.name)
    except OSError:
        backup.rmdir()
        raise
    try:
        staging.rename(output_dir)
    except OSError:
        (backup / output_dir.name).rename(output_dir)
        backup.rmdir()
        raise
    _delete(backup)


def _publish_into(staging: Path, output_dir: Path) -> None:
    """Move the entries of ``staging`` (made inside ``output_dir``) up into ``output_dir``, its other entries set aside
    inside it first and deleted after (staging folders of other runs left alone); a refused move puts them back."""
    backup = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir))
    old = [entry for entry in output_entries(output_dir) if entry != backup]
    new = list(staging.iterdir())
    set_aside, moved = [], []
    try:
        for entry in old:
            entry.rename(backup / entry.name)
            set_aside.append(entry)
        for entry in new:
            entry.rename(output_dir / entry.name)
            moved.append(entry)
    except OSError:
        for entry in moved:
            (output_dir / entry.name).rename(entry)
        for entry in set_aside:
            (backup / entry.name).rename(entry)
        backup.rmdir()
        raise
    staging.rmdir()
    _delete(backup)


def _delete(backup: Path) -> None:
    """Delete the folder of replaced entries; one that resists is named, the new output being in place."""
    shutil.rmtree(backup, ignore_errors=True)
    if backup.exists():
        logger.warning("could not delete %s, which holds the replaced output: delete it yourself.", backup)
