"""Parsing `REGISTRY/REPO:TAG` (or `@sha256:...`) the way Docker does, so the same strings work.

A first component with a dot or a colon, or `localhost`, names the registry; otherwise the image
is on Docker Hub (`python:3.11` -> `registry-1.docker.io/library/python:3.11`)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.errors import InvalidArgument

DOCKER_HUB = "registry-1.docker.io"
_REPO_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port]
    repository: str  # e.g. library/python
    tag: str | None = None
    digest: str | None = None  # sha256:<hex>; wins over the tag when both are given

    @property
    def reference(self) -> str:
        """What goes after /manifests/: the digest if pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def with_reference(self, ref: str) -> Reference:
        """The same repository at another tag or digest."""
        if _DIGEST_RE.match(ref):
            return Reference(self.registry, self.repository, self.tag, ref)
        return Reference(self.registry, self.repository, ref, None)

    def local_ref(self) -> str:
        """A Shoal image name for it: the repository path and the tag (a digest gives its first 12 hex)."""
        tag = self.tag or (self.digest.split(":", 1)[1][:12] if self.digest else "latest")
        return f"{self.repository}:{tag}"

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out


def parse_reference(text: str) -> Reference:
    """`[REGISTRY/]REPO[:TAG][@sha256:HEX]` -> Reference (InvalidArgument naming what is wrong)."""
    s = text.strip()
    for scheme in ("oci://", "docker://", "https://"):
        s = s.removeprefix(scheme)
    if not s:
        raise InvalidArgument("empty image reference: expected REGISTRY/REPO:TAG")
    digest = None
    if "@" in s:
        s, digest = s.split("@", 1)
        if not _DIGEST_RE.match(digest):
            raise InvalidArgument(f"{text!r}: the digest must be sha256:<64 hex>")
    first, _, rest = s.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = DOCKER_HUB, s
    if registry in ("docker.io", "index.docker.io"):
        registry = DOCKER_HUB
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG_RE.match(tag):
            raise InvalidArgument(f"{text!r}: bad tag {tag!r}")
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if not _REPO_RE.match(path):
        raise InvalidArgument(f"{text!r}: bad repository name {path!r} (lowercase letters, digits, . _ - /)")
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, path, tag, digest)
