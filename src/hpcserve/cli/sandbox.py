"""`hpcserve sandbox ...`: a real multi-node Slurm cluster on this machine, to try hpcserve without one."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import wraps
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from hpcserve.core.errors import HpcserveError
from hpcserve.core.tables import narrow_table
from hpcserve.sandbox.cluster import Sandbox, SandboxStatus
from hpcserve.sandbox.packages import PACKAGES, install_packages

app = typer.Typer(
    help=(
        "A real multi-node Slurm cluster on this one machine, for trying hpcserve and for tests.\n\n"
        "Each node is a set of Linux namespaces with its own hostname, IP address (198.18.0.11, .12, "
        "...), processes and fake GPUs; this machine is the login node where sbatch and squeue run. "
        "Needs root. Typical use:\n\n"
        "  hpcserve sandbox up --nodes 2\n\n"
        "  eval \"$(hpcserve sandbox env)\"; sbatch -N2 --wrap 'srun hostname'\n\n"
        "  hpcserve sandbox down"
    ),
    no_args_is_help=True,
)
console = Console()
err_console = Console(stderr=True)


def reports_errors(command: Callable) -> Callable:
    """Print hpcserve errors as one clear message (no traceback) and exit with their exit code."""

    @wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except HpcserveError as exc:
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
            raise typer.Exit(exc.exit_code) from None

    return wrapper


def print_status(status: SandboxStatus) -> None:
    table = narrow_table(f"sandbox {'healthy' if status.healthy else 'NOT healthy'}", "host", "address",
                         "daemon pid", "slurm state", left=("host", "address", "slurm state"))
    for host in [status.controller, *status.nodes]:
        table.add_row(host.name, host.address, str(host.daemon_pid or "-"), host.state)
    console.print(table)
    console.print(f"munged pid: {status.munged_pid or '-'}\nroot: {status.root}\nSLURM_CONF={status.slurm_conf}",
                  highlight=False, soft_wrap=True)


@app.command()
@reports_errors
def up(
    nodes: Annotated[int, typer.Option(help="Number of compute nodes (hsn1..hsnN).")] = 3,
    gpus_per_node: Annotated[int, typer.Option(help="Fake GPUs per node (Slurm GRES gpu; jobs see "
                                               "CUDA_VISIBLE_DEVICES).")] = 2,
    cpus_per_node: Annotated[int, typer.Option(help="CPUs each node advertises to Slurm (may "
                                               "exceed the real cores).")] = 4,
    net: Annotated[str, typer.Option(help="First three octets of the sandbox's /24: the login "
                                     "node is .1, the controller .10, nodes .11 and up.")]
    = "198.18.0",
) -> None:
    """Start the cluster and wait until every node is idle.

    Installs the Slurm and munge packages first if they are missing.

    On a healthy sandbox with the same settings `up` changes nothing; otherwise it rebuilds it.
    """
    sandbox = Sandbox(nodes=nodes, gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node,
                      net=net)
    started = time.monotonic()
    sandbox.up()
    print_status(sandbox.status())
    console.print(f"up in {time.monotonic() - started:.1f} s. Use it from this shell with:\n"
                  f"  eval \"$(hpcserve sandbox env)\"", highlight=False)


@app.command()
@reports_errors
def install() -> None:
    """Install the Debian packages the sandbox needs (Slurm, munge, iproute2) unless they are there.

    `up` does this itself; run it first where several sandboxes will start at once (parallel tests).
    """
    install_packages()
    console.print(f"installed: {' '.join(PACKAGES)}", highlight=False)


@app.command()
@reports_errors
def down() -> None:
    """Stop every process of the sandbox and delete its namespaces and interfaces (logs are kept)."""
    sandbox = Sandbox.load()
    started = time.monotonic()
    sandbox.down()
    console.print(f"down in {time.monotonic() - started:.1f} s (logs kept in {sandbox.root}/log)",
                  highlight=False)


@app.command()
@reports_errors
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Show each host: address, daemon PID and the state Slurm reports (idle, idle* = not responding)."""
    current = Sandbox.load().status()
    if as_json:
        print(json.dumps(current.to_dict(), indent=2))
    else:
        print_status(current)


@app.command("kill-node")
@reports_errors
def kill_node(node: Annotated[str, typer.Argument(help="Node name, e.g. hsn2.")]) -> None:
    """Crash NODE: kill every process on it at once. Slurm notices after about 10 s; jobs on it fail."""
    Sandbox.load().kill_node(node)
    console.print(f"killed {node}; bring it back with `hpcserve sandbox start-node {node}`")


@app.command("start-node")
@reports_errors
def start_node(node: Annotated[str, typer.Argument(help="Node name, e.g. hsn2.")]) -> None:
    """Boot NODE again (after kill-node or a dead slurmd) and wait until Slurm reports it idle."""
    Sandbox.load().start_node(node)
    console.print(f"{node} is idle again")


@app.command()
@reports_errors
def env() -> None:
    """Print the shell line that points Slurm commands at the sandbox: eval "$(hpcserve sandbox env)"."""
    for key, value in Sandbox.load().env().items():
        print(f"export {key}={value}")


if __name__ == "__main__":
    app()
