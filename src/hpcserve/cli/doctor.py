"""`hpcserve doctor CONFIG [--site FILE] [--json]`: a thin typer layer over run_doctor (mounted by
hpcserve.cli.main). Exit code 2 when a blocker was found."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer
from rich.console import Console

from hpcserve.core.errors import HpcserveError
from hpcserve.doctor.diagnose import run_doctor
from hpcserve.doctor.findings import exit_code
from hpcserve.doctor.report import findings_json, findings_table, summary_line
from hpcserve.site.files import load_with_site

SiteOption = typer.Option(None, "--site", help="YAML file with the site section (runtime, image, "
                          "container_command, binds, gres); replaces the config's site:", show_default=False)


def doctor(config: Path = typer.Argument(..., help="deployment YAML", show_default=False),
           site: Path | None = SiteOption,
           as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Tell what is missing or wrong on this site before anything is submitted: Slurm's commands and
    controller, partition, GRES, account/QOS, the batch script (sbatch --test-only), and from inside the
    compute nodes (one short srun step): the model folder, Ray/vLLM imports, the serving port.
    Exit code 2 on a blocker, 0 otherwise (warnings allowed)."""
    out = Console(soft_wrap=True)
    try:
        cfg = load_with_site(config, site)
        with out.status("checking the login node and probing the compute nodes", spinner="dots") if not as_json \
                else contextlib.nullcontext():
            findings = run_doctor(cfg)
    except HpcserveError as exc:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(exc.exit_code)
    if as_json:
        print(findings_json(findings))
    else:
        out.print(findings_table(findings, f"hpcserve doctor: {cfg.name} ({cfg.cluster.scheduler}, site "
                                           f"{cfg.site.runtime}{'' if cfg.site.gres else ', no GRES'})"))
        out.print(summary_line(findings), highlight=False)
    raise typer.Exit(exit_code(findings))
