"""Layer folding: the folded stack mounts with exactly the same content as the original stack."""
from __future__ import annotations

from shoal import Sandbox

LISTING = ("find / -xdev \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -print | sort | "
           "while read -r p; do if [ -f \"$p\" ] && [ ! -L \"$p\" ]; then echo \"$p $(md5sum < \"$p\")\"; "
           "else echo \"$p $(stat -c %F \"$p\")\"; fi; done")


def _tree(sb) -> str:
    return sb.commands.run(LISTING, timeout=60).stdout


def test_folded_stack_has_identical_content(root, base_image, host, make_layer):
    l1 = make_layer({"app/a.txt": "a1", "app/b.txt": "b1", "etc/motd": "hello", "keep/x": "x",
                     "swap/dir/inner": "was a dir"})
    l2 = make_layer({"app/a.txt": "a2", "app/b.txt": None, "bin/ls": None, "new/n": "n",
                     "swap/dir": None}, opaque=["keep"])
    l3 = make_layer({"app/b.txt": "b3", "keep/y": "y", "new/n": None, "swap/dir": "now a file",
                     "etc/hosts": None})
    stack = [l1, l2, l3]
    folded = host.store.fold(stack)
    assert folded.digest not in stack
    with Sandbox.create(base_image, layers=stack, root=root) as a, \
            Sandbox.create(base_image, layers=[folded.digest], root=root) as b:
        ta, tb = _tree(a), _tree(b)
        assert ta == tb
        paths = {line.split(" ", 1)[0] for line in ta.splitlines()}
        assert "/bin/sh" in paths and "/keep/y" in paths
        assert not paths & {"/bin/ls", "/etc/hosts", "/keep/x", "/new/n", "/swap/dir/inner"}  # whiteouts, opaque
        assert b.files.read("/app/b.txt") == "b3" and b.files.read("/swap/dir") == "now a file"


def test_fold_small_merges_only_runs_of_small_layers(host, make_layer):
    small1 = make_layer({"s1": "1"})
    small2 = make_layer({"s2": "2"})
    big = make_layer({"big": b"x" * 200_000})
    small3 = make_layer({"s3": "3"})
    out = host.store.fold_small([small1, small2, big, small3], threshold_bytes=100_000)
    assert len(out) == 3 and out[1:] == [big, small3]
    mnt = host.store.ensure_mounted([out[0]])[0]
    assert sorted(p.name for p in mnt.iterdir()) == ["s1", "s2"]


def test_fold_to_depth_keeps_shared_bottom(host, make_layer):
    layers = [make_layer({f"f{i}": str(i)}) for i in range(6)]
    out = host.store.fold_to_depth(layers, 3)
    assert len(out) == 3 and out[:2] == layers[:2]
