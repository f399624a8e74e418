"""The doctor's findings for people (a rich table) and for programs (JSON)."""

from __future__ import annotations

import json

from rich.table import Table

from hpcserve.doctor.findings import Finding, Severity, exit_code

STYLE = {Severity.BLOCKER: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan", Severity.OK: "green"}


def findings_table(findings: list[Finding], title: str) -> Table:
    table = Table(title=title, show_lines=False)
    for column in ("severity", "check", "finding", "fix"):
        table.add_column(column, overflow="fold")
    for f in findings:
        table.add_row(f"[{STYLE[f.severity]}]{f.severity.value}[/]", f.check, f.what, f.fix or "-")
    return table


def summary_line(findings: list[Finding]) -> str:
    counts = {s: sum(1 for f in findings if f.severity is s) for s in Severity}
    verdict = "blocked: fix the blockers before `hpcserve up`" if exit_code(findings) else "ready to submit"
    return (f"{counts[Severity.BLOCKER]} blocker(s), {counts[Severity.WARNING]} warning(s), "
            f"{counts[Severity.OK]} ok: {verdict}")


def findings_json(findings: list[Finding]) -> str:
    return json.dumps({"exit_code": exit_code(findings), "findings": [f.to_dict() for f in findings]}, indent=2)
