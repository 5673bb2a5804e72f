"""shoal-init is linked statically where the libc allows it (native.LINK_MODES): a dynamic helper maps
the host's libc and ld.so in two processes per sandbox, and at 10,000 sandboxes every exec on the host
waits on libc's reverse-map lock (docs/density.md, "the create tail")."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

from shoal.backends.container import native

PT_INTERP = 3


def program_header_types(exe: Path) -> list[int]:
    """p_type of each program header of a 64-bit little-endian ELF file."""
    data = exe.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, f"{exe} is not a 64-bit ELF file"
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return [struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)]


def static_libc() -> bool:
    return any(Path(d, "libc.a").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"))


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler")
def test_the_installed_helper_has_no_program_interpreter():
    if not static_libc():
        pytest.skip("no static libc here: the helper falls back to dynamic linking")
    exe = native.helper_path()
    assert PT_INTERP not in program_header_types(exe), f"{exe} is dynamically linked (it has PT_INTERP)"


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler")
def test_a_toolchain_without_static_libc_still_builds_a_working_helper(tmp_path, monkeypatch, capfd):
    """The fallback: a link mode that fails is skipped (simulated by a mode the linker rejects)."""
    monkeypatch.setattr(native, "LINK_MODES", (("-Wl,--no-such-linker-option",), ()))
    exe = native.build(tmp_path)
    assert PT_INTERP in program_header_types(exe)
    assert "linked dynamically" in capfd.readouterr().err


def test_the_name_changes_with_the_link_flags(monkeypatch):
    before = native.binary_name()
    monkeypatch.setattr(native, "LINK_MODES", ((),))
    assert native.binary_name() != before, "a change of link flags must not reuse an old binary's name"
