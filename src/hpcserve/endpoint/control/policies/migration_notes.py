"""The data plane's migrations in the controller's decisions: each round, the streams it moved to
another replica since the last round, and those it could not move, one decision each.

    migrate        sb-m0's http://10.0.0.5:8001 -> http://10.0.0.6:8001: a chat stream after 37 token(s) (handover)
    not migrated   http://10.0.0.5:8001: a completion stream after 12 token(s) (broken): no other replica can take it
"""

from __future__ import annotations

import time

from hpcserve.endpoint.control.policies.base import ControlPlane
from hpcserve.endpoint.protocol import Migration


def describe(migration: Migration) -> tuple[str, str]:
    """The decision (action, reason) for one entry of the data plane's GET /migrations. Pure."""
    what = f"a {migration.kind} stream after {migration.tokens} token(s) ({migration.cause})"
    if migration.to:
        return "migrate", f"{migration.source} -> {migration.to}: {what}"
    return "not migrated", f"{migration.source}: {what}: {migration.reason}"


class MigrationNotes:
    """A policy that decides nothing: it writes down what the data plane did."""

    name = "migrations"

    def __init__(self, since: float | None = None):
        self.since = time.time() if since is None else since

    def step(self, ctl: ControlPlane) -> None:
        for migration in map(Migration.from_json, ctl.pool.router.migrations(self.since)):
            self.since = max(self.since, migration.time)
            ctl.decide(*describe(migration))

    def forget(self, url: str) -> None:
        pass
