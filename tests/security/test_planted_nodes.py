"""The host reads sandbox files through the files API (users=, E2B's accounts, the desktop's
framebuffer). A sandbox can put a device, FIFO or terminal where such a file is expected: the host
must refuse it without opening it. Opening a terminal without O_NOCTTY would make it the controlling
terminal of a session leader such as shoald under systemd, and the sandbox could then signal it."""
from __future__ import annotations

import os
import subprocess

import pytest

from shoal.backends.files import SandboxFiles
from shoal.core.errors import FileOpError


def _child_reads(root: str, path: str) -> int:
    """In a new session (no controlling terminal, as shoald under systemd): read `path`, then report
    0 if the read was refused and no controlling terminal was taken, else a code saying what went wrong."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setsid()
            try:
                SandboxFiles(root, "sb-test").read(path)
                code = 2  # read a non-regular file
            except FileOpError:
                pass
            try:
                os.close(os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY))
                code = code or 3  # the planted terminal became the controlling terminal
            except OSError:
                pass
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_planted_terminal_is_refused_and_never_becomes_the_controlling_tty(tmp_path):
    # the terminal itself, as a sandbox sees its own /dev/pts/N (a node made with mknod elsewhere
    # is not one: devpts refuses it), bind-mounted where the host will read
    master, slave = os.openpty()
    target = tmp_path / "etc" / "passwd"
    target.parent.mkdir()
    target.touch()
    subprocess.run(["mount", "--bind", os.ttyname(slave), str(target)], check=True)
    try:
        os.symlink("/etc/passwd", tmp_path / "etc" / "group")  # and through a symlink, as an agent would
        assert _child_reads(str(tmp_path), "/etc/passwd") == 0
        assert _child_reads(str(tmp_path), "/etc/group") == 0
    finally:
        subprocess.run(["umount", str(target)], check=True)
        os.close(master)
        os.close(slave)


def test_a_planted_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fb")
    with pytest.raises(FileOpError, match="not a regular file"):
        SandboxFiles(str(tmp_path), "sb-test").read("/fb")
    with pytest.raises(FileOpError, match="is a directory"):
        SandboxFiles(str(tmp_path), "sb-test").read("/")
    (tmp_path / "ok").write_bytes(b"fine")
    assert SandboxFiles(str(tmp_path), "sb-test").read("/ok") == b"fine"
