"""aslr=False: processes in the sandbox start with ADDR_NO_RANDOMIZE, so identical programs lay out
identically (what lets KSM merge identical interpreters); the default keeps ASLR, and a sandbox cannot
turn it off by itself."""
from __future__ import annotations

from shoal import Sandbox

LAYOUT = "grep -E '\\[(stack|heap|vdso)\\]' /proc/self/maps"


def _layout(sb: Sandbox) -> str:
    r = sb.commands.run(["sh", "-c", LAYOUT])
    assert r.exit_code == 0 and "[stack]" in r.stdout, r
    return r.stdout


def test_aslr_off_lays_out_identically_across_sandboxes(root, base_image):
    with Sandbox.create(base_image, root=root, aslr=False) as a, Sandbox.create(base_image, root=root, aslr=False) as b:
        assert a.info().aslr is False
        assert a.commands.run("cat /proc/self/personality").stdout.strip() == "00040000"  # ADDR_NO_RANDOMIZE
        first = _layout(a)
        assert _layout(a) == first == _layout(b)


def test_default_keeps_aslr(root, base_image):
    with Sandbox.create(base_image, root=root) as a, Sandbox.create(base_image, root=root) as b:
        assert a.commands.run("cat /proc/self/personality").stdout.strip() == "00000000"
        layouts = {_layout(a), _layout(a), _layout(b)}
        assert len(layouts) == 3, layouts  # random stacks: equal only by a 1 in 2^30-ish chance


def test_a_sandbox_cannot_turn_aslr_off_itself(root, base_image):
    """Hostile: setarch -R (personality ADDR_NO_RANDOMIZE) is refused by the seccomp filter."""
    with Sandbox.create(base_image, root=root) as sb:
        r = sb.commands.run("linux64 -R cat /proc/self/personality")
        assert r.exit_code != 0 and "00040000" not in r.stdout, r
        assert "not permitted" in r.stderr.lower(), r
