"""Outputs never destroy what they name (issue 36, item 5): ``gpipe.saving.write_atomically``, which
every file gpipe writes goes through, replaces regular files only. A symbolic link's target is
written (the link stays), a character device or a FIFO is written in place (``/dev/full``'s ENOSPC
reported in one line), a directory is refused. Devices are made in a temporary folder, never the
machine's own /dev entries."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import pytest

from gpipe.commands.args import UsageError
from gpipe.saving import NoSpaceError, write_atomically
from gpipe.translate import _write


def _text(text: str) -> object:
    def write(path: Path) -> None:
        with open(path, "w") as f:
            f.write(text)

    return write


def _full_device(folder: Path) -> Path:
    """A character device like /dev/full (major 1, minor 7) in ``folder``: writes fail with ENOSPC."""
    path = folder / "full"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except PermissionError:
        pytest.skip("making a device node needs root (CAP_MKNOD); the FIFO and link cases run anyway")
    return path


def test_a_device_is_written_in_place_and_its_error_is_one_line(tmp_path: Path) -> None:
    full = _full_device(tmp_path)
    with pytest.raises(NoSpaceError) as caught:
        write_atomically(full, _text("x" * 100_000))
    assert caught.value.errno == errno.ENOSPC
    assert stat.S_ISCHR(full.stat().st_mode)  # still the device, not a file put in its place
    with pytest.raises(UsageError, match=r"cannot write --output '.*full': no space left on device"):
        _write(str(full), ["a line\n"] * 10_000)
    assert stat.S_ISCHR(full.stat().st_mode)


def test_a_fifo_is_written_in_place(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_text()), daemon=True)
    reader.start()
    _write(str(fifo), ["one\n", "two\n"])
    reader.join(timeout=30)
    assert read == ["one\ntwo\n"]
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_symlink_is_followed_and_kept(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "translations.txt"
    target.write_text("old\n")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    _write(str(link), ["new\n"])
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new\n"
    assert not [p for p in tmp_path.rglob(".*tmp-*")]  # (no temporary file left beside either)


def test_a_directory_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "kept.txt").write_text("kept")
    with pytest.raises(IsADirectoryError, match="is a directory; name a file"):
        write_atomically(folder, _text("x"))
    with pytest.raises(UsageError, match="is a directory"):
        _write(str(folder), ["x\n"])
    assert (folder / "kept.txt").read_text() == "kept"


def test_a_dash_is_standard_output(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _write("-", ["to stdout\n"])
    assert capsys.readouterr().out == "to stdout\n"
    assert not (Path.cwd() / "-").exists()
