"""Lay an EROFS image out again, so that what a first run reads is adjacent (same tree, new bytes).

mkfs.erofs 1.5 (Debian bookworm's) writes file data in its name-sorted depth-first walk, with
inodes, directories and small files' inline tails in metadata blocks scattered between the data. A
lazy reader fetches whole chunks (128 KiB), so every scattered file a sandbox touches costs its
chunk's neighbours too: measured on the workspace images, the `tests` sequence touches ~6 % of the
image but its chunks make ~16 % (docs/lazy-loading.md). erofs-utils 1.6+ can order data
(`--sort`/`--tar`); 1.5 cannot, so this module rewrites the image it made:

- the image is cut into *items*: each regular file's data blocks (contiguous in the FLAT layouts)
  and each maximal run of other blocks (superblock, inodes with their inline xattrs and tails,
  directory blocks, shared xattrs, symlink blocks), so nothing that must stay contiguous is split;
- items an access list names come first, in first-access order (the superblock's run first, the
  root inode's next: `root_nid` is 16 bits); every other item follows in its original order;
- every block address and inode number is remapped: the superblock (root nid, meta and xattr start,
  checksum), each inode's block address, each directory entry's nid, each shared-xattr id.

Block contents are copied byte for byte otherwise, so the new image holds the same tree (same
names, modes, owners, xattrs, data: the same Shoal tree digest) in the same number of blocks. Only
uncompressed images with the flat layouts are handled; anything else raises `Unsupported` (the
caller pushes the image as it is). Pure userspace: no mount, no mkfs.
"""
from __future__ import annotations

import bisect
import os
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SB_OFFSET = 1024
MAGIC = 0xE0F5E1E2
_FEATURE_SB_CSUM = 0x1
_FLAT_PLAIN, _FLAT_INLINE = 0, 2
_NULL_ADDR = 0xFFFFFFFF


class Unsupported(Exception):
    """The image uses something this rewriter does not handle (compression, chunk-based files...)."""


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c_raw(data: bytes, crc: int = 0xFFFFFFFF) -> int:
    """CRC32C without the final inversion: what the kernel's crc32c(~0, ...) returns (EROFS sb_csum)."""
    t = _CRC_TABLE
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


@dataclass
class _Inode:
    nid: int
    pos: int  # byte offset in the image
    isize: int  # 32 or 64
    layout: int
    mode: int
    size: int
    blkaddr: int
    xattr_size: int
    shared_count: int

    @property
    def nblocks(self) -> int:
        """Blocks at `blkaddr` (the flat layouts: all of the data, or all but an inline tail)."""
        if self.layout == _FLAT_PLAIN:
            return -(-self.size // 4096)
        return self.size // 4096

    @property
    def tail_pos(self) -> int:
        return self.pos + self.isize + self.xattr_size


@dataclass
class Relayout:
    """What `relayout_image` did: the items moved, and the new image's hot prefix."""

    blocks: int
    hot_items: int
    hot_bytes: int  # bytes of the items the access list named (they now lead the image)
    moved_blocks: int
    new_offsets: list[tuple[int, int]] = field(default_factory=list)  # hot items (offset, length), in order
    # bytes at the new image's start holding every item the first `startup` accesses touched (and
    # nothing after them): a reader's start-up prefix; 0 when no `startup` was given
    startup_bytes: int = 0


class _Image:
    def __init__(self, data: bytes):
        self.data = data
        sb = data[SB_OFFSET:SB_OFFSET + 128]
        if len(sb) < 128 or struct.unpack_from("<I", sb, 0)[0] != MAGIC:
            raise Unsupported("not an EROFS image")
        (self.csum, self.compat, self.blkbits, self.extslots, self.root_nid, _inos, _bt, _btn, self.blocks,
         self.meta_blkaddr, self.xattr_blkaddr) = struct.unpack_from("<IIBBHQQIIII", sb, 4)
        self.incompat, = struct.unpack_from("<I", sb, 80)
        extra_devices, = struct.unpack_from("<H", sb, 86)
        if self.blkbits != 12:
            raise Unsupported(f"block size {1 << self.blkbits} (only 4096 is handled)")
        if self.incompat or extra_devices or self.extslots:
            raise Unsupported(f"incompatible features {self.incompat:#x} / extra devices / superblock slots")
        if len(data) != self.blocks * 4096:
            raise Unsupported(f"{len(data)} bytes for {self.blocks} blocks")
        self.inodes: dict[int, _Inode] = {}
        self.dirs: list[_Inode] = []
        self._walk()

    def pos_of(self, nid: int) -> int:
        return self.meta_blkaddr * 4096 + nid * 32

    def inode(self, nid: int) -> _Inode:
        pos = self.pos_of(nid)
        fmt, icount, mode = struct.unpack_from("<HHH", self.data, pos)
        if fmt & 1:
            isize = 64
            size, blkaddr = struct.unpack_from("<QI", self.data, pos + 8)
        else:
            isize = 32
            size, = struct.unpack_from("<I", self.data, pos + 8)
            blkaddr, = struct.unpack_from("<I", self.data, pos + 16)
        layout = (fmt >> 1) & 0x7
        xattr_size = 0 if icount == 0 else 12 + (icount - 1) * 4
        shared = self.data[pos + isize + 4] if icount else 0
        if fmt >> 4:
            raise Unsupported(f"inode {nid}: unknown format bits {fmt:#x}")
        kind = stat.S_IFMT(mode)
        if kind in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK) and layout not in (_FLAT_PLAIN, _FLAT_INLINE):
            raise Unsupported(f"inode {nid}: data layout {layout} (compressed or chunk-based)")
        return _Inode(nid, pos, isize, layout, mode, size, blkaddr, xattr_size, shared)

    def dir_blocks(self, ino: _Inode) -> list[tuple[int, int]]:
        """(byte offset, length) of each directory block, the inline tail last."""
        out = [((ino.blkaddr + k) * 4096, min(4096, ino.size - k * 4096)) for k in range(ino.nblocks)]
        tail = ino.size - ino.nblocks * 4096
        if ino.layout == _FLAT_INLINE and tail > 0:  # FLAT_PLAIN: the last block may be partly used
            out.append((ino.tail_pos, tail))
        return out

    def dirents(self, ino: _Inode) -> Iterable[tuple[int, int, bytes]]:
        """(byte offset of the entry's nid, nid, name) of each entry."""
        for off, length in self.dir_blocks(ino):
            nameoff0, = struct.unpack_from("<H", self.data, off + 8)
            n = nameoff0 // 12
            for k in range(n):
                e = off + 12 * k
                nid, nameoff = struct.unpack_from("<QH", self.data, e)
                end = struct.unpack_from("<H", self.data, e + 12 + 8)[0] if k + 1 < n else length
                yield e, nid, self.data[off + nameoff:off + end].rstrip(b"\0")

    def _walk(self) -> None:
        todo = [self.root_nid]
        while todo:
            nid = todo.pop()
            if nid in self.inodes:
                continue
            ino = self.inode(nid)
            self.inodes[nid] = ino
            if stat.S_ISDIR(ino.mode):
                self.dirs.append(ino)
                for _e, child, name in self.dirents(ino):
                    if name not in (b".", b".."):
                        todo.append(child)


def _items(img: _Image) -> list[tuple[int, int]]:
    """The image cut into (first block, blocks) items, sorted."""
    files = sorted((ino.blkaddr, ino.nblocks, ino.nid) for ino in img.inodes.values()
                   if stat.S_ISREG(ino.mode) and ino.nblocks)
    items: list[tuple[int, int]] = []
    at = 0
    for start, n, nid in files:
        if start < at or start + n > img.blocks:
            raise Unsupported(f"file data of inode {nid} overlaps other data or the end")
        if start > at:
            items.append((at, start - at))  # a run of metadata blocks
        items.append((start, n))
        at = start + n
    if at < img.blocks:
        items.append((at, img.blocks - at))
    return items


def relayout_image(src: str | os.PathLike, dst: str | os.PathLike, accesses: Sequence[tuple[int, int]],
                   startup: int | None = None) -> Relayout:
    """Write `src` laid out again to `dst`: the items that the byte ranges `accesses` (offset,
    length in `src`, in first-access order) touch lead the image, in that order. `startup`: how many
    of `accesses` are a run's start-up part (their items' end in the new image is `startup_bytes`).
    Raises `Unsupported` for an image it cannot rewrite (then nothing is written)."""
    data = Path(src).read_bytes()
    img = _Image(data)
    items = _items(img)
    starts = [a for a, _ in items]

    def item_of(block: int) -> int:
        return bisect.bisect_right(starts, block) - 1

    first = [item_of(0), item_of(img.pos_of(img.root_nid) // 4096)]
    seen: set[int] = set()
    order: list[int] = []
    for i in first:
        if i not in seen:
            seen.add(i)
            order.append(i)
    hot_from = len(order)
    startup_items = len(order) if startup else 0
    for k, (off, length) in enumerate(accesses):
        if startup and k == startup:
            startup_items = len(order)
        if length <= 0 or off >= len(data):
            continue
        lo, hi = off // 4096, (min(len(data), off + length) - 1) // 4096
        i = item_of(lo)
        while i < len(items) and items[i][0] <= hi:
            if i not in seen:
                seen.add(i)
                order.append(i)
            i += 1
    if startup and startup >= len(accesses):
        startup_items = len(order)
    hot = order[hot_from:]
    order += [i for i in range(len(items)) if i not in seen]
    new_start: list[int] = [0] * len(items)
    at = 0
    for i in order:
        new_start[i] = at
        at += items[i][1]
    assert at == img.blocks

    def block(b: int) -> int:
        i = item_of(b)
        return new_start[i] + b - items[i][0]

    def byte(p: int) -> int:
        return block(p // 4096) * 4096 + p % 4096

    def nid(n: int) -> int:
        return byte(img.pos_of(n)) // 32  # new meta_blkaddr is 0

    out = bytearray(len(data))
    for i, (a, n) in enumerate(items):
        out[new_start[i] * 4096:(new_start[i] + n) * 4096] = data[a * 4096:(a + n) * 4096]
    # inodes: block address of their data / directory / symlink blocks; shared xattr ids
    for ino in img.inodes.values():
        p = byte(ino.pos)
        kind = stat.S_IFMT(ino.mode)
        if kind in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK) and ino.nblocks and ino.blkaddr != _NULL_ADDR:
            struct.pack_into("<I", out, p + 16, block(ino.blkaddr))
        for k in range(ino.shared_count):
            q = ino.pos + ino.isize + 12 + 4 * k
            xid, = struct.unpack_from("<I", data, q)
            struct.pack_into("<I", out, byte(q), byte(img.xattr_blkaddr * 4096 + xid * 4) // 4)
    # directory entries: every nid
    for d in img.dirs:
        for e, child, _name in img.dirents(d):
            struct.pack_into("<Q", out, byte(e), nid(child))
    root = nid(img.root_nid)
    if root > 0xFFFF:
        raise Unsupported(f"the root inode would get nid {root} (> 16 bits)")
    sb = SB_OFFSET  # block 0 leads the new image, so the superblock stays where it was
    struct.pack_into("<H", out, sb + 14, root)
    struct.pack_into("<II", out, sb + 40, 0, 0)  # meta and xattr start: nids and xattr ids are absolute now
    if img.compat & _FEATURE_SB_CSUM:
        struct.pack_into("<I", out, sb + 4, 0)
        struct.pack_into("<I", out, sb + 4, crc32c_raw(bytes(out[sb:4096])))
    tmp = Path(f"{dst}.{os.getpid()}.tmp")
    tmp.write_bytes(out)
    os.replace(tmp, dst)
    moved = sum(items[i][1] for i in range(len(items)) if new_start[i] != items[i][0])
    return Relayout(blocks=img.blocks, hot_items=len(hot), hot_bytes=sum(items[i][1] for i in hot) * 4096,
                    moved_blocks=moved, new_offsets=[(new_start[i] * 4096, items[i][1] * 4096) for i in hot],
                    startup_bytes=sum(items[i][1] for i in order[:startup_items]) * 4096)
