"""Keys and usage rows for a tenancy run of routing_device.sh (hps:POLICY@TAG with ROUTING_TENANCY_<TAG>).

usage: tenancy_keys.py make DIR --users N      the deployment's key (DIR/api_key, for the data plane's --key-file),
                                               DIR/auth.hdr (its Authorization header, for curl -H @FILE), and
                                               DIR/keys, the keys the client sends, one a line (prefix_client.py
                                               --keys): with N > 0, N users' keys in a new SQLite store
                                               DIR/tenancy.sqlite and DIR/tenancy.json (the data plane's
                                               --tenancy); with N = 0, the deployment's key alone (tenancy off)
       tenancy_keys.py count DIR               JSON: the store's usage rows, the users' and the owner's apart,
                                               by status, with their token sums (N > 0; {} otherwise)

Users are spread over 10 projects. Their keys have rates far above what a run sends (as tenancy_overhead.py's),
and every key has the config's default caps (tenancy.limits: max_n, max_best_of), so that each request goes
through the same checks as on a deployment with tenancy at its defaults. Files with keys are 0600: a key is
never put on a command line.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections import Counter
from pathlib import Path

from hpcserve.core.config import TenancySpec
from hpcserve.tenancy.keyring import add_key
from hpcserve.tenancy.records import OWNER_KEY_ID, Limits
from hpcserve.tenancy.settings import TenancySettings, limits_of
from hpcserve.tenancy.store import open_store

PROJECTS = 10
HIGH = Limits(requests_per_minute=10**7, tokens_per_minute=10**10, tokens_per_day=10**13)


def private(path: Path, text: str) -> None:
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(text)


def make(folder: Path, users: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    owner = f"bench-{secrets.token_hex(16)}"
    private(folder / "api_key", owner)
    private(folder / "auth.hdr", f"Authorization: Bearer {owner}\n")
    if users <= 0:
        private(folder / "keys", owner + "\n")
        return {"users": 0, "tenancy": None}
    database = folder / "tenancy.sqlite"
    store = open_store(database)
    try:
        keys = [add_key(store, f"user{i:03d}", project=f"project{i % PROJECTS}", limits=HIGH)[0] for i in range(users)]
    finally:
        store.close()
    private(folder / "keys", "\n".join(keys) + "\n")
    settings = TenancySettings(str(database), limits_of(TenancySpec().limits))
    (folder / "tenancy.json").write_text(json.dumps(settings.to_json()))
    return {"users": users, "tenancy": str(folder / "tenancy.json")}


def count(folder: Path) -> dict:
    database = folder / "tenancy.sqlite"
    if not database.exists():
        return {}
    store = open_store(database)
    try:
        rows = store.rows()
    finally:
        store.close()
    users = [r for r in rows if r.key_id != OWNER_KEY_ID]
    return {"rows": len(rows), "user_rows": len(users), "owner_rows": len(rows) - len(users),
            "keys_seen": len({r.key_id for r in users}),
            "statuses": dict(Counter(str(r.status) for r in users)),
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in users),
            "completion_tokens": sum(r.completion_tokens or 0 for r in users),
            "rows_without_tokens": sum(1 for r in users if r.completion_tokens is None),
            "migrated": sum(1 for r in users if r.migrated)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["make", "count"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--users", type=int, default=100)
    args = parser.parse_args()
    result = make(args.folder, args.users) if args.command == "make" else count(args.folder)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
