"""A real PostgreSQL server for tests, from Debian's `postgresql` package: initdb + pg_ctl in a temp
dir, run as the `postgres` user (initdb refuses root), listening on a private Unix socket directory
and a loopback port. `make test` installs the package; nothing here touches a system cluster."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self) -> None:
        bindir = pg_bin()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed: `make test` installs Debian's postgresql")
        self.bin = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="shoal-pg-"))
        self.data, self.sock = self.dir / "data", self.dir / "sock"
        self.sock.mkdir()
        pw = pwd.getpwnam("postgres")
        for p in (self.dir, self.sock):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        self.port = _free_port()
        self.listen = ["127.0.0.1"]  # addresses it accepts TCP on (tests/fleet adds its bridge's)
        self._as_postgres([str(self.bin / "initdb"), "-D", str(self.data), "-U", "shoal", "--auth=trust",
                           "--no-sync", "-E", "UTF8"])
        self.start()

    def _as_postgres(self, argv: list[str]) -> None:
        r = subprocess.run(["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", *argv],
                           capture_output=True, text=True, cwd=str(self.dir), timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")

    def start(self) -> None:
        opts = (f"-k {self.sock} -p {self.port} -c listen_addresses={','.join(self.listen)} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l",
                           str(self.dir / "server.log"), "-w", "-t", "60", "start"])

    def stop(self, mode: str = "fast") -> None:
        self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])

    def restart(self) -> None:
        self.stop()
        self.start()

    def allow_network(self, address: str, cidr: str) -> None:
        """Also listen on `address` and trust clients from `cidr` (the fleet tests' hosts, in their
        own network namespaces); restarts the server when that changes anything."""
        if address in self.listen:
            return
        with open(self.data / "pg_hba.conf", "a") as f:
            f.write(f"host all all {cidr} trust\n")
        self.listen.append(address)
        self.restart()

    def dsn(self, db: str = "postgres", address: str = "127.0.0.1") -> str:
        return f"postgresql://shoal@{address}:{self.port}/{db}"

    def new_database(self) -> str:
        """A fresh, empty database; its DSN."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.dsn(), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
