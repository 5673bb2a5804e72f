"""`watch_dir`: inotify inside a sandbox, in-process and through shoald's stream; gVisor says
NotSupported. The hostile cases: symlinks that point out of the sandbox, trees past the caps, a flood
of events nobody reads, too many watches."""
from __future__ import annotations

import os
import time

import pytest

from shoal.core.contract import WATCH_QUEUE, WatchEvent
from shoal.core.errors import FileOpError, NotSupported, QuotaExceeded

pytestmark = pytest.mark.all_backends


def _collect(h, until, timeout: float = 10.0) -> list[WatchEvent]:
    """Events until `until(events)` holds (or the timeout)."""
    out: list[WatchEvent] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(out):
        out += h.read(0.2)
    return out


def _kinds(evs: list[WatchEvent]) -> list[tuple[str, str]]:
    return [(e.type, e.name) for e in evs]


def _in_order(want: list[tuple[str, str]], got: list[tuple[str, str]]) -> bool:
    """`want` is a subsequence of `got` (a new directory's content may be reported twice: found by
    the scan that follows the directory, and by the watch added on it)."""
    it = iter(got)
    return all(w in it for w in want)


def _retry_watch(sb, path: str):
    deadline = time.monotonic() + 5
    while True:
        try:
            return sb.files.watch(path)
        except QuotaExceeded:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _inotify_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
        except OSError:
            pass
    return n


def test_events_arrive_typed_and_in_order(make_sandbox, backend_kind):
    sb = make_sandbox()
    if backend_kind == "gvisor":
        with pytest.raises(NotSupported):
            sb.files.watch("/tmp")
        return
    sb.files.mkdir("/w")
    with sb.files.watch("/w", recursive=True) as h:
        assert h.read(0.05) == []
        sb.commands.run("cd /w && echo hi > new.txt && mv new.txt moved.txt && chmod 600 moved.txt && "
                        "mkdir sub && echo x > sub/f && rm moved.txt", check=True)
        evs = _collect(h, lambda evs: ("remove", "moved.txt") in _kinds(evs))
        kinds = _kinds(evs)
        # a new file: create before write (envd's order); a rename: rename of the old name, create of the new
        want = [("create", "new.txt"), ("write", "new.txt"), ("rename", "new.txt"), ("create", "moved.txt"),
                ("chmod", "moved.txt"), ("create", "sub"), ("create", "sub/f"), ("write", "sub/f"),
                ("remove", "moved.txt")]
        assert _in_order(want, kinds), kinds
        ren = next(e for e in evs if e.type == "rename")
        assert (ren.path, ren.dest) == ("/w/new.txt", "/w/moved.txt")
        assert next(e for e in evs if e.name == "sub").is_dir
        # a write through the files API is seen too
        t0 = time.monotonic()
        sb.files.write("/w/sub/g", "y")
        evs = _collect(h, lambda evs: ("write", "sub/g") in _kinds(evs))
        assert ("create", "sub/g") in _kinds(evs), _kinds(evs)
        assert time.monotonic() - t0 < 5
        # the watched directory goes away: an end event, then nothing
        sb.commands.run("rm -rf /w", check=True)
        evs = _collect(h, lambda evs: any(e.type == "end" for e in evs))
        assert evs[-1].type == "end" and h.read(0.05) == [] and h.ended


def test_a_symlink_never_watches_the_host(make_sandbox, backend_kind, tmp_path):
    sb = make_sandbox()
    if backend_kind == "gvisor":
        pytest.skip("no watches on gVisor")
    host_dir = tmp_path / "host-side"
    host_dir.mkdir()
    sb.commands.run(f"mkdir -p /w/real && ln -s {host_dir} /w/out && ln -s / /w/root", check=True)
    # the absolute link resolves inside the sandbox, where that directory does not exist
    with pytest.raises(FileOpError):
        sb.files.watch("/w/out")
    with sb.files.watch("/w", recursive=True) as h:
        if backend_kind == "container":
            assert h.watched_dirs == 2  # /w and /w/real: the links are entries, never followed
        (host_dir / "planted").write_text("from the host")
        sb.commands.run(f"mkdir -p {host_dir} && touch {host_dir}/inside /w/real/seen", check=True)
        evs = _collect(h, lambda evs: ("create", "real/seen") in _kinds(evs))
        assert ("create", "real/seen") in _kinds(evs)
        assert not [e for e in evs if "planted" in e.path or "inside" in e.path], _kinds(evs)


def test_a_flood_is_bounded_and_reported(make_sandbox, backend_kind):
    sb = make_sandbox()
    if backend_kind == "gvisor":
        pytest.skip("no watches on gVisor")
    sb.files.mkdir("/flood")
    with sb.files.watch("/flood") as h:
        # more events than the kernel queues (fs.inotify.max_queued_events, 16384 by default) while
        # nobody reads (through shoald: the kernel's queue, or the client's if the daemon drained it)
        with open("/proc/sys/fs/inotify/max_queued_events") as f:
            n = int(f.read()) + 2000
        sb.commands.run(f"cd /flood && i=0; while [ $i -lt {n} ]; do : > f$i; i=$((i+1)); done", check=True,
                        timeout=120)
        time.sleep(0.5)
        first = h.read(0.5, max_events=10)
        assert len(first) <= 10
        if backend_kind == "container":
            assert h.queued <= WATCH_QUEUE  # what the handle holds: one kernel read at most
        evs = first + _collect(h, lambda evs: any(e.type == "overflow" for e in first + evs), timeout=20)
        assert any(e.type == "overflow" for e in evs), _kinds(evs)[:5]
        # and it keeps working after the overflow
        h.read(0.2)
        sb.commands.run("touch /flood/after", check=True)
        evs = _collect(h, lambda evs: ("create", "after") in _kinds(evs), timeout=20)
        assert ("create", "after") in _kinds(evs)


@pytest.mark.backends("container", "http")
def test_watch_caps(make_sandbox, backend_kind):
    from shoal.backends.container.watch import WatchLimits

    sb = make_sandbox()
    limits = WatchLimits()
    before = _inotify_fds()
    held = [sb.files.watch("/") for _ in range(limits.per_sandbox)]
    try:
        with pytest.raises(QuotaExceeded, match="watches open"):
            sb.files.watch("/")
        held.pop().close()
        held.append(_retry_watch(sb, "/"))  # shoald frees it as soon as it sees the stream close
    finally:
        for h in held:
            h.close()
    _retry_watch(sb, "/").close()
    # a tree with more directories than a sandbox may watch: refused whole, nothing leaks
    n = limits.dirs_per_sandbox + 10
    sb.commands.run(f"mkdir -p /big && cd /big && seq 1 {n} | xargs mkdir", check=True, timeout=120)
    with pytest.raises(QuotaExceeded, match="directories"):
        sb.files.watch("/big", recursive=True)
    with sb.files.watch("/big") as h:  # not recursive: one directory
        sb.commands.run("touch /big/x", check=True)
        assert ("create", "x") in _kinds(_collect(h, lambda evs: ("create", "x") in _kinds(evs)))
    # a tree that grows past the cap after the start: the watch says it stopped following
    sb.commands.run("cd /big && seq 1 30 | xargs rmdir", check=True)
    with sb.files.watch("/big", recursive=True) as h:
        sb.commands.run(f"cd /big && seq {n + 1} {n + 100} | xargs mkdir", check=True)
        evs = _collect(h, lambda evs: any(e.type == "overflow" for e in evs))
        over = [e for e in evs if e.type == "overflow"]
        assert over and "not followed" in (over[0].detail or ""), _kinds(evs)[-5:]
    if backend_kind == "container":
        assert _inotify_fds() == before


def test_the_sandbox_ending_ends_the_watch(make_sandbox, backend_kind):
    sb = make_sandbox()
    if backend_kind == "gvisor":
        pytest.skip("no watches on gVisor")
    h = sb.files.watch("/tmp")
    sb.kill()
    evs = _collect(h, lambda evs: any(e.type == "end" for e in evs))
    assert evs and evs[-1].type == "end", _kinds(evs)
    h.close()


@pytest.mark.backends("container")
def test_a_huge_flat_tree_is_refused_before_it_costs(make_sandbox):
    """A recursive watch lists the tree once at start: past `scan_entries` it is refused, not walked."""
    from shoal.backends.container.watch import WatchLimits

    sb = make_sandbox()
    cb = sb.backend.backend("container")  # the Host's container backend, whose caps apply
    sb.commands.run("mkdir -p /flat/sub && cd /flat && seq 1 3000 | xargs touch", check=True, timeout=120)
    cb.watch_limits = WatchLimits(scan_entries=2000)
    try:
        with pytest.raises(QuotaExceeded, match="more than 2000 entries"):
            sb.files.watch("/flat", recursive=True)
        with sb.files.watch("/flat/sub", recursive=True):
            pass
    finally:
        cb.watch_limits = None


@pytest.mark.backends("container")
def test_a_new_full_directory_cannot_balloon_the_queue(make_sandbox):
    """Directories made and filled while nobody reads: the scans that follow them report what is in
    them, but what the handle holds stays one queue's worth (WATCH_QUEUE), not every entry found."""
    import tracemalloc

    sb = make_sandbox()
    sb.files.mkdir("/w")
    with sb.files.watch("/w", recursive=True) as h:
        sb.commands.run("cd /w && for d in 1 2 3 4 5 6 7 8; do mkdir d$d && (cd d$d && seq 1 5000 | xargs touch); done",
                        check=True, timeout=120)
        tracemalloc.start()
        try:
            first = h.read(1.0, max_events=10)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert first and h.queued <= WATCH_QUEUE + 8
        # 40 000 entries found at once (about 45 MiB of events unbounded); one queue's worth of events is a few MiB
        assert peak < 24 << 20, f"{peak >> 20} MiB held by one read"
        evs = first + _collect(h, lambda evs: any(e.type == "overflow" for e in evs), timeout=20)
        assert any(e.type == "overflow" for e in evs)


@pytest.mark.backends("container")
def test_renaming_a_big_directory_back_and_forth_costs_a_bounded_scan(make_sandbox):
    """Each directory moved into a recursive watch is scanned (to watch its subdirectories): a sandbox
    that renames a big directory to and fro would make the host list it again and again. The scans of
    one watch share a budget (scan_entries per SCAN_REFILL_S); past it the watch says so."""
    from shoal.backends.container.watch import SCAN_REFILL_S, WatchLimits

    sb = make_sandbox()
    sb.commands.run("mkdir -p /w/x && cd /w/x && seq 1 20000 | xargs touch", check=True, timeout=120)
    with sb.files.watch("/w", recursive=True) as h:
        sb.commands.run("cd /w && i=0; while [ $i -lt 60 ]; do mv x y && mv y x; i=$((i+1)); done", check=True,
                        timeout=120)
        t0 = time.monotonic()
        evs = _collect(h, lambda evs: sum(e.type == "rename" for e in evs) >= 120 and h.queued == 0, timeout=30)
        took = time.monotonic() - t0
        budget = WatchLimits().scan_entries * (1 + (took + 1) / SCAN_REFILL_S)
        assert h.scanned <= budget, f"{h.scanned} entries listed in {took:.1f} s"  # unbounded: 60 x 20 000
        assert any(e.type == "overflow" and "scan" in (e.detail or "") for e in evs), _kinds(evs)[-3:]


@pytest.mark.backends("http")
def test_one_end_event_when_the_reader_takes_it_before_the_stream_closes(make_sandbox):
    """The client's reader thread queues the daemon's `end`, then closes the response; a caller that
    takes the `end` in between must not get a second one (seen once in CI). The close is slowed here
    so that the caller always wins that race."""
    sb = make_sandbox()
    sb.files.mkdir("/w")
    with sb.files.watch("/w") as h:
        resp = h._resp
        real_close = resp.close

        def slow_close() -> None:
            time.sleep(0.5)
            real_close()

        resp.close = slow_close
        sb.commands.run("rm -rf /w", check=True)
        evs = _collect(h, lambda evs: any(e.type == "end" for e in evs))
        assert [e.type for e in evs].count("end") == 1, evs
        time.sleep(0.8)  # the reader thread has finished
        assert h.read(0.05) == [] and h.ended
