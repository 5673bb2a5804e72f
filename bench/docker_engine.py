"""A private Docker engine for the benchmarks: Debian's dockerd on its own socket and data root.

Each benchmark starts its own, so it neither shares nor stops an engine someone else runs on this
host, and tears it down (containers, mounts, data) when done."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

from shoal.backends.container.cgroups import CGROUP_ROOT


class PrivateDockerd:
    """`up()` starts dockerd on `unix://<tmp>/docker.sock`; `env()` is the environment that reaches it.

    cgroup_parent: the containers' cgroup parent (a benchmark may sample its memory); removed on `down()`
    once empty. export: also set DOCKER_HOST in this process, for code that runs `docker` without `env()`."""

    def __init__(self, prefix: str = "shoal-dockerd-", cgroup_parent: str | None = None, export: bool = False,
                 insecure_registries: tuple[str, ...] = ()):
        self.prefix, self.cgroup_parent, self.export = prefix, cgroup_parent, export
        self.insecure_registries = insecure_registries  # plain-HTTP registries beyond 127.0.0.0/8
        self.proc: subprocess.Popen | None = None
        self.tmp: str | None = None
        self.host: str | None = None
        self.error = ""

    def env(self) -> dict:
        return dict(os.environ, DOCKER_HOST=self.host) if self.host else dict(os.environ)

    def up(self) -> bool:
        if not shutil.which("docker") or not shutil.which("dockerd"):
            self.error = "docker / dockerd not installed (make docker-engine)"
            return False
        self.tmp = tempfile.mkdtemp(prefix=self.prefix)
        self.host = f"unix://{self.tmp}/docker.sock"
        if self.export:
            os.environ["DOCKER_HOST"] = self.host
        cmd = ["dockerd", "--iptables=false", "--bridge=none", "--data-root", os.path.join(self.tmp, "data"),
               "--exec-root", os.path.join(self.tmp, "exec"), "--pidfile", os.path.join(self.tmp, "docker.pid"),
               "-H", self.host]
        if self.cgroup_parent:
            cmd.append(f"--cgroup-parent=/{self.cgroup_parent}")
        runsc = shutil.which("runsc")
        config: dict = {}
        if runsc:  # Docker's way to gVisor (`docker run --runtime=runsc`), the peer of Shoal's gvisor backend:
            # the flags Shoal's backend passes too (no network stack, ptrace platform)
            config["runtimes"] = {"runsc": {"path": runsc, "runtimeArgs": ["--network=none", "--platform=ptrace"]}}
        if self.insecure_registries:
            config["insecure-registries"] = list(self.insecure_registries)
        if config:
            conf = os.path.join(self.tmp, "daemon.json")
            with open(conf, "w") as f:
                json.dump(config, f)
            cmd.append(f"--config-file={conf}")
        with open(os.path.join(self.tmp, "dockerd.log"), "w") as log:  # dockerd keeps its own copy of the fd
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        for _ in range(300):
            if subprocess.run(["docker", "info"], capture_output=True, env=self.env(), check=False).returncode == 0:
                return True
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.error = f"dockerd did not start; see {self.tmp}/dockerd.log"
        return False

    def down(self) -> None:
        if not self.proc or not self.tmp:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        subprocess.run(["umount", "-R", os.path.join(self.tmp, "data")], capture_output=True, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.cgroup_parent:
            for d in CGROUP_ROOT.glob(f"*/{self.cgroup_parent}"):  # the empty parent, per v1 controller
                try:
                    d.rmdir()
                except OSError:
                    pass
            try:
                (CGROUP_ROOT / self.cgroup_parent).rmdir()  # v2
            except OSError:
                pass
        self.proc = None
