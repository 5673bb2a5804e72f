"""Screenshots: Xvfb's framebuffer file (XWD, `-fbdir`) -> PNG, on the host side.

Xvfb keeps the screen in an mmap'd XWD file inside the sandbox, so a screenshot is one file read
through the files API (no process in the sandbox) and a PNG encode here. Pure Python (zlib and
strided slices; no imaging library needed): ~3 MB of 1280x800 pixels encode in milliseconds."""
from __future__ import annotations

import struct
import zlib
from array import array
from operator import itemgetter

from ..core.errors import DesktopUnavailable, InvalidArgument

_HEADER = struct.Struct(">25I")  # XWDFileHeader: 25 big-endian CARD32, then the window name
# the file is the sandbox's to forge: every size in it is bounded before any work depends on it
MAX_SIDE = 8192
MAX_HEADER = 1 << 16
MAX_COLORS = 1 << 16


def xwd_size(data: bytes) -> tuple[int, int]:
    h = _fields(data)
    return h[4], h[5]


def _fields(data: bytes) -> tuple[int, ...]:
    if len(data) < _HEADER.size:
        raise DesktopUnavailable("the framebuffer is missing or truncated (is the X server running?)")
    h = _HEADER.unpack_from(data)
    if h[1] != 7 or h[2] != 2 or h[11] != 32:  # version 7, ZPixmap, 32 bits per pixel
        raise DesktopUnavailable(f"unexpected framebuffer format (version {h[1]}, format {h[2]}, {h[11]} bpp)")
    header_size, width, height, bpl, ncolors = h[0], h[4], h[5], h[12], h[19]
    if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE and _HEADER.size <= header_size <= MAX_HEADER
            and ncolors <= MAX_COLORS and width * 4 <= bpl <= width * 4 + 64):
        raise DesktopUnavailable(f"implausible framebuffer header ({width}x{height}, {bpl} bytes per line, "
                                 f"header {header_size} bytes, {ncolors} colours)")
    return h


def xwd_to_png(data: bytes, scale: float | None = None) -> bytes:
    """PNG (8-bit RGB) of an XWD ZPixmap at 32 bpp, nearest-neighbour scaled by `scale` in (0, 1]."""
    h = _fields(data)
    header_size, width, height, byte_order, bpl, ncolors = h[0], h[4], h[5], h[7], h[12], h[19]
    off = header_size + 12 * ncolors
    if len(data) < off + bpl * height or bpl < width * 4:
        raise DesktopUnavailable("the framebuffer is truncated (the X server is resizing or gone)")
    px = data[off:off + bpl * height]
    if bpl != width * 4:  # row padding: keep only the pixels
        px = b"".join(px[r * bpl:r * bpl + width * 4] for r in range(height))
    if scale is not None:
        if not 0 < scale <= 1:
            raise InvalidArgument(f"scale must be in (0, 1], got {scale}")
        px, width, height = _scaled(px, width, height, scale)
    # LSBFirst: pixel bytes are B, G, R, X (MSBFirst: X, R, G, B)
    bi, gi, ri = (0, 1, 2) if byte_order == 0 else (3, 2, 1)
    rgb = bytearray(width * height * 3)
    rgb[0::3] = px[ri::4]
    rgb[1::3] = px[gi::4]
    rgb[2::3] = px[bi::4]
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[r * stride:(r + 1) * stride] for r in range(height))
    return png(width, height, raw)


def _scaled(px: bytes, width: int, height: int, scale: float) -> tuple[bytes, int, int]:
    w2, h2 = max(1, round(width * scale)), max(1, round(height * scale))
    words = array("I")
    words.frombytes(px)
    cols = [min(width - 1, int((c + 0.5) * width / w2)) for c in range(w2)]
    pick = itemgetter(*cols) if w2 > 1 else (lambda row: (row[cols[0]],))
    out = array("I")
    for r in range(h2):
        src = min(height - 1, int((r + 0.5) * height / h2)) * width
        out.extend(pick(words[src:src + width]))
    return out.tobytes(), w2, h2


def png(width: int, height: int, raw_scanlines: bytes) -> bytes:
    """A PNG of filtered scanlines (filter byte + RGB per row)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw_scanlines, 1))
            + chunk(b"IEND", b""))


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise InvalidArgument("not a PNG")
    w, h = struct.unpack(">II", data[16:24])
    return w, h
