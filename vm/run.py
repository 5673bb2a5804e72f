"""`make test-vm`: the core functional and security subset inside a Debian 12 VM.

Boots Debian's stock 6.1 kernel under QEMU (KVM when /dev/kvm really runs a guest, TCG otherwise) with
systemd as PID 1 and the unified cgroup hierarchy, the shape of a Debian 12 / Ubuntu 22.04+ host:
cgroup v2 only, and no file-backed EROFS (6.1 < 6.12), so layers mount through loop devices.

    python vm/run.py                       # build the image once (cached), run the subset, record
    python vm/run.py --smoke               # boot, print kernel / cgroup facts, power off
    python vm/run.py -- tests/functional/test_layers.py -k loop   # another selection

The image (vm/build.sh) is cached under /var/cache/shoal-vm keyed by its inputs; each run copies the
current source tree (git's tracked and unignored files) into a fresh work disk that also carries the
results (junit xml, exit code) back. The guest's console streams here as it runs.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SHOAL_VM_CACHE", "/var/cache/shoal-vm"))
# the core functional and security subset: layers (loop path), sandbox lifecycle, limits, pause/resume,
# snapshot/fork, escape probes; every committed security suite runs (others add files there); density:
# reclaim through v2's memory.reclaim and memory.swap.max
# (tests that need the package registries, e.g. SWE environments, skip there with the reason: vm/pytest_vm.py)
SUBSET = ["tests/functional/test_layers.py", "tests/functional/test_cgroups.py",
          "tests/functional/test_sandbox.py", "tests/functional/test_snapshot_fork.py", "tests/security",
          "tests/badinput", "tests/density"]
NEEDED = {"qemu-system-x86_64": "qemu-system-x86", "debootstrap": "debootstrap", "mkfs.ext4": "e2fsprogs",
          "debugfs": "e2fsprogs", "git": "git"}


def say(msg: str) -> None:
    print(f"[test-vm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def check_tools() -> None:
    missing = sorted({pkg for tool, pkg in NEEDED.items() if not shutil.which(tool)})
    if missing:
        sys.exit(f"test-vm needs Debian packages: {' '.join(missing)} (`make test-vm` installs them)")
    if os.geteuid() != 0:
        sys.exit("test-vm needs root (debootstrap, chroot, mkfs of the images)")


def kvm_runs_guests(image: Path, wait_s: float = 20.0) -> bool:
    """True when /dev/kvm really runs this guest kernel: it must print its banner within `wait_s`.

    A nested host can expose a /dev/kvm that runs real-mode code (the boot stub prints) and then hangs
    for good once the kernel enters long mode; QEMU never says so. Under KVM the banner takes < 1 s."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    cmd = ["qemu-system-x86_64", "-accel", "kvm", "-cpu", "host", "-m", "256", "-display", "none",
           "-monitor", "none", "-serial", "stdio", "-no-reboot", "-nic", "none", "-kernel", str(image / "vmlinuz"),
           "-append", "console=ttyS0 earlyprintk=ttyS0 panic=-1"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = b""
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline and b"Linux version" not in seen:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
                if not chunk:
                    break
                seen += chunk
    finally:
        proc.kill()
        proc.wait()
    return b"Linux version" in seen


def build_image() -> Path:
    sys.path.insert(0, str(REPO / "src"))
    from shoal.envs.debian import host_debian_mirror  # the mirror the host's apt already uses

    say("VM image: building or reusing the cached one (first build ~6 min: debootstrap, kernel, initrd, venv)")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "vm/build.sh"), host_debian_mirror(), str(CACHE)],
                          check=False, stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, HOST_PYTHON=sys.executable))
    if proc.returncode != 0:
        sys.exit("vm/build.sh failed (its output is above)")
    image = Path(proc.stdout.strip().splitlines()[-1])
    say(f"VM image: {image} (kernel {(image / 'kernel-version').read_text().strip()}, "
        f"{time.monotonic() - t0:.0f}s)")
    return image


def make_work_disk(dest: Path, tests: list[str], smoke: bool, accel: str) -> Path:
    """An ext4 image holding the current source tree, the test selection and room for the results."""
    stage = dest / "stage"
    stage.mkdir()
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                           check=True, capture_output=True).stdout.split(b"\0")
    for rel in filter(None, files):
        src = REPO / os.fsdecode(rel)
        if not src.is_file():  # deleted in the work tree but still tracked
            continue
        out = stage / os.fsdecode(rel)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)
    (stage / ".vm-in").mkdir()
    (stage / ".vm-in/tests").write_text("\n".join(tests) + "\n")
    (stage / ".vm-in/mode").write_text("smoke\n" if smoke else "tests\n")
    (stage / ".vm-in/accel").write_text(accel + "\n")
    img = dest / "work.img"
    used_mb = int(subprocess.run(["du", "-sm", str(stage)], check=True, capture_output=True,
                                 text=True).stdout.split()[0])
    subprocess.run(["mkfs.ext4", "-q", "-L", "shoalwork", "-d", str(stage), str(img), f"{used_mb + 1024}M"],
                   check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(stage)
    return img


def read_from_disk(img: Path, path: str) -> str | None:
    """A file from the (unmounted) work disk, without mounting it: debugfs reads ext4 directly."""
    proc = subprocess.run(["debugfs", "-R", f"cat {path}", str(img)], check=False, capture_output=True)
    if proc.returncode != 0 or b"File not found" in proc.stderr:
        return None
    return proc.stdout.decode(errors="replace")


def boot(image: Path, work: Path, accel: str, timeout_s: int, log_path: Path, mem_mb: int,
         smp: int) -> tuple[int | None, bool]:
    """Run the VM to power-off; stream the guest's console. Returns (qemu exit code, saw guest output)."""
    cmdline = ("root=/dev/vda rw console=ttyS0 panic=-1 systemd.unified_cgroup_hierarchy=1 "
               "systemd.show_status=false loglevel=4")
    cmd = ["qemu-system-x86_64", "-accel", "kvm" if accel == "kvm" else "tcg,thread=multi",
           "-cpu", "host" if accel == "kvm" else "max", "-smp", str(smp), "-m", str(mem_mb),
           "-display", "none", "-monitor", "none", "-serial", "stdio", "-no-reboot", "-nic", "none",
           "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.img"), "-append", cmdline,
           # the cached root stays pristine: writes go to a throwaway overlay
           "-drive", f"file={image / 'rootfs.img'},format=raw,if=virtio,snapshot=on",
           "-drive", f"file={work},format=raw,if=virtio"]
    say(f"booting: {' '.join(cmd[:9])} ... (timeout {timeout_s}s)")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    in_guest = False  # kernel/systemd lines go to the log only; the test run's output is shown
    last_shown = t0
    last_line = ""
    buf = b""
    with open(log_path, "wb") as log:
        while True:
            now = time.monotonic()
            if now - t0 > timeout_s:
                proc.kill()
                proc.wait()
                say(f"TIMEOUT after {timeout_s}s: QEMU killed (console log: {log_path})")
                return None, in_guest
            if accel == "kvm" and not last_line and now - t0 > 60:
                proc.kill()
                proc.wait()
                say("KVM: no console output in 60s; this /dev/kvm does not run the guest")
                return None, False
            ready, _, _ = select.select([proc.stdout], [], [], 5.0)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
                if not chunk:
                    break
                log.write(chunk)
                log.flush()
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace").rstrip("\r")
                    if line.strip():
                        last_line = line
                    if "SHOAL-VM:" in line:
                        in_guest = True
                    if in_guest:
                        print(line, flush=True)
                        last_shown = time.monotonic()
            if time.monotonic() - last_shown > 30:  # a person waiting sees it is alive
                where = "tests running" if in_guest else f"booting; last console line: {last_line[-100:]!r}"
                say(f"{time.monotonic() - t0:.0f}s, {where}")
                last_shown = time.monotonic()
    return proc.wait(), in_guest


def junit_counts(xml: str) -> dict:
    root = ET.fromstring(xml)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed, skip_reasons = [], {}
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
        skip = case.find("skipped")
        if skip is not None:
            reason = skip.get("message", "").removeprefix("Skipped: ")
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
    counts["failed_tests"] = failed
    counts["skipped_reasons"] = skip_reasons
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="boot, print kernel and cgroup facts, power off")
    ap.add_argument("--accel", choices=["auto", "kvm", "tcg"], default=os.environ.get("SHOAL_VM_ACCEL", "auto"))
    ap.add_argument("--timeout", type=int, default=int(os.environ.get("SHOAL_VM_TIMEOUT", "3000")),
                    help="hard limit for the VM run, seconds")
    ap.add_argument("--mem", type=int, default=3072, help="guest memory, MiB")
    ap.add_argument("--smp", type=int, default=2)
    ap.add_argument("--record", type=Path, default=REPO / "docs/results/test_vm.json",
                    help="where the run's result and duration go (JSON); '' for nowhere")
    ap.add_argument("tests", nargs="*", help=f"pytest arguments inside the VM (default: {' '.join(SUBSET)})")
    args = ap.parse_args()
    check_tools()
    tests = args.tests or SUBSET
    t_start = time.monotonic()
    image = build_image()
    t_built = time.monotonic()
    accel = args.accel
    if accel == "auto":
        say("probing /dev/kvm with the guest kernel (up to 20 s)")
        accel = "kvm" if kvm_runs_guests(image) else "tcg"
        say(f"accelerator: {accel}" + ("" if accel == "kvm" else
                                       " (/dev/kvm missing, or it does not run this guest: software emulation)"))
    with tempfile.TemporaryDirectory(prefix="shoal-vm-") as tmp:
        tmpd = Path(tmp)
        log_path = Path(os.environ.get("SHOAL_VM_LOG", "/tmp/shoal-vm-console.log"))
        t_boot = time.monotonic()
        while True:
            work = make_work_disk(tmpd, tests, args.smoke, accel)
            code, reached = boot(image, work, accel, args.timeout, log_path, args.mem, args.smp)
            if accel == "kvm" and not reached and args.accel == "auto":
                say("falling back to TCG (software emulation)")
                accel = "tcg"
                work.unlink()
                t_boot = time.monotonic()
                continue
            break
        vm_s = time.monotonic() - t_boot
        rc_text = read_from_disk(work, "/.vm-out/rc")
        junit = read_from_disk(work, "/.vm-out/junit.xml")
        facts = read_from_disk(work, "/.vm-out/facts.json")
    if rc_text is None:
        say(f"the guest recorded no exit code (QEMU exit {code}); console log: {log_path}")
        return 2
    rc = int(rc_text.strip() or 2)
    result: dict = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    "host": {"kernel": os.uname().release, "nproc": os.cpu_count(),
                             "loadavg_at_end": os.getloadavg()[0]},
                    "accel": accel, "smp": args.smp, "mem_mb": args.mem,
                    "image_build_s": round(t_built - t_start, 1), "vm_run_s": round(vm_s, 1),
                    "total_s": round(time.monotonic() - t_start, 1), "exit_code": rc,
                    "selection": tests, "mode": "smoke" if args.smoke else "tests"}
    try:
        result["guest"] = json.loads(facts or "")
    except ValueError:
        say("the guest recorded no platform facts (see the console log)")
    if junit:
        result.update(junit_counts(junit))
    say(f"VM run {vm_s:.0f}s ({accel}), guest exit code {rc}" +
        (f": {result['passed']} passed, {result['failures'] + result['errors']} failed, "
         f"{result['skipped']} skipped" if junit else ""))
    if junit:  # the plain closing line CI reads
        print(f"test-vm: {result['passed']} passed, {result['failures'] + result['errors']} failed, "
              f"{result['skipped']} skipped", flush=True)
    if args.record and str(args.record) and not args.smoke and not args.tests:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(result, indent=1) + "\n")
        say(f"recorded in {args.record}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
