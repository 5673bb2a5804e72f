"""Registry credentials: where they come from, and keeping them out of everything printed.

Order: explicit arguments, then SHOAL_REGISTRY_USER / SHOAL_REGISTRY_PASSWORD for the registries
SHOAL_REGISTRY_HOST names (host or host:port, comma- or space-separated; required with them: else
they went to every registry pulled from, a tenant's included), then the `auths`
entry for the registry in Docker's config (`$DOCKER_CONFIG/config.json`, else
`~/.docker/config.json`), so `docker login` is enough. Credential helpers (`credsStore`) are not
run. `Credentials` never shows its password: its repr is redacted and Shoal's messages name only
the registry and the user."""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import RegistryError


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    source: str = "argument"  # where they came from, for messages: "env", "docker config", "argument"

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, password=<redacted>, source={self.source!r})"

    __str__ = __repr__

    def basic(self) -> str:
        """The Authorization header value for basic auth."""
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()


def _docker_config_path() -> Path:
    base = os.environ.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"


def _auth_keys(registry: str) -> list[str]:
    """The keys `docker login` may have written for this registry."""
    keys = [registry, f"https://{registry}", f"http://{registry}", f"https://{registry}/v1/", f"https://{registry}/v2/"]
    if registry in ("registry-1.docker.io", "docker.io", "index.docker.io"):
        keys += ["https://index.docker.io/v1/", "index.docker.io", "docker.io"]
    return keys


def from_docker_config(registry: str, path: Path | None = None) -> Credentials | None:
    cfg_path = path or _docker_config_path()
    try:
        data = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RegistryError(f"cannot read Docker config {cfg_path}: {type(e).__name__}") from None
    auths = data.get("auths") if isinstance(data, dict) else None
    if not isinstance(auths, dict):
        return None
    for key in _auth_keys(registry):
        entry = auths.get(key)
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("auth"), str) and entry["auth"]:
            try:
                user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                raise RegistryError(f"{cfg_path}: the auth entry for {registry} is not base64 user:password") from None
            if sep:
                return Credentials(user, password, "docker config")
        if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
            return Credentials(entry["username"], entry["password"], "docker config")
    return None


def find_credentials(registry: str, username: str | None = None, password: str | None = None) -> Credentials | None:
    """Credentials for `registry` from the arguments, the environment or Docker's config; None: anonymous."""
    if username is not None and password is not None:
        return Credentials(username, password, "argument")
    env_user, env_pw = os.environ.get("SHOAL_REGISTRY_USER"), os.environ.get("SHOAL_REGISTRY_PASSWORD")
    if env_user and env_pw is not None:
        scope = os.environ.get(ENV_HOST, "").replace(",", " ").split()
        if not scope:
            raise RegistryError(f"SHOAL_REGISTRY_USER / SHOAL_REGISTRY_PASSWORD are set but not {ENV_HOST}: name the "
                                "registry (host or host:port, several separated by commas) they are for; they are "
                                "sent to no other")
        if _in_scope(registry, scope):
            return Credentials(env_user, env_pw, "env")
    return from_docker_config(registry)


ENV_HOST = "SHOAL_REGISTRY_HOST"


def _in_scope(registry: str, scope: list[str]) -> bool:
    """Whether `registry` is one of `scope`'s entries: "host" (any port) or "host:port"."""
    from ..lazy.trust import _host_port  # the same host/port split (IPv6, Docker Hub's aliases) as trust

    host, port = _host_port(registry)
    return any(h == host and (not p or p == port) for h, p in map(_host_port, scope))


# ----------------------------------------------------------------------------- WWW-Authenticate
_PARAM_RE = re.compile(r'(\w+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "basic" or "bearer"
    params: dict[str, str]


def parse_challenge(header: str) -> Challenge | None:
    """`Bearer realm="...",service="...",scope="..."` or `Basic realm="..."` -> Challenge."""
    header = header.strip()
    if not header:
        return None
    scheme, _, rest = header.partition(" ")
    params = {m.group(1).lower(): (m.group(2) if m.group(2) is not None else m.group(3))
              for m in _PARAM_RE.finditer(rest)}
    return Challenge(scheme.lower(), params)
