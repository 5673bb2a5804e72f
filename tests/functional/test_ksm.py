"""KSM per sandbox (create option ksm=True): every process of the sandbox is mergeable, the kernel
merges their identical pages, and a sandbox that did not opt in is never marked mergeable."""
from __future__ import annotations

import time

import pytest

from shoal import Host, Sandbox
from shoal.backends.container import ksm
from shoal.config import load_settings
from shoal.core.errors import InvalidArgument


@pytest.fixture(scope="module")
def kernel_ksm(host):
    why = ksm.probe(host.backend("container").helper)
    if why != "ok":
        pytest.skip(f"per-process KSM: {why}")


def _sandbox_procs(cg, sandbox_id: str) -> list[int]:
    procs = cg.procs(sandbox_id)
    assert procs, "the sandbox has processes in its cgroup"
    return procs


def test_ksm_marks_every_sandbox_process_mergeable(root, base_image, host, kernel_ksm):
    cg = host.backend("container").cgroups
    with Sandbox.create(base_image, root=root, ksm=True) as sb, Sandbox.create(base_image, root=root) as plain:
        assert sb.info().ksm is True and plain.info().ksm is False
        # a process exec'd inside after init set the flag: it survives fork and exec
        p = sb.commands.start(["sleep", "30"])
        q = plain.commands.start(["sleep", "30"])
        try:
            for pid in _sandbox_procs(cg, sb.id):  # init and the exec'd sleep
                assert ksm.process_stat(pid).get("ksm_merge_any") == "yes", pid
            for pid in _sandbox_procs(cg, plain.id):
                assert ksm.process_stat(pid).get("ksm_merge_any") == "no", pid
        finally:
            p.kill()
            q.kill()


def test_identical_pages_of_ksm_sandboxes_are_merged(root, base_image, host, kernel_ksm):
    """Two ksm sandboxes each hold the same ~4.7 MB of text (no page repeats within one process):
    ksmd (started by Shoal) merges the pages across the two sandboxes. Without ksm, nothing merges."""
    be = host.backend("container")
    # the shell keeps x until the end (a last simple command would be exec'd, replacing it)
    fill = "x=$(seq 1 600000); sleep 60; echo ${#x}"

    def merged_each(ids: list[str], wait_s: float) -> list[int]:
        deadline = time.monotonic() + wait_s
        while True:
            counts = [ksm.merging_pages(be.cgroups.procs(i)) for i in ids]
            if min(counts) >= 512 or time.monotonic() > deadline:  # >= 2 MiB in each
                return counts
            time.sleep(0.5)

    with Sandbox.create(base_image, root=root, ksm=True) as a, Sandbox.create(base_image, root=root, ksm=True) as b, \
            Sandbox.create(base_image, root=root) as c, Sandbox.create(base_image, root=root) as d:
        assert be.ksm_host.stats()["run"] == 1  # the first ksm sandbox started ksmd
        procs = [sb.commands.start(["sh", "-c", fill]) for sb in (a, b, c, d)]
        try:
            counts = merged_each([a.id, b.id], 60)
            assert min(counts) >= 512, f"pages merged after 60 s: {counts}"
            assert merged_each([c.id, d.id], 0) == [0, 0]  # the same bytes, not opted in
        finally:
            for p in procs:
                p.kill()


def test_ksm_and_aslr_survive_a_new_backend_on_the_root(root, base_image, kernel_ksm):
    """The options live in the sandbox's state: a restarted daemon (a new Host on the root) reports them."""
    with Sandbox.create(base_image, root=root, ksm=True, aslr=False, priority="idle") as sb:
        fresh = Host(load_settings(root))
        info = fresh.info(sb.id)
        assert (info.ksm, info.aslr, info.priority) == (True, False, "idle")


def test_bad_options_are_typed_errors(root, base_image):
    with pytest.raises(InvalidArgument, match="priority"):
        Sandbox.create(base_image, root=root, priority="high")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="ksm"):
        Sandbox.create(base_image, root=root, ksm="yes please")  # type: ignore[arg-type]


def test_config_section_is_checked():
    assert ksm.KsmConfig.from_settings({}) == ksm.KsmConfig()
    assert ksm.KsmConfig.from_settings({"ksm": {"pages_to_scan": 500}}).pages_to_scan == 500
    with pytest.raises(InvalidArgument, match="unknown"):
        ksm.KsmConfig.from_settings({"ksm": {"pages": 5}})
    with pytest.raises(InvalidArgument, match="sleep_millisecs"):
        ksm.KsmConfig.from_settings({"ksm": {"sleep_millisecs": 0}})
