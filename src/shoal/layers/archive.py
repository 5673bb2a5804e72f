"""Reading layer tarballs and image archives safely.

`extract_layer_tar` unpacks one layer tar into a directory and translates OCI whiteouts into the
overlayfs form the kernel understands (`.wh.NAME` -> 0/0 character device NAME; `.wh..wh..opq` ->
`trusted.overlay.opaque=y` on the directory). Members that would land outside the destination —
absolute or `..` paths, paths through a symlink, hard links to outside — are refused; device nodes
(but the 0/0 whiteout form) are left out.

`read_image_archive` understands `docker save` archives (manifest.json) and OCI image layouts
(index.json + blobs/), and yields each layer's tar stream bottom to top.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..core.errors import CorruptArchive, QuotaExceeded

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"

# A layer tar is hostile input (a registry's, a tenant's): what one may put on the host's disk is
# bounded. Sizes are the members' own (a sparse member counts its full length: mkfs.erofs and the
# tree digest read every byte of it); both bounds can be raised for a host that imports huge layers.
MAX_LAYER_BYTES = int(os.environ.get("SHOAL_MAX_LAYER_BYTES", str(64 << 30)))
MAX_LAYER_ENTRIES = int(os.environ.get("SHOAL_MAX_LAYER_ENTRIES", str(2_000_000)))
FREE_RESERVE_BYTES = 1 << 30  # an import never takes the disk's last GiB


def _clean_name(name: str) -> str:
    parts = []
    for p in name.replace("\\", "/").split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            raise CorruptArchive(f"tar member {name!r} climbs out of the layer with '..'")
        parts.append(p)
    return "/".join(parts)


def _check_parent(dest: str, rel: str) -> None:
    """Refuse a member whose parent path crosses a symlink (it could point at the host)."""
    cur = dest
    for part in rel.split("/")[:-1]:
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise CorruptArchive(f"tar member {rel!r} passes through symlink {cur[len(dest):]!r}")


def remove_path(path: str) -> None:
    """Remove a file, link, device or whole directory tree; nothing if absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        import shutil

        shutil.rmtree(path)
    else:
        os.unlink(path)


def make_whiteout(path: str) -> None:
    remove_path(path)
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


# extract_layer_tar's own checks are the filter; tarfile's (`filter=`, Python >= 3.11.4) must not second-guess them.
# Debian 12's python3 is 3.11.2, which has no `filter` argument at all and behaves as "fully_trusted".
_NO_TAR_FILTER: dict[str, Any] = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def extract_layer_tar(fileobj: IO[bytes] | None, dest: Path, path: Path | None = None,
                      max_bytes: int | None = None, max_entries: int | None = None) -> int:
    """Extract one layer tar (plain or compressed) into `dest`; returns the member count.

    More than `max_bytes` of file data (default MAX_LAYER_BYTES, and never more than the disk has
    free less FREE_RESERVE_BYTES) or `max_entries` members raises QuotaExceeded: a gzip/zstd bomb,
    a huge sparse member or millions of tiny entries stop there, not when the host's disk is full."""
    dest_s = str(dest)
    count = 0
    limit = min(MAX_LAYER_BYTES if max_bytes is None else max_bytes,
                _free_bytes(dest_s) - FREE_RESERVE_BYTES)
    max_entries = MAX_LAYER_ENTRIES if max_entries is None else max_entries
    total = 0
    try:
        tf = tarfile.open(name=str(path) if path else None, fileobj=fileobj, mode="r|*")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise CorruptArchive(f"not a readable tar archive ({e})") from e
    try:
        with tf:
            for member in tf:
                count += 1
                if count > max_entries:
                    raise QuotaExceeded(f"layer tar has more than {max_entries} entries: refused "
                                        "(SHOAL_MAX_LAYER_ENTRIES raises the bound)")
                if member.isreg():
                    total += member.size
                    if total > limit:
                        raise QuotaExceeded(f"layer tar holds more than {max(limit, 0)} bytes of files (at "
                                            f"{member.name!r}): refused (the bound is SHOAL_MAX_LAYER_BYTES or "
                                            "the free disk less 1 GiB, whichever is smaller)")
                rel = _clean_name(member.name)
                if not rel:
                    continue
                _check_parent(dest_s, rel)
                parent, base = os.path.split(rel)
                target = os.path.join(dest_s, rel)
                if base == OPAQUE_MARKER:
                    pdir = os.path.join(dest_s, parent)
                    os.makedirs(pdir, exist_ok=True)
                    os.setxattr(pdir, OPAQUE_XATTR, b"y")
                    continue
                if base.startswith(WHITEOUT_PREFIX):
                    if base[len(WHITEOUT_PREFIX):] in ("", ".", ".."):  # `.wh...` would remove dest's parent
                        raise CorruptArchive(f"tar member {member.name!r} whites out no name (or '.'/'..')")
                    os.makedirs(os.path.join(dest_s, parent), exist_ok=True)
                    make_whiteout(os.path.join(dest_s, parent, base[len(WHITEOUT_PREFIX):]))
                    continue
                if (member.ischr() or member.isblk()) and (member.devmajor, member.devminor) != (0, 0):
                    # an image's device node would name a host device (the overlay a sandbox runs on
                    # opens it, the layer's nodev mount notwithstanding); a sandbox's /dev is its own
                    continue
                if member.islnk():
                    link = _clean_name(member.linkname)
                    _check_parent(dest_s, link + "/x")
                    member.linkname = link
                member.name = rel
                # lstat, never stat: a directory member over a symlink to a host directory would
                # otherwise be "already there" and tarfile would chmod/chown/utime through the link
                try:
                    here = os.lstat(target).st_mode
                except FileNotFoundError:
                    here = None
                if here is not None and not (member.isdir() and stat.S_ISDIR(here)):
                    remove_path(target)
                tf.extract(member, dest_s, set_attrs=True, numeric_owner=True, **_NO_TAR_FILTER)
    except tarfile.TarError as e:
        raise CorruptArchive(f"corrupt tar archive: {e}") from e
    except EOFError as e:
        raise CorruptArchive(f"truncated tar archive: {e}") from e
    except (KeyError, UnicodeError) as e:  # tarfile: a hard link to a member it cannot find; odd names
        raise CorruptArchive(f"corrupt tar archive: {e}") from e
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise QuotaExceeded(f"no space left extracting layer tar: {e}") from e
        raise CorruptArchive(f"tar member cannot be extracted ({e})") from e
    return count


@dataclass
class ArchiveLayer:
    name: str  # path of the layer inside the archive
    open: Callable[[], IO[bytes] | None]  # None: the member is not a regular file


@dataclass
class ImageArchive:
    tags: list[str]
    layers: list[ArchiveLayer]
    config: dict


def read_image_archive(path: Path) -> ImageArchive:
    """Parse a docker-save or OCI-layout tar and describe its (first) image."""
    try:
        outer = tarfile.open(str(path), mode="r:*")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise CorruptArchive(f"{path} is not a readable image archive ({e})") from e
    members = {_clean_name(m.name): m for m in outer.getmembers() if m.isfile()}

    def read_json(name: str) -> Any:  # JSON of unknown shape: every use checks what it needs
        if name not in members:
            raise CorruptArchive(f"{path}: {name} missing from image archive")
        try:
            f = outer.extractfile(members[name])  # members holds regular files only: never None
            assert f is not None
            return json.load(f)
        except (ValueError, tarfile.TarError) as e:
            raise CorruptArchive(f"{path}: {name} is not valid JSON ({e})") from e

    def opener(name: str):
        if name not in members:
            raise CorruptArchive(f"{path}: layer {name} missing from image archive")
        return lambda: outer.extractfile(members[name])

    if "manifest.json" in members:
        manifest = read_json("manifest.json")
        if not isinstance(manifest, list) or not manifest or "Layers" not in manifest[0]:
            raise CorruptArchive(f"{path}: manifest.json has no image with Layers")
        entry = manifest[0]
        config = read_json(_clean_name(entry["Config"])) if entry.get("Config") else {}
        layers = [ArchiveLayer(_clean_name(l), opener(_clean_name(l))) for l in entry["Layers"]]
        return ImageArchive(list(entry.get("RepoTags") or []), layers, config if isinstance(config, dict) else {})
    if "index.json" in members:
        index = read_json("index.json")
        try:
            desc = index["manifests"][0]
            blob = lambda d: "blobs/" + d.replace(":", "/", 1)  # noqa: E731
            manifest = read_json(blob(desc["digest"]))
            if "manifests" in manifest:  # nested index
                manifest = read_json(blob(manifest["manifests"][0]["digest"]))
            config = read_json(blob(manifest["config"]["digest"]))
            layers = [ArchiveLayer(blob(l["digest"]), opener(blob(l["digest"]))) for l in manifest["layers"]]
        except (KeyError, IndexError, TypeError) as e:
            raise CorruptArchive(f"{path}: OCI layout is missing {e}") from e
        ref = (desc.get("annotations") or {}).get("org.opencontainers.image.ref.name")
        return ImageArchive([ref] if ref else [], layers, config)
    raise CorruptArchive(f"{path}: neither manifest.json (docker save) nor index.json (OCI layout) found")


def iter_layer_members(archive: ImageArchive) -> Iterator[tuple[str, IO[bytes]]]:
    for layer in archive.layers:
        stream = layer.open()
        if stream is None:
            raise CorruptArchive(f"layer {layer.name} is not a regular file")
        yield layer.name, stream
