"""The desktop's framebuffer file is the sandbox's to forge: sizes in its header are bounded before
any work depends on them (a height of 2^32 - 1 with zero-width rows once meant a list of 4 billion rows
built inside shoald)."""
from __future__ import annotations

import struct
import time

import pytest

from shoal.core.errors import DesktopUnavailable
from shoal.desktop.screen import xwd_to_png


def xwd(width: int, height: int, bpl: int | None = None, pixels: bytes | None = None, header: int = 100) -> bytes:
    h = [0] * 25
    h[0], h[1], h[2], h[4], h[5], h[11], h[12] = header, 7, 2, width, height, 32, width * 4 if bpl is None else bpl
    body = pixels if pixels is not None else b"\x10\x20\x30\x00" * (width * height)
    return struct.pack(">25I", *h) + b"\0" * (header - 100) + body


def test_a_good_frame_encodes():
    png = xwd_to_png(xwd(4, 3))
    assert png.startswith(b"\x89PNG") and struct.unpack(">II", png[16:24]) == (4, 3)


@pytest.mark.parametrize("width,height,bpl", [
    (0, 0xFFFFFFFF, 0),          # zero-width rows, 4 billion of them
    (1, 0xFFFFFFFF, 4),          # rows that the data cannot hold
    (100_000, 10, 400_000),      # wider than any screen
    (10, 10, 1 << 30),           # a row stride far past the row
    (10, 10, 39),                # a stride shorter than a row
])
def test_forged_sizes_are_refused_at_once(width, height, bpl):
    t0 = time.monotonic()
    with pytest.raises(DesktopUnavailable):
        xwd_to_png(xwd(width, height, bpl, pixels=b"\0" * 4096))
    assert time.monotonic() - t0 < 1.0


def test_a_forged_header_size_is_refused():
    with pytest.raises(DesktopUnavailable):
        xwd_to_png(xwd(4, 3, header=1 << 20))
