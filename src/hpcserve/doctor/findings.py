"""One finding of the doctor: how bad, which check, what is wrong, and the fix."""

from __future__ import annotations

import enum
from dataclasses import dataclass

BLOCKER_EXIT = 2


class Severity(str, enum.Enum):
    OK = "ok"
    INFO = "info"          # could not be checked here, or worth knowing
    WARNING = "warning"    # may fail, or works badly
    BLOCKER = "blocker"    # the deployment would fail: fix before `hpcserve up`


@dataclass(frozen=True)
class Finding:
    severity: Severity
    check: str             # short name: commands, controller, partition, gres, account, qos, model, ...
    what: str              # what was found, with the values
    fix: str = ""          # what to do about it ("" for ok)

    def to_dict(self) -> dict:
        return {"severity": self.severity.value, "check": self.check, "what": self.what, "fix": self.fix}


def ok(check: str, what: str) -> Finding:
    return Finding(Severity.OK, check, what)


def blocker(check: str, what: str, fix: str) -> Finding:
    return Finding(Severity.BLOCKER, check, what, fix)


def warning(check: str, what: str, fix: str) -> Finding:
    return Finding(Severity.WARNING, check, what, fix)


def info(check: str, what: str, fix: str = "") -> Finding:
    return Finding(Severity.INFO, check, what, fix)


def exit_code(findings: list[Finding]) -> int:
    return BLOCKER_EXIT if any(f.severity is Severity.BLOCKER for f in findings) else 0
