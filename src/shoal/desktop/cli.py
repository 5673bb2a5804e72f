"""`shoal desktop ...`: desktop sandboxes from the command line (its own module, like the E2B and
FLARE command groups)."""
from __future__ import annotations

import typer

desktop_app = typer.Typer(help="Desktop sandboxes: watch one over VNC.", no_args_is_help=True)


@desktop_app.command("vnc")
def vnc(sandbox_id: str, port: int = typer.Option(0, "--port", help="local port (default: a free one)"),
        root: str | None = typer.Option(None, "--root", envvar="SHOAL_ROOT", help="with SHOAL_URL=local")):
    """Serve the sandbox's screen over VNC on this machine's loopback (Shoal's own x11vnc in the
    sandbox, through the port tunnel) and print the `vncviewer` command and the session's password
    (fresh for each run); runs until interrupted."""
    from ..backends import open_backend
    from ..envs.sandboxes import attach
    from .vnc import VncForward

    sb = attach(open_backend(None, None, root), sandbox_id)
    fwd = VncForward(sb, port)
    typer.echo(fwd.command, err=False)
    # to the terminal of the person who asked, only: never to a log
    typer.echo(f"password: {fwd.password}", err=False)
    typer.echo(f"(serving {sandbox_id}'s display on 127.0.0.1:{fwd.port}; Ctrl-C stops)", err=True)
    try:
        fwd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        fwd.close()
