#!/bin/bash
# Runs inside the VM (from the work disk, mounted at /shoal): records the platform's facts, then the
# test selection that vm/run.py wrote to /shoal/.vm-in/tests. Output goes to the serial console.
set -u
OUT=/shoal/.vm-out
cd /shoal
cg_fs=$(stat -fc %T /sys/fs/cgroup)
echo "SHOAL-VM: kernel $(uname -r), /sys/fs/cgroup is $cg_fs, controllers: $(cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null)"
echo "SHOAL-VM: this process's cgroup: $(cat /proc/self/cgroup)"
echo "SHOAL-VM: $(systemctl --version | head -1), $(nproc) CPUs, $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) MiB"
PYTHONPATH=/shoal/src /opt/shoal-venv/bin/python - > "$OUT/facts.json" <<'PY'
import errno, json, os, platform, subprocess, tempfile
from pathlib import Path
from shoal.layers import erofs
# what this kernel answers to a file-backed EROFS mount (the new mount API with a file as source)
with tempfile.TemporaryDirectory() as t:
    (Path(t) / "src").mkdir(); (Path(t) / "mnt").mkdir()
    erofs.build_image(Path(t) / "src", Path(t) / "img")
    try:
        erofs.mount_file_backed(Path(t) / "img", Path(t) / "mnt")
        erofs.unmount(Path(t) / "mnt")
        file_backed = "supported"
    except OSError as e:
        file_backed = f"refused: {errno.errorcode.get(e.errno, e.errno)} ({e})"
cg = open("/proc/self/cgroup").read().strip()
print(json.dumps({
    "kernel": platform.release(),
    "cgroup_fs": subprocess.run(["stat", "-fc", "%T", "/sys/fs/cgroup"], capture_output=True, text=True).stdout.strip(),
    "cgroup_controllers": open("/sys/fs/cgroup/cgroup.controllers").read().split(),
    "test_process_cgroup": cg,
    "init": os.readlink("/proc/1/exe"),
    "systemd": subprocess.run(["systemctl", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
    "python": platform.python_version(),
    "nproc": os.cpu_count(),
    "file_backed_erofs": file_backed,
}))
PY
echo "SHOAL-VM: file-backed EROFS: $(/opt/shoal-venv/bin/python -c 'import json; print(json.load(open("/shoal/.vm-out/facts.json"))["file_backed_erofs"])')"
if [ "$(cat /shoal/.vm-in/mode)" = smoke ]; then
  [ "$cg_fs" = cgroup2fs ] || { echo "SHOAL-VM: expected the unified cgroup hierarchy"; exit 1; }
  echo "SHOAL-VM: smoke check passed"
  exit 0
fi
# the kernel's own console lines (OOM kills the tests provoke) would interleave with pytest's; dmesg keeps them
dmesg -n 1
mapfile -t sel < /shoal/.vm-in/tests
echo "SHOAL-VM: pytest ${sel[*]}"
# SHOAL_VM_ACCEL: what vm/pytest_vm.py skips under TCG; shoald's start is slow under emulation
export SHOAL_VM_ACCEL="$(cat /shoal/.vm-in/accel)" SHOAL_TEST_DAEMON_START_S=240
# the tree is copied as source: build the C helper the way `make setup` does (never at run time)
PYTHONPATH=/shoal/src /opt/shoal-venv/bin/python -m shoal.backends.container.native build
PYTHONPATH=/shoal/src:/shoal/vm /opt/shoal-venv/bin/python -m pytest -v -rs --color=no -p no:cacheprovider \
  -p pytest_vm --durations=15 --junitxml="$OUT/junit.xml" "${sel[@]}"
