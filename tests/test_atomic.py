"""Atomic writes give the file the mode a plain open would, and read the umask without changing it for other threads."""

import os
import stat

import pytest

from hslite import atomic


@pytest.fixture
def umask():
    """Set the process umask for one test and put the caller's back."""
    before = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(before)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_an_atomic_write_has_the_mode_a_plain_open_gives(tmp_path, umask, mask):
    umask(mask)
    plain, written = tmp_path / "plain", tmp_path / "written"
    plain.write_bytes(b"x")
    atomic.atomic_write(written, lambda f: f.write(b"x"))
    assert stat.S_IMODE(written.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == 0o666 & ~mask


@pytest.mark.skipif(not atomic._PROC_STATUS.is_file(), reason="the umask is read from /proc on Linux only")
def test_the_umask_is_read_without_being_set(umask, monkeypatch):
    """Setting it to read it would, for that moment, give a file another thread creates the wrong mode."""
    umask(0o027)

    def refuse(mask):
        raise AssertionError(f"os.umask({mask:o}) changed the umask of every thread")

    monkeypatch.setattr(atomic.os, "umask", refuse)
    assert atomic.file_mode() == 0o640


def test_without_proc_the_umask_is_read_by_setting_it_to_a_private_one_and_back(tmp_path, umask, monkeypatch):
    umask(0o022)
    seen = []
    set_umask = os.umask

    def recorded(mask):
        seen.append(mask)
        return set_umask(mask)

    monkeypatch.setattr(atomic, "_PROC_STATUS", tmp_path / "no-proc" / "status")
    monkeypatch.setattr(atomic.os, "umask", recorded)
    assert atomic.file_mode() == 0o644
    assert seen == [0o077, 0o022]
