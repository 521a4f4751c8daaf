"""Publishing a converted checkpoint into its output folder: a mount point (a Docker volume, a mounted disk) that
cannot be renamed away, and a move the system refuses."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from performer_hf.cli import main
from performer_hf.conversion import output_folder

from ..conversion_sources import CASES, save_source


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("publish") / "tiny-bert"
    save_source(next(case for case in CASES if case.name == "bert-mlm"), folder)
    return folder


def refuse_renames(monkeypatch, refused) -> None:
    """Make ``Path.rename`` raise EBUSY (what a mount point answers) for each path ``refused(source, target)``
    names."""
    rename = Path.rename

    def guarded(self, target):
        if refused(Path(self), Path(target)):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(self), str(target))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", guarded)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_mount_point_output_is_written_into(overwrite, tiny_bert, tmp_path, monkeypatch, capsys):
    """Converting into a mount point renamed it away to replace it: EBUSY, a raw traceback, the conversion lost and an
    empty ``.volume.old-*`` folder left. The checkpoint is now staged inside the volume and its entries moved up;
    with --overwrite the volume's earlier entries are deleted only after."""
    volume = tmp_path / "volume"
    volume.mkdir()
    if overwrite:
        (volume / "old.txt").write_text("old")
        (volume / "old").mkdir()
    monkeypatch.setattr(output_folder.os.path, "ismount", lambda path: Path(path) == volume)
    refuse_renames(monkeypatch, lambda source, target: volume in (source, target))
    argv = ["convert", str(tiny_bert), str(volume), "--no-fidelity", "-q"] + (["--overwrite"] if overwrite else [])
    assert main(argv) == 0, capsys.readouterr().err
    written = sorted(path.name for path in volume.iterdir())
    assert {"config.json", "model.safetensors", "README.md", "conversion_report.json"} <= set(written)
    assert not [name for name in written if name.startswith((".", "old"))]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["volume"]


def test_a_refused_move_is_one_clear_error_and_leaves_the_old_output(tiny_bert, tmp_path, monkeypatch, capsys):
    """A rename the system refuses while publishing escaped the command line as a raw OSError and left a
    ``.out.old-*`` folder; now the old output is put back and the error is one line naming the fix."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    refuse_renames(monkeypatch, lambda source, target: target == out and source.name.startswith(".out.tmp-"))
    assert main(["convert", str(tiny_bert), str(out), "--no-fidelity", "-q", "--overwrite"]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "cannot move the finished checkpoint into" in error[0], error
    assert "Device or resource busy" in error[0] and "subfolder" in error[0]
    assert sorted(path.name for path in out.iterdir()) == ["keep.txt"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


def test_a_refused_move_into_a_mount_point_puts_its_entries_back(tmp_path, monkeypatch):
    """A move into a mount point refused half way: the entries already moved go back to the staging folder (which
    the caller deletes), the volume's own come back, and no backup folder is left."""
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "keep.txt").write_text("old")
    monkeypatch.setattr(output_folder.os.path, "ismount", lambda path: Path(path) == volume)
    staging = output_folder.staging_folder(volume)
    assert staging.parent == volume
    for name in ("a.json", "b.json"):
        (staging / name).write_text(name)
    refuse_renames(monkeypatch, lambda source, target: target == volume / "b.json")
    with pytest.raises(output_folder.ConversionError, match="cannot move the finished checkpoint"):
        output_folder.publish(staging, volume)
    assert sorted(path.name for path in staging.iterdir()) == ["a.json", "b.json"]
    assert sorted(path.name for path in volume.iterdir()) == sorted([staging.name, "keep.txt"])


@pytest.mark.parametrize("via_link", [False, True], ids=["volume", "link-to-volume"])
def test_a_mount_point_left_with_a_killed_runs_staging_folder_takes_a_new_conversion(
    via_link, tiny_bert, tmp_path, monkeypatch, capsys
):
    """A conversion into a mount point killed before it finished leaves its staging folder inside the volume: the next
    conversion refused the volume as not empty (pass --overwrite) though it held nothing of the user's. The staging
    folder of a run that is gone is not an entry of the output: the conversion goes ahead and deletes it. So through a
    symbolic link to the volume (a link to a larger disk), whose staging folders are named after the volume (they
    were looked for under the link's name)."""
    volume = tmp_path / "volume"
    volume.mkdir()
    output = volume
    if via_link:
        output = tmp_path / "models"
        output.symlink_to(volume)
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = volume / f".volume.tmp-{socket.gethostname()}-{finished.stdout.strip()}-abc123"
    killed.mkdir()
    (killed / "model.safetensors").write_text("half written")
    monkeypatch.setattr(output_folder.os.path, "ismount", lambda path: Path(path) == volume)
    refuse_renames(monkeypatch, lambda source, target: volume in (source, target))
    assert main(["convert", str(tiny_bert), str(output), "--no-fidelity", "-q"]) == 0, capsys.readouterr().err
    written = sorted(path.name for path in volume.iterdir())
    assert {"config.json", "model.safetensors", "README.md"} <= set(written)
    assert not [name for name in written if name.startswith(".")]
