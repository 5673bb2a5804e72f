"""The session protocol every local backend shares: one command written to a long-lived shell,
its output read up to two random end markers.

Each command is sent as `command eval '<cmd>'` followed by a random end marker on each stream, so
a syntax error in one command cannot kill the shell, and output that merely looks like a marker
cannot end it early (the nonce is new per command); stdin of the command is /dev/null. How the
bytes reach the shell and come back (init's pipes, `runsc exec`'s) is the backend's business.
"""
from __future__ import annotations

import re
import secrets
import time

from ..core.contract import ExecResult
from .container.initclient import CappedBuffer


class MarkedCommand:
    """One session command: the script to write, and the parse of what the shell writes back."""

    def __init__(self, cmd: str, output_cap: int):
        nonce = secrets.token_hex(8)
        quoted = "'" + cmd.replace("'", "'\\''") + "'"
        self.script = (f"command eval {quoted} </dev/null\n__shoal_rc=$?\n"
                       f"printf '__SHOAL_{nonce}_%d__\\n' \"$__shoal_rc\"\nprintf '__SHOAL_{nonce}__\\n' >&2\n"
                       ).encode("utf-8", "surrogateescape")
        self._out_marker = re.compile(rb"__SHOAL_" + nonce.encode() + rb"_(\d+)__\n")
        self._err_marker = b"__SHOAL_" + nonce.encode() + b"__\n"
        self._marker_len = len(b"__SHOAL_") + len(nonce) + len(b"_") + len(b"__\n")
        self._bufs = {"out": CappedBuffer(output_cap), "err": CappedBuffer(output_cap)}
        self._wins = {"out": b"", "err": b""}  # the tail of each stream, where a marker may straddle reads
        self.rc: int | None = None
        self._err_done = False
        self.started = time.monotonic()

    def feed(self, stream: str, data: bytes) -> None:
        """Bytes the shell wrote on `stream` ("out" or "err")."""
        self._bufs[stream].add(data)
        self._wins[stream] = (self._wins[stream] + data)[-256:]
        if stream == "out":
            if self.rc is None and (m := self._out_marker.search(self._wins["out"])):
                self.rc = int(m.group(1))
        elif self._err_marker in self._wins["err"]:
            self._err_done = True

    @property
    def done(self) -> bool:
        return self.rc is not None and self._err_done

    def result(self, timed_out: bool) -> ExecResult:
        """The command's result, markers removed; a timed-out command reads as killed by SIGKILL."""
        out, err = self._bufs["out"], self._bufs["err"]
        stdout = self._out_marker.sub(b"", out.value(), count=1)
        stderr = err.value().replace(self._err_marker, b"", 1)
        return ExecResult(
            exit_code=137 if timed_out or self.rc is None else self.rc, signal=9 if timed_out else None,
            timed_out=timed_out, stdout=stdout.decode("utf-8", "replace"), stderr=stderr.decode("utf-8", "replace"),
            # what the command wrote: the markers the shell added (when it got to them) do not count
            stdout_bytes=out.total - (self._marker_len + len(str(self.rc)) if self.rc is not None else 0),
            stderr_bytes=err.total - (len(self._err_marker) if self._err_done else 0),
            stdout_truncated=out.truncated, stderr_truncated=err.truncated,
            duration_s=time.monotonic() - self.started)
