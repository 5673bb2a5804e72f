"""pytest plugin for the run inside the VM (`-p pytest_vm`): what cannot run there is skipped, with the
reason in the report and in the junit xml, never dropped silently.

- The VM has no network: tests that build SWE environments (debootstrap + the package registries) skip.
- The fleet kind of the security matrix (3 shoald hosts in network namespaces, 2 gateways, PostgreSQL)
  skips: the image has no PostgreSQL, and what the fleet adds over a host (directory, placement, mTLS
  routing) does not depend on the kernel. Its hosts are shoald, which runs here as the `http` kind.
- Under TCG (software emulation, no usable KVM) the guest runs 10-30x slower than the host: assertions
  calibrated on native throughput skip there; they run under KVM.
"""
from __future__ import annotations

import os

import pytest

NEEDS_REGISTRIES_FIXTURES = {"swe_tasks", "few_tasks"}
NEEDS_REGISTRIES = {
    "tests/security/test_seccomp.py::test_common_runtimes_work_under_the_allowlist",  # ensure_python_base
}
NATIVE_SPEED = {
    # `yes` must push > 10 MB through the capped pipe in 3 s: ~6 MB is what TCG manages
    "tests/security/test_isolation.py::test_output_flood_keeps_host_memory_flat",
    # shoald's flood must reach 100 MiB in 60 s: ~56 MiB under TCG (its memory, fds and disk stayed flat)
    "tests/security/test_output_flood.py::test_yes_flood_keeps_daemon_memory_disk_and_latency_flat",
}


def pytest_collection_modifyitems(config, items):
    tcg = os.environ.get("SHOAL_VM_ACCEL") == "tcg"
    for item in items:
        base = item.nodeid.split("[")[0]
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend_kind") == "fleet":
            item.add_marker(pytest.mark.skip(reason="VM: the fleet kind needs PostgreSQL, which the VM image "
                                                    "lacks; its hosts are shoald, tested here as the http kind"))
        elif NEEDS_REGISTRIES_FIXTURES & set(getattr(item, "fixturenames", ())) or base in NEEDS_REGISTRIES:
            item.add_marker(pytest.mark.skip(reason="VM: needs the package registries (no network in the VM)"))
        elif tcg and base in NATIVE_SPEED:
            item.add_marker(pytest.mark.skip(reason="VM under TCG: throughput threshold calibrated for native speed"))
