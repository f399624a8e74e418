"""Tenancy as one deployment runs it: the config's tenancy section with its database resolved, handed from
the controller to every data-plane worker as a JSON file (never a command line: the file may name a host
and user, and it is the one place both sides read)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hpcserve.core.config import DeploymentConfig, LimitsSpec
from hpcserve.tenancy.records import Limits

DATABASE_SUFFIX = "-tenancy.sqlite"


@dataclass(frozen=True)
class TenancySettings:
    database: str  # postgresql://... or an SQLite file's absolute path
    limits: Limits = Limits()
    usage_flush_s: float = 1.0
    shares: dict[str, float] = field(default_factory=dict)
    pause_streams: bool = True

    @classmethod
    def from_config(cls, cfg: DeploymentConfig, results: Path) -> TenancySettings:
        spec = cfg.tenancy
        return cls(database_url(cfg, results), limits_of(spec.limits), spec.usage_flush_s, dict(spec.shares),
                   spec.pause_streams)

    @classmethod
    def read(cls, path: Path) -> TenancySettings:
        data = json.loads(path.read_text())
        return cls(data["database"], Limits(**data.get("limits") or {}), float(data.get("usage_flush_s", 1.0)),
                   {str(k): float(v) for k, v in (data.get("shares") or {}).items()},
                   bool(data.get("pause_streams", True)))

    def to_json(self) -> dict:
        return {"database": self.database, "limits": self.limits.__dict__, "usage_flush_s": self.usage_flush_s,
                "shares": self.shares, "pause_streams": self.pause_streams}


def database_url(cfg: DeploymentConfig, results: Path) -> str:
    """Where the deployment's keys and usage live: tenancy.database (a relative SQLite path is taken from the
    results folder), else RESULTS/NAME-tenancy.sqlite, kept across `down` and `up`."""
    configured = cfg.tenancy.database
    if configured and configured.startswith(("postgresql://", "postgres://")):
        return configured
    path = Path(configured.removeprefix("sqlite://")) if configured else Path(cfg.name + DATABASE_SUFFIX)
    return str(path if path.is_absolute() else results / path)


def limits_of(spec: LimitsSpec) -> Limits:
    """The config's limits as a record's. Pure."""
    return Limits(**{name: getattr(spec, name) for name in Limits.__dataclass_fields__})


def tenancy_on(cfg: DeploymentConfig) -> bool:
    """Users' keys need the deployment's own key to stand beside: an open endpoint has no tenants."""
    return cfg.tenancy.enabled and not cfg.serve.insecure_no_api_key
