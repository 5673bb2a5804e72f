"""Per-sandbox egress: default no network; allow rules via veth + nftables inside the sandbox.

A sandbox starts with only `lo`. The first time egress rules are set, a veth pair joins it to the
host (host side `sb<hash>`, sandbox side `eth0`, a /30 out of 10.201.0.0/16, default route via
the host side) and the host masquerades that range for traffic leaving the host. The filter lives
in the sandbox's own network namespace (`table inet shoal_egress`): output policy drop, then
`lo`, established replies and the allow rules; inbound only replies. Root in the sandbox lacks
CAP_NET_ADMIN, so it cannot change those rules.

Updates **replace** the whole rule set: fields left out are cleared (E2B-style), never merged.
Rules: "CIDR", "IP", "IP:port", "host:port" (resolved by the host when the rules are set) and named
presets (`{"pypi": true}`) that map to addresses configured in `egress_presets` of the config file.
"""
from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import json
import os
import socket
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import InvalidArgument, SandboxError

POOL = ipaddress.ip_network("10.201.0.0/16")


@dataclass(frozen=True)
class EgressRule:
    net: ipaddress.IPv4Network | ipaddress.IPv6Network
    port: int | None = None

    def nft(self) -> str:
        fam = "ip" if self.net.version == 4 else "ip6"
        ports = f" meta l4proto {{ tcp, udp }} th dport {self.port}" if self.port else ""
        return f"{fam} daddr {self.net}{ports} accept"

    def __str__(self) -> str:
        return f"{self.net}" + (f":{self.port}" if self.port else "")


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6]:port
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if entry.count(":") == 1:
        host, port = entry.split(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"egress rule {entry!r}: bad port {port!r}")
        return host, int(port)
    return entry, None


def parse_rules(allow: list[str], presets: dict[str, bool] | None = None,
                preset_table: dict[str, list[str]] | None = None) -> list[EgressRule]:
    entries = list(allow or [])
    for name, on in (presets or {}).items():
        if not on:
            continue
        if not preset_table or name not in preset_table:
            raise InvalidArgument(f"egress preset {name!r} is not configured (egress_presets in the config file)")
        entries += preset_table[name]
    rules: list[EgressRule] = []
    for entry in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise InvalidArgument(f"egress rule {entry!r} is not a CIDR, IP, IP:port or host:port")
        host, port = _split_port(entry.strip())
        try:
            rules.append(EgressRule(ipaddress.ip_network(host, strict=False), port))
            continue
        except ValueError:
            pass
        if port is None:
            raise InvalidArgument(f"egress rule {entry!r}: a host name needs a port (host:port)")
        try:
            infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
        except socket.gaierror as e:
            raise InvalidArgument(f"egress rule {entry!r}: cannot resolve {host}: {e}") from None
        for addr in sorted({i[4][0] for i in infos}):
            rules.append(EgressRule(ipaddress.ip_network(addr), port))
    return rules


def _run(cmd: list[str], input: str | None = None) -> None:
    r = subprocess.run(cmd, input=input, capture_output=True, text=True)
    if r.returncode != 0:
        raise SandboxError(f"{' '.join(cmd[:6])}: {r.stderr.strip()[:500]}")


# Address allocations are per host (all Shoal roots share the 10.201.0.0/16 pool and the host's
# interface names), so they live in /run, which a reboot clears along with the interfaces.
HOST_STATE_DIR = Path("/run/shoal/net")


class EgressManager:
    def __init__(self, state_dir: Path = HOST_STATE_DIR):
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self._alloc = state_dir / "alloc.json"

    @contextmanager
    def _locked(self):
        fd = os.open(self.state_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _subnet(self, sandbox_id: str) -> ipaddress.IPv4Network:
        """A /30 for this sandbox; slots whose host-side veth is gone (its sandbox ended) are reused.
        The pool is per host, shared by every Shoal root on it, so liveness is read from the kernel."""
        alloc = json.loads(self._alloc.read_text()) if self._alloc.exists() else {}
        alloc = {k: v for k, v in alloc.items()
                 if k == sandbox_id or os.path.exists(f"/sys/class/net/{self.host_ifname(k)}")}
        if sandbox_id not in alloc:
            used = set(alloc.values())
            slot = next(i for i in range(1, POOL.num_addresses // 4) if i not in used)
            alloc[sandbox_id] = slot
        self._alloc.write_text(json.dumps(alloc))
        return ipaddress.IPv4Network((int(POOL.network_address) + 4 * alloc[sandbox_id], 30))

    @staticmethod
    def host_ifname(sandbox_id: str) -> str:
        return "sb" + hashlib.sha256(sandbox_id.encode()).hexdigest()[:12]

    def _netns(self, init_pid: int) -> list[str]:
        return ["nsenter", f"--net=/proc/{init_pid}/ns/net"]

    def attached(self, init_pid: int) -> bool:
        r = subprocess.run(self._netns(init_pid) + ["ip", "-o", "link", "show", "eth0"], capture_output=True)
        return r.returncode == 0

    def attach(self, sandbox_id: str, init_pid: int) -> ipaddress.IPv4Network:
        with self._locked():
            net = self._subnet(sandbox_id)
            if self.attached(init_pid):
                return net
            hostif = self.host_ifname(sandbox_id)
            peer = hostif[:13] + "p"
            host_ip, sb_ip = list(net.hosts())
            subprocess.run(["ip", "link", "del", hostif], capture_output=True)  # a stale one from a crash
            _run(["ip", "link", "add", hostif, "type", "veth", "peer", "name", peer])
            _run(["ip", "link", "set", peer, "netns", str(init_pid)])
            _run(["ip", "addr", "add", f"{host_ip}/30", "dev", hostif])
            _run(["ip", "link", "set", hostif, "up"])
            ns = self._netns(init_pid)
            _run(ns + ["ip", "link", "set", peer, "name", "eth0"])
            _run(ns + ["ip", "addr", "add", f"{sb_ip}/30", "dev", "eth0"])
            _run(ns + ["ip", "link", "set", "eth0", "up"])
            _run(ns + ["ip", "route", "add", "default", "via", str(host_ip)])
            self._host_nat()
            return net

    def _host_nat(self) -> None:
        """Masquerade the sandbox range when it leaves the host (idempotent)."""
        _run(["nft", "-f", "-"], input=(
            "table ip shoal_nat {\n"
            "  chain post { type nat hook postrouting priority 100; policy accept;\n"
            f"    ip saddr {POOL} oifname != \"sb*\" masquerade\n"
            "  }\n}\n"))
        try:
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        except OSError:
            pass

    def apply(self, init_pid: int, rules: list[EgressRule]) -> None:
        """Replace the sandbox's egress filter with exactly `rules`."""
        body = "\n".join(f"    {r.nft()}" for r in rules)
        script = (
            "table inet shoal_egress\ndelete table inet shoal_egress\n"
            "table inet shoal_egress {\n"
            "  chain out { type filter hook output priority 0; policy drop;\n"
            "    oifname \"lo\" accept\n    ct state established,related accept\n"
            f"{body}\n  }}\n"
            "  chain in { type filter hook input priority 0; policy drop;\n"
            "    iifname \"lo\" accept\n    ct state established,related accept\n  }\n}\n")
        _run(self._netns(init_pid) + ["nft", "-f", "-"], input=script)
