"""What every `hpcserve` command shares: the consoles, the arguments named alike everywhere, and one way
to turn hpcserve's errors into one message and an exit code."""

from __future__ import annotations

import functools

import typer
from rich.console import Console

from hpcserve.core.errors import HpcserveError

console = Console(soft_wrap=True)  # paths and URLs stay whole when piped into logs
err = Console(stderr=True, soft_wrap=True)

ConfigArg = typer.Argument(..., help="deployment YAML (see examples/local.yaml)", show_default=False)
NameArg = typer.Argument(..., help="deployment name (the 'name' in its config)", show_default=False)
SiteOption = typer.Option(None, "--site", help="YAML file with the site section (runtime, image, container_command, "
                          "binds, gres); replaces the config's site:", show_default=False)


def fail(exc: HpcserveError) -> None:
    err.print(f"[bold red]error:[/] {exc}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(exc.exit_code)


def guarded(func):
    """Turn hpcserve's errors into one clear message and an exit code, never a traceback."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except HpcserveError as exc:
            fail(exc)
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130)

    return wrapper
