"""`hpcserve keys ...` and `hpcserve usage`: users' own keys, and who used what (mounted by hpcserve.cli.main).
DEPLOYMENT is a deployment's name (one `up` started) or its config file."""

from __future__ import annotations

import csv
import sys
import time

import typer

from hpcserve import api
from hpcserve.cli.common import console, err, guarded
from hpcserve.core.tables import narrow_table
from hpcserve.tenancy.keyring import parse_when
from hpcserve.tenancy.records import KeyRecord, Limits
from hpcserve.tenancy.selfservice import request_key
from hpcserve.tenancy.store import GroupBy

app = typer.Typer(help="Users' own keys for an endpoint: each shown once, stored as a salted hash, with limits and "
                  "an end; revoked keys are refused on every data-plane worker within 1 s.", no_args_is_help=True)
DeploymentArg = typer.Argument(..., help="the deployment's name, or its config file", show_default=False)


@app.command("add")
@guarded
def add(user: str = typer.Argument(..., help="who the key is for (a Unix or e-mail name)", show_default=False),
        deployment: str = typer.Option(..., "--deployment", "-d", help="the deployment's name, or its config file",
                                       show_default=False),
        project: str | None = typer.Option(None, help="what the usage is reported under (a Slurm account, a grant)"),
        models: list[str] | None = typer.Option(None, "--model", help="a model the key may use (repeat); "
                                                "default: all"),
        rpm: int | None = typer.Option(None, min=1, help="requests per minute"),
        tpm: int | None = typer.Option(None, min=1, help="tokens per minute (prompt + completion)"),
        tpd: int | None = typer.Option(None, min=1, help="tokens per UTC day"),
        max_n: int | None = typer.Option(None, min=1, help="the most choices (n) of one request"),
        max_best_of: int | None = typer.Option(None, min=1, help="the largest best_of of one request"),
        max_tokens: int | None = typer.Option(None, min=1, help="the largest max_tokens of one request"),
        expires: str | None = typer.Option(None, help="when the key stops working: 30d, 12h, or a date "
                                           "(2027-01-31); default: never")):
    """Make a key for USER and print it, once: only its salted hash is kept."""
    limits = Limits(rpm, tpm, tpd, max_n, max_best_of, max_tokens)
    key, record = api.add_key(deployment, user, project=project, models=tuple(models) if models else None,
                              limits=limits, expires_at=parse_when(expires) if expires else None)
    err.print(f"key {record.key_id} for {record.user}{f' (project {project})' if project else ''}: shown once, "
              "keep it now", highlight=False)
    served = api.served_models(deployment) if models else None
    missing = [model for model in models or () if served is not None and model not in served]
    if missing:  # a typo, or a model that joins later: the key is made either way
        err.print(f"warning: {deployment} serves {', '.join(served or ()) or 'no model'} now, not "
                  f"{', '.join(missing)}: this key can use {'it' if len(missing) == 1 else 'them'} only once a "
                  "deployment of that served name joins the endpoint", highlight=False)
    print(key)  # stdout alone, for `KEY=$(hpcserve keys add ...)`


@app.command("list")
@guarded
def list_keys(deployment: str = DeploymentArg,
              all_keys: bool = typer.Option(False, "--all", help="revoked and expired keys too")):
    """Every live key: its id, user, project, models, limits and end (never the key itself)."""
    now = time.time()
    records = [r for r in api.keys(deployment) if all_keys or r.usable(now)]
    if not records:
        console.print("no keys. Add one with `hpcserve keys add USER -d DEPLOYMENT`.")
        return
    table = narrow_table(None, "key id", "user", "project", "models", "limits", "source", "state",
                         left=("key id", "user", "project", "models", "limits", "source", "state"))
    for r in records:
        table.add_row(r.key_id, r.user, r.project or "-", ",".join(r.models) if r.models else "all",
                      limits_text(r.limits) or "-", str(r.source), state_text(r, now))
    console.print(table)


@app.command("revoke")
@guarded
def revoke(selector: str = typer.Argument(..., help="a key id, or a user (all of their keys)", show_default=False),
           deployment: str = typer.Option(..., "--deployment", "-d", help="the deployment's name, or its config file",
                                          show_default=False)):
    """Revoke keys: refused by every data-plane worker within 1 s."""
    revoked = api.revoke_key(deployment, selector)
    console.print(f"revoked {', '.join(f'{r.key_id} ({r.user})' for r in revoked)}", highlight=False)


@app.command("request")
@guarded
def request(name: str = typer.Argument(..., help="the deployment's name", show_default=False),
            owner: str = typer.Option(..., "--owner", help="the Unix user who runs the deployment",
                                      show_default=False)):
    """Get a key of your own, without an administrator: the endpoint's host knows who you are (your Unix login)
    and, where Slurm's accounting knows it, your default account (the key's project). The owner allows it
    with tenancy.self_service."""
    grant = request_key(owner, name)
    ends = f", until {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(grant.expires_at))}" if grant.expires_at else ""
    err.print(f"key {grant.key_id} for {grant.user}{f' (project {grant.project})' if grant.project else ''}{ends}: "
              "shown once, keep it now (a new request replaces it)", highlight=False)
    print(grant.key)


@guarded
def usage(deployment: str = DeploymentArg,
          by: GroupBy = typer.Option(GroupBy.USER, "--by", help="one line per user, project, model or UTC day"),
          since: str | None = typer.Option(None, help="from this long ago (7d, 12h) or this date (2026-12-01)"),
          until: str | None = typer.Option(None, help="up to this long ago or this date"),
          as_csv: bool = typer.Option(False, "--csv", help="CSV on stdout, for a spreadsheet or a report")):
    """Who used what: requests, tokens (prompt, cached, completion), failures, migrations, time to first token."""
    totals = api.usage(deployment, by, parse_when(since, past=True) if since else None,
                       parse_when(until, past=True) if until else None)
    header = (str(by), "requests", "failed", "prompt_tokens", "cached_tokens", "completion_tokens", "migrated",
              "ttft_p50_s", "duration_s")
    if as_csv:
        writer = csv.writer(sys.stdout)
        writer.writerow(header)
        for t in totals:
            writer.writerow((t.group, t.requests, t.failed, t.prompt_tokens, t.cached_tokens, t.completion_tokens,
                             t.migrated, "" if t.ttft_p50_s is None else f"{t.ttft_p50_s:.3f}", f"{t.duration_s:.1f}"))
        return
    if not totals:
        console.print("no usage recorded in that time.")
        return
    table = narrow_table(None, str(by), "requests", "failed", "prompt", "cached", "completion", "migrated",
                         "ttft p50", left=(str(by),))
    for t in totals:
        table.add_row(t.group, str(t.requests), str(t.failed), str(t.prompt_tokens), str(t.cached_tokens),
                      str(t.completion_tokens), str(t.migrated),
                      "-" if t.ttft_p50_s is None else f"{t.ttft_p50_s:.2f} s")
    console.print(table)


def limits_text(limits: Limits) -> str:
    names = {"requests_per_minute": "rpm", "tokens_per_minute": "tpm", "tokens_per_day": "tpd", "max_n": "n",
             "max_best_of": "best_of", "max_tokens": "max_tokens"}
    return " ".join(f"{short}={getattr(limits, name)}" for name, short in names.items()
                    if getattr(limits, name) is not None)


def state_text(record: KeyRecord, now: float) -> str:
    if record.revoked_at is not None:
        return "revoked"
    if record.expires_at is not None:
        return "expired" if now >= record.expires_at else time.strftime("until %Y-%m-%d", time.gmtime(record.expires_at))
    return "live"
