"""A command's `user` (ExecRequest/StartRequest.user) resolved in the sandbox's own /etc/passwd and
/etc/group, read through the confined files API.

The sandbox's files are the tenant's to edit: a name that resolves to uid 0 there runs as root, which
the tenant could do anyway (root is the default). What matters is that a command asked to run as a
non-root user cannot get root back; init enforces that (shoal_init.c, drop_to_user)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..core.errors import FileOpError, InvalidArgument

MAX_DB = 4 << 20  # bytes of /etc/passwd or /etc/group read at most


@dataclass(frozen=True)
class User:
    uid: int
    gid: int
    groups: list[int]
    name: str | None = None
    home: str | None = None

    def env(self) -> dict[str, str]:
        """HOME, USER and LOGNAME for a named user (the caller's env overrides them)."""
        if self.name is None:
            return {}
        return {"USER": self.name, "LOGNAME": self.name, **({"HOME": self.home} if self.home else {})}


def _read(read: Callable[[str, int], bytes], path: str) -> list[list[str]]:
    try:
        text = read(path, MAX_DB).decode("utf-8", "replace")
    except FileOpError:
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _id(v: str, what: str) -> int:
    if not v.isdigit() or int(v) >= 1 << 31:
        raise InvalidArgument(f"{what} must be a number in [0, 2^31), got {v!r}")
    return int(v)


def resolve(spec: str, read: Callable[[str, int], bytes]) -> User:
    """`spec`: a name in /etc/passwd, or `uid` / `uid:gid`. `read(path, max_bytes)` reads a sandbox file."""
    passwd = _read(read, "/etc/passwd")
    if spec[:1].isdigit():
        uid_s, _, gid_s = spec.partition(":")
        uid = _id(uid_s, "uid")
        row = next((r for r in passwd if len(r) >= 7 and r[2] == uid_s), None)
        gid = _id(gid_s, "gid") if gid_s else (_id(row[3], "gid") if row else uid)
        name, home = (row[0], row[5]) if row else (None, None)
    else:
        row = next((r for r in passwd if len(r) >= 7 and r[0] == spec), None)
        if row is None:
            raise InvalidArgument(f"no user {spec!r} in the sandbox's /etc/passwd")
        uid, gid, name, home = _id(row[2], "uid"), _id(row[3], "gid"), row[0], row[5]
    groups = {gid}
    if name is not None:
        for g in _read(read, "/etc/group"):
            if len(g) >= 4 and name in g[3].split(",") and g[2].isdigit() and int(g[2]) < 1 << 31:
                groups.add(int(g[2]))
    return User(uid=uid, gid=gid, groups=sorted(groups)[:64], name=name, home=home or None)
