"""The environment builder: recipes, the build cache, whiteouts in RUN layers, roles and O(m) upgrades."""
from __future__ import annotations

import pytest

from shoal import InvalidArgument, Sandbox
from shoal.core.errors import BuildError
from shoal.envs import Builder, parse_recipe


def _build(host, text, tag, context):
    return Builder(host).build(parse_recipe(text, context), tag)


def test_recipe_builds_layers_and_config(host, root, base_image, tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.sh").write_text("echo app says $GREETING")
    text = f"""
FROM {base_image}
ENV GREETING=hello
COPY app/ /opt/app
WORKDIR /opt/app
RUN echo built > stamp && rm /etc/hosts && \\
    mkdir -p /tmp/junk && echo residue > /tmp/junk/x
"""
    res = _build(host, text, "built:1", tmp_path)
    assert res.built == 3  # COPY, WORKDIR, RUN
    img = res.image
    assert img.config["env"]["GREETING"] == "hello" and img.config["workdir"] == "/opt/app"
    with Sandbox.create("built:1", root=root) as sb:
        r = sb.commands.run("sh main.sh; cat stamp; pwd")
        assert r.stdout == "app says hello\nbuilt\n/opt/app\n"
        assert not sb.files.exists("/etc/hosts")  # the RUN's deletion is a whiteout in its layer
        assert not sb.files.exists("/tmp/junk")  # build residue excluded


def test_unchanged_recipe_does_no_work_and_a_change_rebuilds_only_what_follows(host, base_image, tmp_path):
    steps = ["RUN echo one > /one", "RUN echo two > /two", "RUN echo three > /three"]
    text = f"FROM {base_image}\n" + "\n".join(steps)
    first = _build(host, text, "cache:1", tmp_path)
    again = _build(host, text, "cache:2", tmp_path)
    assert first.built == 3 and again.built == 0
    assert again.image.layers == first.image.layers
    changed = text.replace("echo two", "echo TWO")
    third = _build(host, changed, "cache:3", tmp_path)
    assert [s.cached for s in third.steps] == [True, False, False]
    assert third.image.layers[:2] == first.image.layers[:2]


def test_roles_compose_at_creation_and_base_upgrade_rebuilds_nothing_else(host, root, base_image, tmp_path):
    base_v1 = _build(host, f"FROM {base_image}\nRUN echo v1 > /etc/base-version", "rolebase:v1", tmp_path)
    ws = _build(host, "FROM rolebase:v1\nLABEL shoal.role=workspace\nWORKDIR /work/repo\n"
                      "RUN echo 'print tests' > test.txt", "ws-demo:1", tmp_path)
    tk = _build(host, "FROM rolebase:v1\nLABEL shoal.role=toolkit\nENV TOOL=harness\n"
                      "RUN mkdir -p /usr/local/bin && echo tool > /usr/local/bin/tool.txt", "tk-demo:1", tmp_path)
    assert tk.image.config["role"] == "toolkit" and ws.image.config["role"] == "workspace"
    assert not set(ws.image.layers) & set(base_v1.image.layers)
    base_v2 = _build(host, f"FROM {base_image}\nRUN echo v2 > /etc/base-version", "rolebase:v2", tmp_path)
    assert base_v2.built == 1
    for base, version in (("rolebase:v1", "v1"), ("rolebase:v2", "v2")):
        with Sandbox.create(base, layers=["ws-demo:1", "tk-demo:1"], root=root) as sb:
            r = sb.commands.run("cat /etc/base-version test.txt /usr/local/bin/tool.txt; echo $TOOL; pwd")
            assert r.stdout == f"{version}\nprint tests\ntool\nharness\n/work/repo\n"


def test_run_failure_names_the_line_and_keeps_nothing(host, base_image, tmp_path):
    before = set(host.settings.sandboxes_dir.iterdir())
    with pytest.raises(BuildError, match="line 3.*exited with 7"):
        _build(host, f"FROM {base_image}\nRUN true\nRUN echo failing; exit 7", "fail:1", tmp_path)
    assert set(host.settings.sandboxes_dir.iterdir()) == before


def test_build_network_is_only_for_builds(host, root, base_image, tmp_path):
    r = _build(host, f"FROM {base_image}\nRUN ls /sys/class/net > /build-net\n"
                     "RUN --network=none ls /sys/class/net > /isolated-net", "net:1", tmp_path)
    with Sandbox.create("net:1", root=root) as sb:
        build_links = sb.files.read("/build-net").split()
        assert len(build_links) > 1 or build_links != ["lo"]  # the host's interfaces
        assert sb.files.read("/isolated-net").split() == ["lo"]
        assert sb.commands.run("ls /sys/class/net").stdout.split() == ["lo"]  # the task sandbox: none
    assert r.built == 2


@pytest.mark.parametrize("text,msg", [
    ("RUN true", "must start with FROM"),
    ("FROM a\nFROM b", "only one FROM"),
    ("FROM scratch\nRUN true", "no shell"),
    ("FROM x\nCOPY ../etc/passwd /x", "inside the build context"),
    ("FROM x\nWORKDIR relative", "absolute"),
    ("FROM x\nEXPOSE 80", "unsupported instruction"),
    ("FROM x\nRUN --privileged true", "unknown RUN flag"),
    ("FROM x\nLABEL shoal.role=database", "shoal.role"),
])
def test_bad_recipes(text, msg):
    with pytest.raises(InvalidArgument, match=msg):
        parse_recipe(text)
