#!/usr/bin/env python3
"""A registry behind a shaped link, for bench/lazy.py: the same registry storage served from its own
network namespace, reached over a veth pair whose both ends are rate-limited in the kernel (TBF),
with a fixed round-trip time added by a small TCP relay in the namespace.

    host  ── veth (TBF rate, both directions) ──  netns: relay (+RTT on requests) ── docker-registry

Both Shoal and Docker pull from the namespace address (`ShapedRegistry.addr`, plain HTTP; Docker gets
it as an insecure registry), so both pay the same link.

Why a relay for the delay: this kernel has no netem (CONFIG_NET_SCH_NETEM is not set, nor fq for
EDT pacing), so the kernel can shape the rate (TBF) but not add latency. The relay delays every
segment from the client by one RTT, without serialising them (a timestamped queue), so each
request/response costs one more RTT and bulk transfers stay at the link's rate. (TCP's own ACK
clock does not see the delay; at 1 Gbit/s x 1 ms the window is never the limit.)
It is a user-space process, so it also costs CPU: the same for both sides.

    python bench/netlink.py relay LISTEN_HOST:PORT TARGET_HOST:PORT DELAY_MS   (run in the namespace)
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

NS = "shoal-lazynet"
HOST_IF, NS_IF = "shl-lz0", "shl-lz1"
SUBNET = "10.231.77"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


class ShapedLink:
    """The namespace and the veth pair, TBF-shaped at `rate_mbit` in both directions."""

    def __init__(self, rate_mbit: int = 1000, rtt_ms: float = 1.0):
        self.rate_mbit, self.rtt_ms = rate_mbit, rtt_ms
        self.host_ip, self.ns_ip = f"{SUBNET}.1", f"{SUBNET}.2"

    def up(self) -> None:
        self.down()
        _run("ip", "netns", "add", NS)
        _run("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _run("ip", "link", "set", NS_IF, "netns", NS)
        _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", HOST_IF)
        _run("ip", "link", "set", HOST_IF, "up")
        _run("ip", "-n", NS, "addr", "add", f"{self.ns_ip}/24", "dev", NS_IF)
        _run("ip", "-n", NS, "link", "set", NS_IF, "up")
        _run("ip", "-n", NS, "link", "set", "lo", "up")
        # burst: a few ms at the rate (at least one 64 KiB GSO segment); latency bounds the queue
        burst = max(128 << 10, self.rate_mbit * 125 * 2)  # bytes in ~2 ms
        for prefix in ((), ("ip", "netns", "exec", NS)):
            dev = NS_IF if prefix else HOST_IF
            _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                 "burst", str(burst), "latency", "100ms")

    def describe(self) -> str:
        return (f"veth pair into a network namespace, TBF {self.rate_mbit} Mbit/s each way, "
                f"+{self.rtt_ms:g} ms RTT added by a relay (no netem in this kernel)")

    def down(self) -> None:
        _run("ip", "link", "del", HOST_IF, check=False)
        _run("ip", "netns", "del", NS, check=False)


def shaped_registry(share, link: ShapedLink, port: int = 5000):
    """A RegistryServer on `share`'s storage, in the namespace behind `link` (started)."""
    from registryctl import RegistryServer

    class _Shaped(RegistryServer):
        def __init__(self) -> None:
            self.inner = f"127.0.0.1:{port + 1}"  # the registry listens here, in the namespace
            self.outer = f"{link.ns_ip}:{port}"  # the relay, in front of it, on the veth
            self.relay: subprocess.Popen | None = None
            super().__init__(share=share, workdir=Path("/var/tmp"))  # writes the config, starts
            self.addr, self.port = self.outer, port

        def _write_config(self) -> None:
            addr = self.addr
            self.addr = self.inner
            super()._write_config()
            self.addr = addr

        def start(self, timeout: float = 20.0) -> None:
            import httpx

            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(["ip", "netns", "exec", NS, "/usr/bin/docker-registry", "serve",
                                              str(self.dir / "config.yml")], stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            self.relay = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, __file__, "relay", self.outer,
                                           self.inner, str(link.rtt_ms)], start_new_session=True)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    if httpx.get(f"http://{self.outer}/v2/", timeout=1).status_code in (200, 401):
                        return
                except httpx.HTTPError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"shaped registry did not start: {self.log.read_text()[-2000:]}")
                time.sleep(0.05)

        def close(self, remove: bool = True) -> None:
            if self.relay is not None and self.relay.poll() is None:
                self.relay.terminate()
                self.relay.wait(10)
            self.relay = None
            super().close(remove=False)  # the storage is `share`'s
            if remove:
                shutil.rmtree(self.dir, ignore_errors=True)

    return _Shaped()


# ------------------------------------------------------------------------------------------ relay
async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Forward reader -> writer, each segment `delay_s` after it arrived (queued, not serialised)."""
    q: asyncio.Queue = asyncio.Queue()

    async def sender() -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await q.get()
            if data is None:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    task = asyncio.create_task(sender())
    loop = asyncio.get_running_loop()
    try:
        while data := await reader.read(256 << 10):
            q.put_nowait((loop.time() + delay_s, data))
    except (ConnectionError, OSError):
        pass
    q.put_nowait((0.0, None))
    try:
        await task
    except (ConnectionError, OSError):
        pass


async def _relay(listen: str, target: str, delay_ms: float) -> None:
    th, tp = target.rsplit(":", 1)
    delay = delay_ms / 1000

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(th, int(tp))
        except OSError:
            cw.close()
            return
        # the whole RTT on the way in: one timer per request instead of two (asyncio's timers round to
        # whole milliseconds: two half-RTT waits would add ~2 ms)
        await asyncio.gather(_pump(cr, uw, delay), _pump(ur, cw, 0.0))

    lh, lp = listen.rsplit(":", 1)
    srv = await asyncio.start_server(handle, lh, int(lp), limit=1 << 20)
    async with srv:
        await srv.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "relay":
        os.setpgrp() if os.getpgrp() != os.getpid() else None
        asyncio.run(_relay(sys.argv[2], sys.argv[3], float(sys.argv[4])))
    else:
        sys.exit(__doc__)
