"""shoal.layers.relayout: an EROFS image made by mkfs.erofs, laid out again in a chosen order, holds
the same tree (tree digest, contents, fsck), with what the access list names at the front; and the
recorder keeps the byte ranges the list is made of."""
from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest

from shoal.layers import erofs
from shoal.layers.digest import tree_digest
from shoal.layers.relayout import Unsupported, relayout_image
from shoal.lazy import prefetch

KiB = 1 << 10


def _tree(d: Path) -> None:
    """Everything the rewriter remaps: many dirs, a directory of several blocks, inline and
    multi-block files (both flat layouts), hard links, short and long symlinks, device nodes,
    inline and shared xattrs."""
    for i in range(40):
        sub = d / f"dir{i:02d}" / "nested"
        sub.mkdir(parents=True)
        (sub / "small.txt").write_text(f"small {i}\n")  # inline in the inode
        (sub / "page.bin").write_bytes(bytes([i]) * 4096)  # one full block
        (sub / "mid.bin").write_bytes(os.urandom(20 * KiB + 123))  # blocks + an inline tail
        (d / f"dir{i:02d}" / "big.bin").write_bytes(os.urandom(130 * KiB))
        os.setxattr(sub / "small.txt", "user.shoal.same", b"shared-by-many")  # -> a shared xattr
        os.setxattr(sub / "mid.bin", f"user.own{i}".encode(), os.urandom(20))
    wide = d / "wide"
    wide.mkdir()
    for i in range(400):  # dirents over several blocks
        (wide / f"entry-with-a-long-name-{i:04d}").write_text(str(i))
    os.link(d / "dir03/big.bin", d / "wide/hardlink.bin")
    os.symlink("dir01/nested/small.txt", d / "short-link")
    os.symlink("x" * 4090, d / "long-link")  # too long to be inline: a block of its own
    os.mknod(d / "null", 0o600 | 0o020000, os.makedev(1, 3))
    os.mkfifo(d / "fifo")


def _mounted_digest(image: Path, mnt: Path) -> tuple[str, int, int]:
    mnt.mkdir(exist_ok=True)
    erofs.mount_image(image, mnt)
    try:
        return tree_digest(mnt)
    finally:
        erofs.unmount(mnt)


def _physical(path: Path) -> int:
    """The image offset of a file's first data block (FIEMAP)."""
    buf = bytearray(struct.pack("=QQIIII", 0, 2**64 - 1, 0, 0, 1, 0) + b"\0" * 56)
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), 0xC020660B, buf)
    assert struct.unpack_from("=I", buf, 20)[0] >= 1
    return struct.unpack_from("=Q", buf, 32 + 8)[0]


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> tuple[Path, str]:
    if not erofs.mkfs_available():
        pytest.skip("mkfs.erofs missing")
    d = tmp_path_factory.mktemp("rl")
    (d / "tree").mkdir()
    _tree(d / "tree")
    erofs.build_image(d / "tree", d / "a.erofs")
    return d / "a.erofs", _mounted_digest(d / "a.erofs", d / "m")[0]


def test_an_empty_access_list_changes_nothing(image, tmp_path):
    src, _ = image
    r = relayout_image(src, tmp_path / "same.erofs", [])
    assert (tmp_path / "same.erofs").read_bytes() == src.read_bytes()
    assert r.hot_items == 0 and r.moved_blocks == 0


def test_every_block_moved_keeps_the_tree(image, tmp_path):
    src, want = image
    size = src.stat().st_size
    # the whole image named back to front: every item moves (but the superblock's)
    accesses = [(off, 4096) for off in range(size - 4096, -1, -4096)]
    out = tmp_path / "rev.erofs"
    r = relayout_image(src, out, accesses)
    assert out.stat().st_size == size and out.read_bytes() != src.read_bytes()
    assert r.moved_blocks > 0.9 * (size // 4096)
    fsck = subprocess.run(["fsck.erofs", str(out)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stderr
    assert _mounted_digest(out, tmp_path / "m")[0] == want  # names, modes, owners, bytes, xattrs


HOT = ["dir37/big.bin", "dir05/nested/mid.bin", "dir21/big.bin"]


def _hot_offsets(src: Path, mnt: Path) -> dict[str, int]:
    """Where each of HOT's files starts in `src` (mounted on `mnt`, left as an empty folder)."""
    mnt.mkdir()
    erofs.mount_image(src, mnt)
    try:
        return {p: _physical(mnt / p) for p in HOT}
    finally:
        erofs.unmount(mnt)


def test_the_files_an_access_list_names_lead_the_image(image, tmp_path):
    src, want = image
    mnt = tmp_path / "m"
    before = _hot_offsets(src, mnt)
    out = tmp_path / "hot.erofs"
    r = relayout_image(src, out, [(before[p] + 4096, 100) for p in HOT])  # one read inside each, in this order
    assert r.hot_items == 3
    erofs.mount_image(out, mnt)
    try:
        after = [_physical(mnt / p) for p in HOT]
        assert (mnt / "dir37/big.bin").read_bytes() == (image[0].parent / "tree/dir37/big.bin").read_bytes()
    finally:
        erofs.unmount(mnt)
    # in access order, back to back, right after the superblock's run of metadata blocks
    assert after == sorted(after) and after[1] - after[0] in (32 * 4096, 33 * 4096)
    assert after[2] - after[1] in (5 * 4096, 6 * 4096) and r.hot_bytes == after[2] - after[0] + (after[1] - after[0])
    assert after[0] < 64 * 4096 < min(before.values())
    assert _mounted_digest(out, tmp_path / "m2")[0] == want


def test_the_start_up_prefix_ends_after_the_items_of_the_first_accesses(image, tmp_path):
    src, want = image
    mnt = tmp_path / "m"
    before = _hot_offsets(src, mnt)
    accesses = [(before[p] + 4096, 100) for p in HOT]
    ends = []
    for startup in (1, 2, 3, 9):  # 9: more than the list has, all of it
        r = relayout_image(src, tmp_path / f"s{startup}.erofs", accesses, startup)
        erofs.mount_image(tmp_path / f"s{startup}.erofs", mnt)
        try:
            after = [_physical(mnt / p) for p in HOT]
        finally:
            erofs.unmount(mnt)
        ends.append(r.startup_bytes)
        if startup < 3:  # the next hot item starts where the prefix ends
            assert r.startup_bytes == after[startup]
        else:
            assert r.startup_bytes == after[2] + after[1] - after[0]  # dir21/big.bin is as long as dir37's
    assert ends[2] == ends[3] and ends[0] < ends[1] < ends[2]
    assert relayout_image(src, tmp_path / "n.erofs", accesses).startup_bytes == 0  # not known: none
    assert _mounted_digest(tmp_path / "s2.erofs", tmp_path / "m2")[0] == want


def test_a_compressed_image_is_left_as_it_is(tmp_path):
    if not erofs.mkfs_available():
        pytest.skip("mkfs.erofs missing")
    (tmp_path / "t").mkdir()
    (tmp_path / "t/f").write_bytes(b"abc" * 100_000)
    erofs.build_image(tmp_path / "t", tmp_path / "z.erofs", compression="lz4")
    with pytest.raises(Unsupported):
        relayout_image(tmp_path / "z.erofs", tmp_path / "out.erofs", [(0, 4096)])
    assert not (tmp_path / "out.erofs").exists()


def test_the_recorder_keeps_byte_ranges_of_new_pages(tmp_path):
    rec = prefetch.Recorder(tmp_path, "sha256:" + "ab" * 32, blob="sha256:" + "cd" * 32)
    rec.FLUSH_S = 0.05
    rec.saw_range(8192, 4096)
    rec.saw_range(12288, 8192)  # continues the last range: merged
    rec.saw_range(8192, 100)  # nothing new: not kept
    rec.saw_range(0, 4096)
    rec.saw(0)
    rec.saw_range(9000, 20000)  # partly new: kept whole
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        got = prefetch.load_ranges(tmp_path, "sha256:" + "ab" * 32)
        if got and len(got[1]) == 3:
            break
        time.sleep(0.02)
    assert got == ("sha256:" + "cd" * 32, [(8192, 12288), (0, 4096), (9000, 20000)])
    data = json.loads(prefetch.prefetch_path(tmp_path, "sha256:" + "ab" * 32).read_text())
    assert data["chunks"] == [0] and prefetch.load(tmp_path, "sha256:" + "ab" * 32) == [0]
    # a recorder that does not know its blob keeps chunk numbers only (the old format)
    rec2 = prefetch.Recorder(tmp_path / "b", "sha256:" + "ab" * 32)
    rec2.saw_range(0, 4096)
    rec2.saw(3)
    assert prefetch.load_ranges(tmp_path / "b", "sha256:" + "ab" * 32) is None


def test_the_recorder_notes_which_ranges_came_before_the_first_command_ended(tmp_path):
    digest = "sha256:" + "ab" * 32
    rec = prefetch.Recorder(tmp_path, digest, blob="sha256:" + "cd" * 32)
    rec.saw_range(0, 4096)
    rec.saw(0)
    rec.saw_range(8192, 4096)
    prefetch.startup_path(tmp_path, digest).parent.mkdir(parents=True, exist_ok=True)
    prefetch.startup_path(tmp_path, digest).touch()  # Host.exec: the first command has finished
    rec.saw_range(12288, 4096)  # adjacent to the last range, but after the mark: a range of its own
    rec.saw(1)
    rec.flush()
    assert rec.startup_ranges == 2 and prefetch.load_startup_ranges(tmp_path, digest) == 2
    assert prefetch.load_ranges(tmp_path, digest)[1] == [(0, 4096), (8192, 4096), (12288, 4096)]
    # marked, and nothing new read after it (the recorder never saw the mark): every range is start-up
    rec2 = prefetch.Recorder(tmp_path / "b", digest, blob="sha256:" + "cd" * 32)
    rec2.saw_range(0, 8192)
    rec2.saw(0)
    rec2.saw_range(65536, 4096)
    rec2.flush()
    prefetch.startup_path(tmp_path / "b", digest).touch()
    assert rec2.startup_ranges is None and prefetch.load_startup_ranges(tmp_path / "b", digest) == 2
    body = prefetch.dumps(digest, [0, 1], [[0, 4096]], "sha256:" + "cd" * 32, 1, 2)
    assert prefetch.parse_startup_ranges(body) == 2
    assert prefetch.parse_startup_ranges(prefetch.dumps(digest, [0], None, None, 1, 2)) is None  # no ranges


def test_a_first_run_records_pages_of_a_chunk_a_neighbour_fetched(host, base_image, make_root, range_server,
                                                                  origin_dir, tmp_path, monkeypatch):
    """The C warm path records nothing: while a layer records, a chunk is served there only once each
    of its pages was read (through Python, recorded), so the list holds every file the run read."""
    from shoal import Sandbox
    from shoal.lazy.publish import publish_to_dir, register_http_layer

    tree = tmp_path / "t"
    for i in range(8):  # a, a filler never read, z: in name order, so on disk
        d = tree / f"d{i}"
        d.mkdir(parents=True)
        (d / "a.bin").write_bytes(os.urandom(8 * KiB))
        (d / "m-filler.bin").write_bytes(os.urandom(40 * KiB))
        (d / "z.bin").write_bytes(os.urandom(8 * KiB))
    (tree / "zz-cold.bin").write_bytes(os.urandom(3 << 20))  # never read: the layer is never complete
    monkeypatch.setenv("SHOAL_LAZY_PROMOTE", "0")  # nor promoted to a local image under the sandbox
    layer = host.store.build_from_dir(tree, source="test:record-pages").digest
    index = publish_to_dir(host.store, layer, origin_dir)
    publish_to_dir(host.store, host.store.resolve("busybox"), origin_dir)
    mnt = tmp_path / "m"
    mnt.mkdir()
    erofs.mount_image(host.store.image_path(layer), mnt)
    try:
        where = {i: (_physical(mnt / f"d{i}/a.bin"), _physical(mnt / f"d{i}/z.bin")) for i in range(8)}
    finally:
        erofs.unmount(mnt)
    same = [i for i, (a, z) in where.items() if a // index.chunk_size == z // index.chunk_size]
    assert same, where  # 56 KiB spans: some triple lies within one chunk

    h = make_root()
    for d in (host.store.resolve("busybox"), layer):
        register_http_layer(h.store, range_server.url, d)
    h.store.create_image("rec:1", [host.store.resolve("busybox"), layer])
    with Sandbox.create("rec:1", root=h.settings.root) as sb:
        for i in same:  # a first (its chunk is fetched), then z from the same chunk
            assert sb.commands.run(f"cat /d{i}/a.bin > /dev/null && cat /d{i}/z.bin > /dev/null").exit_code == 0
    time.sleep(1)  # the recorder's last ranges reach its file
    got = prefetch.load_ranges(h.settings.root, layer)
    assert got is not None and got[0] == index.blob
    for i in same:
        z = where[i][1]
        assert any(off <= z < off + n for off, n in got[1]), f"z.bin of d{i} at {z} not recorded"
