"""PostgreSQL connections for fleet-wide state (the episode queue; the trajectory log), psycopg 3.

One connection per thread and process, like `core.sqlite.PerThreadDB`: psycopg connections are
thread-safe but serialize their statements, and must never cross a fork. A connection that broke
(the server restarted) is replaced on the next use, waiting up to RECONNECT_S for the server. A
statement that was cut off by the break is never re-sent here (it may have committed): it raises
`DatabaseUnavailable`, and the caller decides (a claim's lease simply runs out).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from .errors import DatabaseUnavailable, InvalidArgument
from .sqlite import is_postgres_url

try:
    import psycopg
except ImportError as e:  # an extra: the SDK, CLI and daemon do not need it
    raise ImportError("PostgreSQL state needs psycopg: pip install 'shoal[rollout]'") from e

RECONNECT_S = 30.0  # how long a caller waits for a restarting server before giving up


def is_dsn(where: str | os.PathLike) -> bool:
    """Whether a state location names a PostgreSQL database (else it is an SQLite file path)."""
    return is_postgres_url(where)


def redact(dsn: str) -> str:
    """The DSN without its password, for messages and logs."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "postgresql://<unparseable>"
    host, db, user = (str(info.get(k, "")) for k in ("host", "dbname", "user"))
    return f"postgresql://{user + '@' if user else ''}{host}/{db}"


class PerThreadPG:
    def __init__(self, dsn: str):
        if not is_dsn(dsn):
            raise InvalidArgument(f"not a PostgreSQL URL: {redact(dsn)!r}")
        self.dsn = dsn
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"PerThreadPG({redact(self.dsn)})"

    def _connect(self) -> psycopg.Connection:
        deadline = time.monotonic() + RECONNECT_S
        while True:
            try:
                return psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
            except psycopg.OperationalError as e:
                if time.monotonic() > deadline:
                    raise DatabaseUnavailable(f"PostgreSQL at {redact(self.dsn)} does not answer: "
                                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
                time.sleep(0.2)

    def get(self) -> psycopg.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken or getattr(self._local, "pid", None) != os.getpid():
            conn = self._local.conn = self._connect()
            self._local.pid = os.getpid()
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            with contextlib.suppress(Exception):
                conn.close()

    def _lost(self, e: psycopg.OperationalError) -> DatabaseUnavailable:
        self._drop()
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return DatabaseUnavailable(f"lost PostgreSQL at {redact(self.dsn)} mid-statement: {first}")

    def execute(self, sql: str, args: Any = None) -> psycopg.Cursor:
        """One autocommitted statement. A read (SELECT) that finds the connection gone (the server
        restarted since this thread last used it) is sent again on a new one; a write is not."""
        try:
            return self.get().execute(sql, args)
        except psycopg.OperationalError as e:
            if not sql.lstrip()[:6].upper() == "SELECT":
                raise self._lost(e) from None
            self._drop()
        try:
            return self.get().execute(sql, args)
        except psycopg.OperationalError as e:
            raise self._lost(e) from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        """A transaction on this thread's connection: committed at the end of the block, rolled back
        if it raises. If BEGIN itself fails (the connection died while idle), nothing was sent: it
        is retried once on a new connection."""
        for attempt in (1, 2):
            conn = self.get()
            try:
                tx = conn.transaction()
                tx.__enter__()
            except psycopg.OperationalError as e:
                if attempt == 2:
                    raise self._lost(e) from None
                self._drop()
                continue
            break
        try:
            yield conn
        except BaseException as exc:
            try:
                tx.__exit__(type(exc), exc, exc.__traceback__)
            except psycopg.OperationalError as e:
                raise self._lost(e) from None
            if isinstance(exc, psycopg.OperationalError):
                raise self._lost(exc) from None
            raise
        try:
            tx.__exit__(None, None, None)
        except psycopg.OperationalError as e:
            raise self._lost(e) from None

    def close(self) -> None:
        self._drop()
