"""Where interrupted blob uploads stand, so the next push resumes them instead of starting over.

One small JSON file per (registry, repository, blob digest), holding the upload's location URL as
the registry last returned it. The registry, not this file, says how far the upload got (a GET on
the location answers `Range: 0-<last byte>`); a location the registry no longer knows is dropped.
Locations carry the registry's upload state, never credentials."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

MAX_AGE_S = 7 * 24 * 3600  # registries purge abandoned uploads after about a week


class UploadSessions:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)

    def _path(self, key: tuple[str, str, str]) -> Path:
        return self.dir / (hashlib.sha256("|".join(key).encode()).hexdigest()[:32] + ".json")

    def load(self, key: tuple[str, str, str]) -> str | None:
        p = self._path(key)
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("key") != list(key) or time.time() - p.stat().st_mtime > MAX_AGE_S:
            return None
        loc = data.get("location")
        return loc if isinstance(loc, str) else None

    def save(self, key: tuple[str, str, str], location: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        p = self._path(key)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": list(key), "location": location}, f)
        os.replace(tmp, p)

    def drop(self, key: tuple[str, str, str]) -> None:
        self._path(key).unlink(missing_ok=True)
