"""The doctor's findings for people (a table that reads at 80 columns, each finding and its fix in
full below it) and for programs (JSON)."""

from __future__ import annotations

import json

from rich.console import RenderableType

from hpcserve.core.tables import narrow_table, with_lines
from hpcserve.doctor.findings import Finding, Severity, exit_code

STYLE = {Severity.BLOCKER: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan", Severity.OK: "green"}


def findings_table(findings: list[Finding], title: str) -> RenderableType:
    table = narrow_table(title, "#", "severity", "check", left=("severity", "check"))
    lines = []
    for number, f in enumerate(findings, start=1):
        table.add_row(str(number), f"[{STYLE[f.severity]}]{f.severity.value}[/]", f.check)
        lines.append(f"[{number}] {f.what}" + (f"\n    fix: {f.fix}" if f.fix else ""))
    return with_lines(table, lines)


def summary_line(findings: list[Finding]) -> str:
    counts = {s: sum(1 for f in findings if f.severity is s) for s in Severity}
    verdict = "blocked: fix the blockers before `hpcserve up`" if exit_code(findings) else "ready to submit"
    return (f"{counts[Severity.BLOCKER]} blocker(s), {counts[Severity.WARNING]} warning(s), "
            f"{counts[Severity.OK]} ok: {verdict}")


def findings_json(findings: list[Finding]) -> str:
    return json.dumps({"exit_code": exit_code(findings), "findings": [f.to_dict() for f in findings]}, indent=2)
