"""`shoal` command line: layers, images, registries (push/pull), sandboxes, gc."""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from .core.errors import ShoalError

if TYPE_CHECKING:
    from .host import Host

app = typer.Typer(help="Shoal: composable EROFS-layer sandboxes.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
layer_app = typer.Typer(help="Build, import, list and remove layers.", no_args_is_help=True)
image_app = typer.Typer(help="Images: named stacks of layers.", no_args_is_help=True)
app.add_typer(layer_app, name="layer")
app.add_typer(image_app, name="image")
tenant_app = typer.Typer(help="Tenants and API keys (through the local shoald, as admin).", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
zram_app = typer.Typer(help="Shoal's zram swap device, where reclaimed sandbox memory goes (the config's zram_mb).",
                       no_args_is_help=True)
app.add_typer(zram_app, name="zram")
env_app = typer.Typer(help="Ready-made environments: Debian base, Python toolchain, real workspaces.",
                      no_args_is_help=True)
app.add_typer(env_app, name="env")
traj_app = typer.Typer(help="Trajectory logs: what ran where, when, by which episode; replay.", no_args_is_help=True)
app.add_typer(traj_app, name="traj")
tasks_app = typer.Typer(help="Task suites: make their images ready on this host for rollouts.", no_args_is_help=True)
app.add_typer(tasks_app, name="tasks")
fleet_app = typer.Typer(help="A fleet: its CA and certificates, its hosts (docs/fleet.md).", no_args_is_help=True)
app.add_typer(fleet_app, name="fleet")
from .e2b.cli import e2b_app  # noqa: E402  (its own module: the E2B front's commands)

app.add_typer(e2b_app, name="e2b")
from .flare.cli import flare_app  # noqa: E402  (its own module: FLARE's commands)

app.add_typer(flare_app, name="flare")
from .annotate.cli import app as annotate_app  # noqa: E402  (its own module: token-level correction annotation)

app.add_typer(annotate_app, name="annotate")
from .desktop.cli import desktop_app  # noqa: E402  (its own module: desktop sandboxes' commands)

app.add_typer(desktop_app, name="desktop")
console = Console()
err_console = Console(stderr=True)

RootOpt = typer.Option(None, "--root", envvar="SHOAL_ROOT", help="Shoal state root (default /var/lib/shoal)")


def _host(root: str | None) -> Host:
    from .host import Host  # imported per command: the host pulls in pydantic, SQLite, the runtime

    return Host.get(root)


def _backend(root: str | None):
    """Where sandbox commands go: shoald ($SHOAL_URL or the host daemon's socket), or this process
    when SHOAL_URL=local (root only)."""
    from .backends import open_backend

    return open_backend(None, None, root)


def _size(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True)


# ------------------------------------------------------------------------------------------ layers
@layer_app.command("build")
def layer_build(src: Path | None = typer.Argument(None, help="directory to turn into a layer"),
                name: str | None = typer.Option(None, "--name", "-n", help="name the layer"),
                busybox: bool = typer.Option(False, "--busybox", help="build a minimal busybox rootfs instead"),
                root: str | None = RootOpt):
    """Build a layer from a directory (content-addressed: the same content is stored once)."""
    host = _host(root)
    with _progress() as p:
        task = p.add_task(f"building layer from {src or 'busybox'}", total=None)
        if busybox:
            from .layers.busybox import make_busybox_tree

            with tempfile.TemporaryDirectory(dir=host.settings.tmp_dir) as d:
                info = host.store.build_from_dir(make_busybox_tree(Path(d)), source="busybox", name=name)
        elif src is None:
            raise typer.BadParameter("give a directory or --busybox")
        else:
            info = host.store.build_from_dir(src, name=name)
        p.update(task, completed=1, total=1)
    console.print(f"{info.digest}  {_size(info.image_bytes)}  {' '.join(info.names)}")


@layer_app.command("import")
def layer_import(path: Path = typer.Argument(..., help="a layer tar (.tar/.tar.gz) or a docker-save/OCI archive"),
                 name: str | None = typer.Option(None, "--name", "-n",
                                                    help="layer name (tar) or image ref (archive)"),
                 root: str | None = RootOpt):
    """Import a tar stream as one layer, or a docker save / OCI archive as one layer per image layer."""
    host = _host(root)
    from .core.errors import CorruptArchive
    from .layers.archive import read_image_archive

    try:
        read_image_archive(path)
        is_image = True
    except CorruptArchive:
        is_image = False
    if is_image:
        with _progress() as p:
            task = p.add_task(f"importing {path.name}", total=None)
            img = host.store.import_archive(path, ref=name,
                                            progress=lambda i, n: p.update(task, completed=i, total=n))
        console.print(f"image {img.ref}: {len(img.layers)} layers")
        for d in img.layers:
            console.print(f"  {d}")
    else:
        info = host.store.build_from_tar(path=path, name=name)
        console.print(f"{info.digest}  {_size(info.image_bytes)}  {' '.join(info.names)}")


@layer_app.command("ls")
def layer_ls(root: str | None = RootOpt, as_json: bool = typer.Option(False, "--json")):
    """List layers."""
    layers = _host(root).store.list()
    if as_json:
        console.print_json(json.dumps([x.__dict__ for x in layers]))
        return
    t = Table("DIGEST", "NAMES", "CONTENT", "IMAGE", "ENTRIES", "SOURCE")
    for x in layers:
        t.add_row(x.short, ",".join(x.names), _size(x.size), _size(x.image_bytes), str(x.entries), x.source)
    console.print(t)


@layer_app.command("rm")
def layer_rm(ref: str, root: str | None = RootOpt):
    """Remove a layer (refused while an image or a live sandbox uses it)."""
    info = _host(root).remove_layer(ref)
    console.print(f"removed {info.digest}")


# ------------------------------------------------------------------------------------------ images
@image_app.command("create")
def image_create(ref: str | None = typer.Argument(None, help="name[:tag]"),
                 layers: list[str] | None = typer.Argument(None, help="layers bottom -> top (names or digests)"),
                 spec: Path | None = typer.Option(None, "--spec", help="TOML spec: [image] name, tag, layers"),
                 root: str | None = RootOpt):
    """Create (or replace) an image: a named, ordered stack of layers."""
    store = _host(root).store
    if spec:
        img = store.create_image_from_spec(spec)
    elif ref and layers:
        img = store.create_image(ref, layers)
    else:
        raise typer.BadParameter("give NAME[:TAG] LAYER... or --spec FILE")
    console.print(f"{img.ref}: {' -> '.join(d.split(':')[1][:12] for d in img.layers)}")


@image_app.command("ls")
def image_ls(root: str | None = RootOpt):
    """List images; WHERE says, per layer, local / cached / partial / remote (lazy layers)."""
    t = Table("IMAGE", "LAYERS (bottom -> top)", "WHERE", "CREATED")
    store = _host(root).store
    for img in store.list_images():
        t.add_row(img.ref, " ".join(d.split(":")[1][:12] for d in img.layers),
                  " ".join(store.location(d) for d in img.layers),
                  time.strftime("%F %T", time.localtime(img.created)))
    console.print(t)


@image_app.command("fold")
def image_fold(ref: str, to: str | None = typer.Option(None, "--to", help="new image ref (default: replace REF)"),
               threshold_mb: float | None = typer.Option(None, "--threshold-mb",
                                                            help="fold runs of layers smaller than this"),
               max_depth: int | None = typer.Option(None, "--max-depth", help="fold the top so depth <= this"),
               root: str | None = RootOpt):
    """Fold consecutive small layers of an image into one (whiteouts preserved; same content)."""
    host = _host(root)
    img = host.store.get_image(ref)
    threshold = int(threshold_mb * 2**20) if threshold_mb is not None else host.settings.fold_threshold_bytes
    layers = host.store.fold_small(list(img.layers), threshold)
    if max_depth:
        layers = host.store.fold_to_depth(layers, max_depth)
    new = host.store.create_image(to or ref, layers, config=img.config)
    console.print(f"{new.ref}: {len(img.layers)} -> {len(new.layers)} layers")


@image_app.command("rm")
def image_rm(ref: str, root: str | None = RootOpt):
    """Remove an image (its layers stay until `shoal gc` or `shoal layer rm`)."""
    _host(root).store.remove_image(ref)
    console.print(f"removed {ref}")


# ------------------------------------------------------------------------------------------ registries
CaOpt = typer.Option(None, "--ca", envvar="SHOAL_REGISTRY_CA", help="PEM bundle of the registry's CA (private TLS)")
InsecureOpt = typer.Option(False, "--insecure", help="do not verify the registry's TLS certificate (test registries)")
PlainHttpOpt = typer.Option(False, "--plain-http", help="speak plain HTTP to the registry (a loopback test registry)")


def _transfer_bar(p: Progress, verb: str):
    """A rich bar fed by push/pull progress callbacks: (what, bytes done, bytes total)."""
    task = p.add_task(verb, total=None)

    def update(what: str, done: int, total: int) -> None:
        p.update(task, description=f"{verb} {what}", completed=done, total=total or None)

    return update


@app.command()
def push(image: str = typer.Argument(..., help="local image name[:tag]"),
         target: str = typer.Argument(..., help="REGISTRY/REPO:TAG"),
         ca: Path | None = CaOpt, insecure: bool = InsecureOpt, plain_http: bool = PlainHttpOpt,
         chunk_mb: int = typer.Option(16, "--chunk-mb", help="upload chunk (the most a resumed push re-sends)"),
         prefetch_only: bool = typer.Option(False, "--prefetch-only", help="publish only the prefetch lists this "
                                            "root recorded for the image's layers (after a lazy pull and a run)"),
         relayout: bool = typer.Option(False, "--relayout", help="push layers with a recorded access list laid out "
                                       "in first-read order (same tree and digest, new blob): fewer bytes for lazy "
                                       "readers"),
         access_from: str | None = typer.Option(None, "--access-from", help="REPO on the same registry where "
                                                "published access lists are looked up (default: the target's)"),
         as_json: bool = typer.Option(False, "--json"), root: str | None = RootOpt):
    """Push an image to an OCI registry: each layer as its EROFS blob plus a chunk index; blobs the
    registry has are skipped, interrupted uploads resume; then the prefetch lists recorded here for
    its layers. Credentials: SHOAL_REGISTRY_USER / SHOAL_REGISTRY_PASSWORD (for the registry named in
    SHOAL_REGISTRY_HOST) or `docker login` (~/.docker/config.json)."""
    from .registry import push as push_image

    host = _host(root)
    with _progress() as p:
        res = push_image(host.store, image, target, chunk_size=chunk_mb << 20, progress=_transfer_bar(p, "pushing"),
                         ca=str(ca) if ca else None, insecure=insecure, plain_http=plain_http,
                         prefetch_only=prefetch_only, relayout=relayout, access_from=access_from)
    if as_json:
        console.print_json(json.dumps({"target": res.target, "manifest": res.manifest, "bytes_sent": res.bytes_sent,
                                       "layers": [x.__dict__ for x in res.layers],
                                       "prefetch_lists": res.prefetch_lists, "relaid": res.relaid}))
        return
    lists = f"; {len(res.prefetch_lists)} prefetch lists published" if res.prefetch_lists else ""
    if res.relaid:
        lists += f"; {len(res.relaid)} layers laid out in first-read order"
    if prefetch_only:
        console.print(f"{image} -> {res.target}: {len(res.prefetch_lists)} prefetch lists published")
        return
    console.print(f"{image} -> {res.target}@{res.manifest}: {res.layers_sent} of {len(res.layers)} layers sent "
                  f"({_size(res.bytes_sent)}){lists}")


@app.command()
def pull(source: str = typer.Argument(..., help="REGISTRY/REPO:TAG or REGISTRY/REPO@sha256:..."),
         as_ref: str | None = typer.Option(None, "--as", help="local image name[:tag] (default: REPO:TAG)"),
         platform: str | None = typer.Option(None, "--platform", help="os/arch or os/arch/variant to take from "
                                                                         "an index (default: this host's)"),
         ca: Path | None = CaOpt, insecure: bool = InsecureOpt, plain_http: bool = PlainHttpOpt,
         lazy: bool = typer.Option(False, "--lazy", help="do not download Shoal layers: read them on demand from "
                                   "the registry (ordinary container images are converted eagerly all the same)"),
         timeout: float = typer.Option(10.0, "--timeout", help="with --lazy: the deadline of each on-demand read, s"),
         as_json: bool = typer.Option(False, "--json"), root: str | None = RootOpt):
    """Pull an image from an OCI registry: Shoal images fetch only the layers this host lacks (with
    --lazy, only their chunk indexes: sandboxes read the rest on demand); ordinary container images
    (Docker / OCI, multi-arch) are converted to layers once per diff_id."""
    from .registry import pull as pull_image

    host = _host(root)
    with _progress() as p:
        res = pull_image(host.store, source, as_ref, platform=platform, progress=_transfer_bar(p, "pulling"),
                         ca=str(ca) if ca else None, insecure=insecure, plain_http=plain_http, lazy=lazy,
                         timeout_s=timeout)
    if as_json:
        console.print_json(json.dumps({"image": res.image.ref, "layers": list(res.image.layers), "source": res.source,
                                       "kind": res.kind, "fetched": res.fetched, "present": res.present,
                                       "lazy": res.lazy, "bytes_fetched": res.bytes_fetched, "note": res.note}))
        return
    lazy_txt = f"{len(res.lazy)} layers lazy (read on demand); " if lazy and res.kind == "shoal" else ""
    console.print(f"{res.image.ref}: {len(res.image.layers)} layers from {res.source} ({res.kind} image; "
                  f"{lazy_txt}{len(res.fetched)} blobs fetched, {_size(res.bytes_fetched)}; "
                  f"{len(res.present)} layers already here)")
    if res.note:
        console.print(f"[yellow]note:[/yellow] {res.note}")


@app.command()
def build(recipe: Path = typer.Option(..., "--file", "-f", help="recipe (Dockerfile subset)"),
          tag: str = typer.Option(..., "--tag", "-t", help="image name[:tag] to create"),
          context: Path | None = typer.Argument(None, help="build context (default: the recipe's folder)"),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="do not stream step output"),
          root: str | None = RootOpt):
    """Build an image from a recipe; unchanged steps come from the build cache."""
    from .envs import Builder, load_recipe

    host = _host(root)
    rec = load_recipe(recipe, context)
    with _progress() as p:
        task = p.add_task(f"building {tag}", total=len(rec.steps))

        def on_step(i, n, step, cached):
            p.update(task, completed=i, description=f"[{i + 1}/{n}] {'cached ' if cached else ''}{step.text[:60]}")

        out = None if quiet else (lambda t: p.console.print(t, end="", markup=False, highlight=False))
        res = Builder(host, on_output=out, on_step=on_step).build(rec, tag)
        p.update(task, completed=len(rec.steps))
    console.print(f"{res.image.ref}: {len(res.image.layers)} layers, {res.built} built, "
                  f"{sum(1 for s in res.steps if s.digest and s.cached)} from cache")


@env_app.command("base")
def env_base(root: str | None = RootOpt):
    """Build (once; cached) debian:bookworm by debootstrap and python:3.11 by its recipe."""
    from .envs.debian import ensure_python_base

    with _progress() as p:
        p.add_task("debootstrap bookworm + python toolchain (cached after the first time)", total=None)
        img = ensure_python_base(_host(root))
    console.print(f"{img.ref}: {len(img.layers)} layers")


@env_app.command("workspaces")
def env_workspaces(verify: bool = typer.Option(False, "--verify", help="run each project's tests in a sandbox"),
                   quick: bool = typer.Option(False, "--quick", help="with --verify: the quick test subset"),
                   only: list[str] | None = typer.Option(None, "--only", help="project name (repeatable)"),
                   root: str | None = RootOpt):
    """Build the real PyPI workspaces (ws/<project>:<version>) and optionally verify them."""
    from .envs.debian import ensure_python_base
    from .envs.workspaces import CATALOG, build_workspace, verify_workspace

    host = _host(root)
    specs = [s for s in CATALOG if not only or s.name in only]
    t = Table("WORKSPACE", "LAYERS", "TESTS")
    failed = 0
    with _progress() as p:
        task = p.add_task("python base", total=len(specs) + 1)
        ensure_python_base(host)
        for spec in specs:
            p.update(task, advance=1, description=f"workspace {spec.name}")
            img = build_workspace(host, spec)
            verdict = "-"
            if verify:
                r = verify_workspace(host, spec, quick=quick)
                lines = (r.stdout or r.stderr).strip().splitlines()
                verdict = ("ok: " if r.exit_code == 0 else f"FAILED ({r.exit_code}): ") + (lines[-1] if lines else "")
                failed += r.exit_code != 0
            t.add_row(img.ref, str(len(img.layers)), verdict)
    console.print(t)
    if failed:
        raise typer.Exit(1)


@tasks_app.command("prepare")
def tasks_prepare(suite: Path | None = typer.Option(None, "--suite", help="suite JSONL (default: bundled)"),
                  only: list[str] | None = typer.Option(None, "--only", help="task id (repeatable)"),
                  root: str | None = RootOpt):
    """Build every image a suite's episodes and graders start from, in this host's store (as root,
    once; cached). Rollout workers then run as normal users, through shoald."""
    from .tasks.swe import load_suite
    from .tasks.swe.suite import prepare_suite

    tasks = [t for t in load_suite(suite) if not only or t.instance_id in only]
    if only and len(tasks) != len(set(only)):
        missing = sorted(set(only) - {t.instance_id for t in tasks})
        raise typer.BadParameter(f"no such task in the suite: {', '.join(missing)}", param_hint="--only")
    host = _host(root)
    t0 = time.perf_counter()
    with _progress() as p:
        bar = p.add_task("python base", total=None)

        def step(what: str, i: int, n: int) -> None:
            p.update(bar, description=what, completed=i, total=n)

        prepare_suite(host, tasks, step)
    console.print(f"{len(tasks)} tasks ready in {host.settings.root} ({time.perf_counter() - t0:.1f} s)")


# ------------------------------------------------------------------------------------------ sandboxes
@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(ctx: typer.Context, image: str = typer.Argument(..., help="image name[:tag]"),
        layer: list[str] | None = typer.Option(None, "--layer", "-l", help="extra layer on top (repeatable)"),
        memory_mb: int | None = typer.Option(None, "--memory-mb"),
        cpu: float | None = typer.Option(None, "--cpu"),
        disk_mb: int | None = typer.Option(None, "--disk-mb"), timeout: float = typer.Option(600, "--timeout"),
        detach: bool = typer.Option(False, "--detach", "-d", help="keep the sandbox and print its id"),
        ttl: float | None = typer.Option(None, "--ttl", help="absolute TTL in seconds (with --detach)"),
        in_process: bool = typer.Option(False, "--in-process", help="run here even if a shoald is running"),
        ksm: bool = typer.Option(False, "--ksm", help="merge identical pages with other --ksm sandboxes "
                                                      "(a side channel between them; docs/ksm-and-scheduling.md)"),
        no_aslr: bool = typer.Option(False, "--no-aslr", help="ASLR off inside: identical programs lay out "
                                                              "identically, so KSM merges them"),
        priority: str | None = typer.Option(None, "--priority", help="'normal' or 'idle' (CPU class)"),
        memory_cgroup: str | None = typer.Option(None, "--memory-cgroup",
                                                 help="'own' or 'pooled' (a memory cgroup shared with other "
                                                      "sandboxes; denser, docs/density.md); default: the host's"),
        root: str | None = RootOpt):
    """Create a sandbox from IMAGE and run `-- CMD...` in it (removed afterwards unless --detach).

    With a shoald running on this root (`shoal serve`) the sandbox is made and run through it
    (the fast path, shoal.cli_fast); without one, or with --in-process, it runs in this process."""
    from .cli_fast import dispatch

    opts = {"target": image, "cmd": list(ctx.args), "layers": layer or [], "memory_mb": memory_mb, "cpu": cpu,
            "disk_mb": disk_mb, "timeout": timeout, "detach": detach, "ttl": ttl, "root": root,
            "in_process": in_process, "ksm": ksm, "no_aslr": no_aslr, "priority": priority,
            "memory_cgroup": memory_cgroup}
    raise typer.Exit(dispatch("run", opts))


@app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec_(ctx: typer.Context, sandbox_id: str, timeout: float = typer.Option(600, "--timeout"),
          root: str | None = RootOpt):
    """Run `-- CMD...` in a live sandbox."""
    from .cli_fast import dispatch

    if not ctx.args:
        raise typer.BadParameter("give a command after --")
    raise typer.Exit(dispatch("exec", {"target": sandbox_id, "cmd": list(ctx.args), "timeout": timeout,
                                       "root": root}))


@app.command()
def ps(root: str | None = RootOpt, as_json: bool = typer.Option(False, "--json"),
       quiet: bool = typer.Option(False, "--quiet", "-q", help="ids only")):
    """List live sandboxes."""
    from rich.table import Column

    infos = _backend(root).list()
    if as_json:
        console.print_json(json.dumps([i.model_dump(mode="json") for i in infos]))
        return
    if quiet:
        for i in infos:
            print(i.id)
        return
    t = Table(Column("ID", no_wrap=True), "IMAGE", "STATE", "AGE", "MEMORY", "LIMITS")
    for i in infos:
        t.add_row(i.id, i.image, i.state.value, f"{time.time() - i.created:.0f}s", _size(i.memory_bytes or 0),
                  f"{i.limits.cpu} cpu, {i.limits.memory_mb} MiB, {i.limits.disk_mb} MiB disk")
    console.print(t)


@app.command()
def kill(sandbox_ids: list[str], root: str | None = RootOpt):
    """Kill sandboxes (everything they hold is released)."""
    be = _backend(root)
    for sid in sandbox_ids:
        be.kill(sid)
        console.print(f"killed {sid}")


@app.command()
def pause(sandbox_id: str, root: str | None = RootOpt):
    """Freeze a sandbox (cgroup freezer)."""
    _backend(root).pause(sandbox_id)


@app.command()
def resume(sandbox_id: str, root: str | None = RootOpt):
    """Thaw a paused sandbox."""
    _backend(root).resume(sandbox_id)


@app.command()
def reclaim(sandbox_id: str, target: float = typer.Option(0.75, "--target", "-t",
                                                         help="fraction of anonymous memory to push out, (0, 1]"),
            root: str | None = RootOpt):
    """Push a sandbox's cold memory to compressed swap (zram); it pages back in on demand."""
    from pydantic import ValidationError

    from .core.contract import ReclaimRequest
    from .core.errors import InvalidArgument
    from .host import describe

    try:
        req = ReclaimRequest(target=target)
    except ValidationError as e:
        raise InvalidArgument(describe(e)) from None
    r = _backend(root).reclaim(sandbox_id, req)
    console.print(f"{sandbox_id}: {_size(r.memory_before)} -> {_size(r.memory_after)} in memory, "
                  f"{_size(r.swapped)} in swap ({r.duration_s * 1000:.0f} ms)")


@zram_app.command("up")
def zram_up(size_mb: int | None = typer.Option(None, "--size-mb", help="default: the config's zram_mb"),
            algorithm: str | None = typer.Option(None, "--algorithm", help="default: the config's zram_algorithm"),
            zswap_compressor: str | None = typer.Option(None, "--zswap",
                                                        help="zswap on with this compressor in front of it "
                                                             "(e.g. deflate); default: the config's zswap_compressor"),
            root: str | None = RootOpt):
    """Set up the zram swap device (what shoald does at start when zram_mb is set); idempotent."""
    from .backends.container import zram, zswap
    from .config import load_settings

    s = load_settings(root)
    cfg = zram.ZramConfig(size_mb if size_mb is not None else s.zram_mb, algorithm or s.zram_algorithm,
                          s.zram_priority)
    dev = zram.setup(cfg)
    console.print(f"{dev.path}: {dev.size_mb} MiB, {dev.algorithm}, swap priority {dev.priority}")
    comp = zswap_compressor if zswap_compressor is not None else s.zswap_compressor
    if comp:
        console.print(f"zswap on with {zswap.setup(comp)} in front of it")


@zram_app.command("status")
def zram_status():
    """The device, and how well what it holds compresses."""
    from .backends.container import zram

    dev = zram.current()
    if dev is None:
        console.print("no Shoal zram device")
        raise typer.Exit(1)
    st = dev.stats()
    console.print(f"{dev.path}: {dev.size_mb} MiB, {dev.algorithm}, priority {dev.priority}; holds "
                  f"{_size(int(st['orig_data_size']))} in {_size(int(st['mem_used_total']))} of RAM "
                  f"(ratio {st['compression_ratio']}x, {st['ratio_with_overhead']}x with overhead)")
    from .backends.container import zswap

    if zswap.current():
        zs = zswap.stats()
        console.print(f"zswap ({zswap.current()}, host-wide): holds {_size(zs['stored_bytes'])} in "
                      f"{_size(zs['pool_bytes'])} of RAM")


@zram_app.command("down")
def zram_down():
    """Swap off and remove the device (its pages come back into RAM first); zswap's settings put back."""
    from .backends.container import zram, zswap

    if zswap.teardown():
        console.print("zswap settings restored")
    console.print("removed" if zram.teardown() else "no Shoal zram device")


@app.command()
def snapshot(sandbox_id: str, exclude: list[str] | None = typer.Option(None, "--exclude", "-x",
                                                                        help="path to leave out (repeatable)"),
             root: str | None = RootOpt):
    """pack_diff: capture a sandbox's changes as a layer; prints the snapshot id."""
    from .core.contract import SnapshotRequest

    snap = _backend(root).snapshot(sandbox_id, SnapshotRequest(exclude=exclude))
    console.print(f"{snap.id}  ({len(snap.layers)} layers, {_size(snap.size)} captured)")


@app.command()
def fork(sandbox_id: str, n: int = typer.Option(1, "--n", "-n", help="number of children"),
         copy_env: bool = typer.Option(False, "--copy-env"), inherit_ttl: bool = typer.Option(False, "--inherit-ttl"),
         root: str | None = RootOpt):
    """Fork a sandbox into N children (filesystem state only); prints their ids."""
    from .sdk.sandbox import Sandbox

    res = Sandbox.connect(sandbox_id, root=root).fork(n, copy_env=copy_env, inherit_ttl=inherit_ttl)
    for sb in res.sandboxes:
        console.print(sb.id)
    for i, err in res.failed:
        err_console.print(f"[red]child {i} failed:[/red] {err}")
    if res.failed:
        raise typer.Exit(1)


@app.command()
def serve(socket: Path | None = typer.Option(None, "--socket", envvar="SHOAL_SOCKET",
                                                help="Unix socket (default /run/shoal/shoald.sock)"),
          group: str = typer.Option("shoal", "--group", help="group allowed on the socket (created if missing)"),
          tcp: str | None = typer.Option(None, "--tcp", help="also listen on HOST:PORT (needs TLS; keys only)"),
          tls_cert: Path | None = typer.Option(None, "--tls-cert"),
          tls_key: Path | None = typer.Option(None, "--tls-key"),
          max_sandboxes: int = typer.Option(1024, "--max-sandboxes"),
          max_starting: int = typer.Option(32, "--max-starting", help="cap on sandboxes being created at once"),
          creates_per_s: float = typer.Option(200.0, "--creates-per-s", help="creation rate limit"),
          log_level: str = typer.Option("warning", "--log-level"),
          join: str | None = typer.Option(None, "--join", envvar="SHOAL_FLEET_DB",
                                          help="join a fleet: its PostgreSQL URL (postgresql://...)"),
          advertise: str | None = typer.Option(None, "--advertise",
                                               help="with --join: the URL gateways reach this host at "
                                                    "(https://HOST:PORT; also where --tcp listens by default)"),
          domain: str = typer.Option("", "--domain", help="with --join: this host's failure domain (rack, zone)"),
          client_ca: Path | None = typer.Option(None, "--client-ca",
                                                help="with --join: the fleet CA (ca.pem); only its gateways may call"),
          lease: float = typer.Option(10.0, "--lease", help="with --join: seconds a heartbeat keeps this host alive"),
          root: str | None = RootOpt):
    """Run shoald, the host daemon (as root): HTTP API on a Unix socket for the `shoal` group (and
    optionally TCP+TLS). Root on the socket is the admin; other group members are tenants by uid.
    With --join it is also a fleet host: registered in the fleet's database, serving its gateways."""
    from .server.admission import AdmissionConfig
    from .server.server import FleetJoin
    from .server.server import serve as run

    fleet = None
    if join:
        if not (advertise and client_ca):
            raise ShoalError("--join needs --advertise https://HOST:PORT and --client-ca (the fleet's ca.pem)")
        fleet = FleetJoin(dsn=join, advertise=advertise, client_ca=str(client_ca), domain=domain, lease_s=lease)
    run(root, socket, tcp, str(tls_cert) if tls_cert else None, str(tls_key) if tls_key else None,
        AdmissionConfig(max_sandboxes=max_sandboxes, max_starting=max_starting, creates_per_s=creates_per_s),
        log_level=log_level, group=group, fleet=fleet)


@app.command()
def gateway(db: str = typer.Option(..., "--db", envvar="SHOAL_FLEET_DB", help="the fleet's PostgreSQL URL"),
            listen: str = typer.Option("127.0.0.1:8080", "--listen", help="HOST:PORT"),
            fleet_dir: Path | None = typer.Option(None, "--fleet-dir", envvar="SHOAL_FLEET_DIR",
                                                  help="from `shoal fleet init`: CA, gateway certificate, admin key"),
            tls_cert: Path | None = typer.Option(None, "--tls-cert", help="the gateway's own server certificate"),
            tls_key: Path | None = typer.Option(None, "--tls-key"),
            log_level: str = typer.Option("warning", "--log-level")):
    """Run a fleet gateway: the same /v1 API as shoald, over every host of the fleet. Stateless: run
    as many replicas as you like against one database."""
    from .fleet.gateway import serve_gateway

    serve_gateway(db, listen, str(fleet_dir) if fleet_dir else None, str(tls_cert) if tls_cert else None,
                  str(tls_key) if tls_key else None, log_level=log_level)


@fleet_app.command("init")
def fleet_init(directory: Path = typer.Option(..., "--dir", help="where the CA and the gateway's files go"),
               force: bool = typer.Option(False, "--force", help="replace an existing CA")):
    """A new fleet CA, the gateways' client certificate and the fleet admin key (keys 0600)."""
    from .fleet.pki import init_fleet

    files = init_fleet(directory, force=force)
    console.print(f"fleet CA {files.ca_cert}; gateway certificate {files.gateway_cert}; admin key {files.admin_key}")


@fleet_app.command("cert")
def fleet_cert(name: str = typer.Argument(..., help="the host's name (its certificate's CN and file names)"),
               directory: Path = typer.Option(..., "--dir", help="the fleet directory (`shoal fleet init`)"),
               san: list[str] = typer.Option(..., "--san", help="a DNS name or IP address gateways use for it"),
               out: Path = typer.Option(..., "--out", help="directory for NAME.pem and NAME.key")):
    """Issue a server certificate (a host's, or a gateway's client-facing one) from the fleet CA."""
    from .fleet.pki import issue_server_cert

    cert, key = issue_server_cert(directory, name, san, out)
    console.print(f"{cert} {key}")


@fleet_app.command("hosts")
def fleet_hosts(db: str = typer.Option(..., "--db", envvar="SHOAL_FLEET_DB")):
    """The fleet's hosts: address, failure domain, state, lease left, load."""
    from .fleet.directory import Directory
    from .fleet.schema import open_db

    t = Table("HOST", "ADDRESS", "DOMAIN", "STATE", "LEASE LEFT", "SANDBOXES", "REASON")
    for h in Directory(open_db(db)).hosts():
        t.add_row(h["id"], h["address"], h["domain"], h["state"], f"{h['lease_left_s']:.1f} s",
                  f"{h['load'].get('sandboxes', 0)}/{h['capacity'].get('sandboxes', 0)}", h["reason"] or "")
    console.print(t)


def _admin_client(root: str | None):
    """shoald as the admin: root on its socket needs no key ($SHOAL_API_KEY may hold the admin key)."""
    from .backends.http import client_for

    return client_for(None, None, root)


@tenant_app.command("create")
def tenant_create(name: str, sandboxes: int = typer.Option(100, "--sandboxes"), cpu: float = typer.Option(64, "--cpu"),
                  memory_mb: int = typer.Option(65536, "--memory-mb"), disk_mb: int = typer.Option(262144, "--disk-mb"),
                  root: str | None = RootOpt):
    """Create a tenant; prints its API key once (only a hash is stored)."""
    r = _admin_client(root).json("POST", "/tenants", json={"name": name, "quotas": {
        "sandboxes": sandboxes, "cpu": cpu, "memory_mb": memory_mb, "disk_mb": disk_mb}})
    console.print(r["api_key"])


@tenant_app.command("ls")
def tenant_ls(root: str | None = RootOpt):
    """List tenants with quotas and current usage."""
    t = Table("TENANT", "SANDBOXES", "CPU", "MEMORY MiB", "DISK MiB")
    for x in _admin_client(root).json("GET", "/tenants"):
        q, u = x["quotas"], x["usage"]
        t.add_row(x["name"], f"{u['sandboxes']:g}/{q['sandboxes']:g}", f"{u['cpu']:g}/{q['cpu']:g}",
                  f"{u['memory_mb']:g}/{q['memory_mb']:g}", f"{u['disk_mb']:g}/{q['disk_mb']:g}")
    console.print(t)


@tenant_app.command("rm")
def tenant_rm(name: str, root: str | None = RootOpt):
    """Delete a tenant (its key stops working)."""
    _admin_client(root).call("DELETE", f"/tenants/{name}")
    console.print(f"removed {name}")


@app.command()
def gc(root: str | None = RootOpt):
    """Reap dead sandboxes, unmount unused layers, delete layers no image or name references."""
    res = _host(root).gc()
    console.print(f"reaped {len(res['sandboxes_reaped'])} sandboxes, unmounted {len(res['unmounted'])} layers, "
                  f"removed {len(res['removed'])} layers")


def _log(db: Path):
    from .trajlog import TrajectoryLog

    if not db.exists():
        raise ShoalError(f"no trajectory log at {db}")
    return TrajectoryLog(db)


@traj_app.command("query")
def traj_query(db: Path = typer.Argument(..., help="the log (e.g. runs/rollout.traj.db)"),
               episode: str | None = typer.Option(None), sandbox: str | None = typer.Option(None),
               kind: str | None = typer.Option(None), limit: int = typer.Option(200),
               as_json: bool = typer.Option(False, "--json")):
    """Provenance: entries filtered by episode / sandbox / kind, in time order."""
    import json
    import time as _time

    rows = _log(db).query(episode=episode, sandbox=sandbox, kind=kind, limit=limit)
    if as_json:
        console.print_json(json.dumps([{**e.__dict__, "request_json": None} for e in rows], default=str))
        return
    t = Table(title=f"{len(rows)} entries")
    for c in ("when", "stream", "seq", "kind", "status", "sandbox", "host", "request"):
        t.add_column(c, overflow="fold")
    for e in rows:
        t.add_row(_time.strftime("%H:%M:%S", _time.localtime(e.started)), e.stream, str(e.seq), e.kind, e.status,
                  e.sandbox or "", e.host or "", json.dumps(e.request)[:80])
    console.print(t)


@traj_app.command("streams")
def traj_streams(db: Path = typer.Argument(...), episode: str | None = typer.Option(None)):
    """Streams in the log (one per sandbox and per episode's model calls)."""
    log = _log(db)
    t = Table()
    for c in ("stream", "episode", "entries", "sandbox now", "layers"):
        t.add_column(c)
    for si in log.store.streams(episode):
        t.add_row(si.stream, si.episode or "", str(len(log.history(si.stream))), str(si.meta.get("sandbox", "")),
                  " ".join(d.split(":")[-1][:12] for d in si.layers))
    console.print(t)


@traj_app.command("tree")
def traj_tree(db: Path = typer.Argument(..., help="the log (e.g. runs/rollout.traj.db)"),
              episode: str = typer.Argument(..., help="an episode id; its whole tree is shown"),
              as_json: bool = typer.Option(False, "--json")):
    """Branches of an episode (rollout.branch): each branch, the step it left its parent at, its length."""
    import json

    from rich.tree import Tree

    from .rollout.branch import BranchNode, Episode

    ep = Episode(_log(db), episode)
    top = ep.root()
    node = top.tree()
    if as_json:
        console.print_json(json.dumps(node.to_dict()))
        return

    def label(n: BranchNode) -> str:
        at = f" [dim]from step {n.step}[/dim]" if n.step is not None else ""
        me = " [bold]<-[/bold]" if n.episode == episode else ""
        return f"[cyan]{n.episode}[/cyan]{at}  {n.steps} steps{me}"

    def grow(t: Tree, n: BranchNode) -> None:
        for c in n.children:
            grow(t.add(label(c)), c)

    out = Tree(label(node))
    grow(out, node)
    console.print(out)


@traj_app.command("replay")
def traj_replay(db: Path = typer.Argument(...), stream: str = typer.Argument(..., help="e.g. EPISODE/sandbox"),
                root: str | None = RootOpt):
    """Deterministic replay: re-run a recorded stream into a fresh sandbox and compare every result."""
    from .trajlog import replay

    rep, _ = replay(_log(db), stream, root=root)
    console.print(f"replayed {rep.ops} ops in {rep.seconds:.2f} s into {rep.sandbox}: {rep.matched} identical, "
                  f"{len(rep.mismatches)} different, {rep.skipped} skipped (UNKNOWN)")
    for m in rep.mismatches[:20]:
        console.print(f"  seq {m['seq']} {m['kind']}: {m['field']} logged={str(m['logged'])[:60]!r} "
                      f"replayed={str(m['replayed'])[:60]!r}")
    if rep.mismatches:
        raise typer.Exit(1)


def main() -> None:
    """Entry point: Shoal's typed errors become one red line and exit status 2, not a traceback."""
    try:
        app()
    except ShoalError as e:
        err_console.print(f"[red]error:[/red] {e}")
        sys.exit(2)


if __name__ == "__main__":
    from .cli_fast import main as entry  # `python -m shoal.cli` behaves as the `shoal` command

    entry()
