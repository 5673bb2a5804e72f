"""The E2B front's shared parts: the backend it drives (any `SandboxBackend`, through the contract only),
keys, the sandbox index, templates, and the typed error the REST side answers with."""
from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..core.contract import SandboxBackend
from .ports import Starts
from .state import Boxes, Keys
from .templates import DEFAULT_TEMPLATES, HOME, USER


class ApiError(Exception):
    """An error of the REST control plane or envd's plain HTTP routes: status + `{code, message}`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def not_running(sandbox_id: str) -> ApiError:
    # the SDK tells "sandbox gone" from other 502s by the words "was not found"
    return ApiError(502, f"The sandbox {sandbox_id} was not found (killed, paused or timed out)")


@dataclass
class Front:
    backend: SandboxBackend
    keys: Keys
    templates: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_TEMPLATES))
    default_timeout: float = 300.0  # E2B's default sandbox lifetime, seconds
    user: str = USER
    home: str = HOME
    boxes: Boxes = field(default_factory=Boxes)
    starts: Starts = field(default_factory=Starts)  # templates' start commands (ports.py)
    # blocking waits of output streams (one per open Start/Connect/WatchDir stream): a pool of its own,
    # so long-lived streams never starve the request handlers' thread pool
    stream_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=256, thread_name_prefix="e2b-stream"))

    def close(self) -> None:
        for box in self.boxes.all():
            for proc in list(box.procs.values()):
                proc.handle.close()
            self.starts.forget(box.id)
        self.stream_pool.shutdown(wait=False, cancel_futures=True)
