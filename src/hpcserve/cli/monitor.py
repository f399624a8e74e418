"""`hpcserve monitor NAME`: a thin typer layer over MonitorServer (mounted by hpcserve.cli.main)."""

from __future__ import annotations

import typer
from rich.console import Console

from hpcserve import api
from hpcserve.core.errors import HpcserveError
from hpcserve.monitoring.server import MonitorServer

err = Console(stderr=True)


def monitor(name: str = typer.Argument(..., help="deployment name (the 'name' in its config)", show_default=False),
            host: str = typer.Option("127.0.0.1", help="address to bind; /api/status and /metrics require the "
                                     "deployment's API key on every address, loopback included"),
            port: int = typer.Option(9400, min=0, max=65535, help="port to listen on (0: any free port)")):
    """Serve a live dashboard (/), its JSON (/api/status) and Prometheus metrics (/metrics) for a deployment."""
    try:
        api.load_record(name)  # an unknown name fails now, with the known ones listed
        key = api.api_key_for(name)
        server = MonitorServer(api.gatherer(name), host, port, key)
    except HpcserveError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code)
    if key:
        guard = "the deployment's API key is required: open /#key=KEY"
    else:
        guard = "WARNING: the deployment has no API key, anyone who can reach this port reads these metrics"
    print(f"monitoring {name} at {server.url}/  (metrics: {server.url}/metrics; {guard}); Ctrl-C to stop", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":  # python -m hpcserve.cli.monitor NAME (what tests run; users run `hpcserve monitor`)
    typer.run(monitor)
