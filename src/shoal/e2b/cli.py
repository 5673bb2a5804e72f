"""`shoal e2b serve|key|templates`: the E2B-compatible endpoint from the command line."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from .templates import BASE_RECIPE, parse_template_args

e2b_app = typer.Typer(help="An E2B-compatible endpoint: the unmodified `e2b` SDK against Shoal (docs/e2b.md).",
                      no_args_is_help=True)
key_app = typer.Typer(help="E2B API keys (e2b_...), each mapped to a tenant.", no_args_is_help=True)
e2b_app.add_typer(key_app, name="key")
console = Console()

RootOpt = typer.Option(None, "--root", envvar="SHOAL_ROOT", help="Shoal state root (default /var/lib/shoal)")
KeysOpt = typer.Option(None, "--keys", help="the key file (default <root>/e2b-keys.json)")
TemplateOpt = typer.Option([], "--template", help="NAME=IMAGE: serve an image as an E2B template (repeatable)")


def _keys(keys: Path | None, root: str | None):
    from .app import default_keys_path
    from .state import Keys

    return Keys(keys or default_keys_path(root))


@e2b_app.command("serve")
def serve(listen: str = typer.Option("127.0.0.1:3000", "--listen", help="HOST:PORT"),
          url: str | None = typer.Option(None, "--url", envvar="SHOAL_URL",
                                         help="the Shoal backend: 'local' (in this process, root) or shoald's URL"),
          api_key: str | None = typer.Option(None, "--shoal-key", envvar="SHOAL_API_KEY",
                                             help="key for shoald (when --url is a daemon)"),
          template: list[str] = TemplateOpt, keys: Path | None = KeysOpt, root: str | None = RootOpt,
          state: Path | None = typer.Option(None, "--state", help="the sandbox index (SQLite): a restarted front "
                                                                 "finds its sandboxes (default <root>/e2b-state.db)"),
          memory_only: bool = typer.Option(False, "--memory-only", help="keep the index in memory only"),
          tls_cert: Path | None = typer.Option(None, "--tls-cert", help="PEM certificate: serve https"),
          tls_key: Path | None = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert"),
          max_sandboxes: int = typer.Option(100, "--max-sandboxes", help="live sandboxes per tenant (0: no limit)"),
          max_streams: int = typer.Option(64, "--max-streams", help="open output/watch streams per tenant"),
          max_processes: int = typer.Option(64, "--max-processes", help="running background processes per sandbox"),
          max_watchers: int = typer.Option(16, "--max-watchers", help="polling watchers per sandbox"),
          max_port_connections: int = typer.Option(64, "--max-port-connections",
                                                   help="open proxied connections to sandbox ports per tenant"),
          port_timeout: float = typer.Option(60.0, "--port-timeout", min=0.1,
                                             help="seconds a sandbox port has to answer a request's head (504)"),
          domain: str | None = typer.Option(None, "--domain", envvar="SHOAL_E2B_DOMAIN",
                                            help="get_host's domain (the SDK's E2B_DOMAIN): only PORT-ID.DOMAIN "
                                                 "hosts reach sandbox ports, other such names are refused"),
          sandbox_backend: str | None = typer.Option(None, "--sandbox-backend",
                                                     help="isolation of new sandboxes: container or gvisor "
                                                          "(default: the Shoal host's)"),
          log_level: str = typer.Option("warning", "--log-level")):
    """Serve E2B's control plane and envd on one address: set E2B_API_URL and E2B_SANDBOX_URL to http://LISTEN."""
    from ..backends import open_backend
    from ..config import load_settings
    from .app import serve as run
    from .front import Limits

    host, _, port = listen.rpartition(":")
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("--tls-cert and --tls-key go together")
    if tls_cert is None and not is_loopback(host or "127.0.0.1"):
        # API keys and every sandbox's access token travel in headers: never in clear off this host
        raise typer.BadParameter(f"{listen} is not a loopback address: give --tls-cert and --tls-key",
                                 param_hint="--listen")
    if domain:
        from .ports import normal_domain

        try:
            domain = normal_domain(domain)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--domain") from None
    backend = open_backend(url, api_key, root)
    k = _keys(keys, root)
    scheme = "https" if tls_cert else "http"
    console.print(f"E2B front on {scheme}://{listen} ({len(k.tenants())} tenants); "
                  f"E2B_API_URL=E2B_SANDBOX_URL={scheme}://{listen}")
    run(backend, k, host=host or "127.0.0.1", port=int(port), templates=parse_template_args(template),
        log_level=log_level, state=None if memory_only else state or load_settings(root).root / "e2b-state.db",
        tls=(str(tls_cert), str(tls_key)) if tls_cert and tls_key else None,
        limits=Limits(sandboxes=max_sandboxes, streams=max_streams, processes=max_processes, watchers=max_watchers,
                      ports=max_port_connections, port_answer_s=port_timeout), domain=domain,
        sandbox_backend=sandbox_backend)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost (a name that resolves elsewhere would be a lie we cannot check)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@key_app.command("create")
def key_create(tenant: str = typer.Argument(..., help="tenant the key acts as"), keys: Path | None = KeysOpt,
               root: str | None = RootOpt):
    """Make an API key (printed once; stored hashed)."""
    print(_keys(keys, root).create(tenant))


@key_app.command("list")
def key_list(keys: Path | None = KeysOpt, root: str | None = RootOpt):
    """Tenants and how many keys each has."""
    for tenant, n in sorted(_keys(keys, root).tenants().items()):
        console.print(f"{tenant}\t{n} key(s)")


@key_app.command("revoke")
def key_revoke(tenant: str = typer.Argument(...), keys: Path | None = KeysOpt, root: str | None = RootOpt):
    """Remove every key of a tenant."""
    console.print(f"revoked {_keys(keys, root).revoke_tenant(tenant)} key(s) of {tenant}")


@e2b_app.command("templates")
def templates(template: list[str] = TemplateOpt,
              build: bool = typer.Option(False, "--build", help="build `base` (e2b-base:latest) from its recipe"),
              recipe: bool = typer.Option(False, "--recipe", help="print the `base` recipe"),
              interpreter: bool = typer.Option(False, "--build-code-interpreter",
                                               help="build `code-interpreter` (e2b-code-interpreter:latest)"),
              root: str | None = RootOpt):
    """The templates the front serves (NAME -> image); --build makes `base` on this host."""
    if recipe:
        print(BASE_RECIPE.strip())
        return
    if build:
        from ..host import Host
        from .templates import build_base

        img = build_base(Host.get(root), log=lambda line: console.print(line.rstrip(), markup=False))
        console.print(f"built {img.ref}")
    if interpreter:
        from ..host import Host
        from .templates import build_code_interpreter

        img = build_code_interpreter(Host.get(root), log=lambda line: console.print(line.rstrip(), markup=False))
        console.print(f"built {img.ref}")
    for name, image in sorted(parse_template_args(template).items()):
        console.print(f"{name}\t{image}")
