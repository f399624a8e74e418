"""`hpcserve keys` and `hpcserve usage` on a deployment's config file (no deployment running): a key printed
once and listed without its secret, revocation, the usage table; bad input gets one message and exit 2."""

from __future__ import annotations

import yaml
from helpers import REPO, run_cli_here, write_config


def config(tmp_path):
    return write_config(tmp_path / "site.yaml", REPO / "examples" / "local.yaml", name="keys-cli",
                        results_dir=str(tmp_path / "results"))


def test_add_list_revoke_and_usage_on_a_config_file(tmp_path):
    path = str(config(tmp_path))
    added = run_cli_here("keys", "add", "alice", "-d", path, "--project", "chem", "--rpm", "60", "--expires", "30d")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    assert key.startswith("hps_") and len(added.stdout.splitlines()) == 1
    listed = run_cli_here("keys", "list", path)
    assert listed.returncode == 0 and "alice" in listed.stdout and "rpm=60" in listed.stdout
    assert key.split("_")[2] not in listed.stdout
    assert (tmp_path / "results" / "keys-cli-tenancy.sqlite").stat().st_mode & 0o077 == 0
    revoked = run_cli_here("keys", "revoke", "alice", "-d", path)
    assert revoked.returncode == 0 and "alice" in revoked.stdout
    assert "alice" not in run_cli_here("keys", "list", path).stdout
    assert "revoked" in run_cli_here("keys", "list", path, "--all").stdout
    usage = run_cli_here("usage", path, "--by", "project", "--csv")
    assert usage.returncode == 0 and usage.stdout.splitlines()[0].startswith("project,requests,failed")


def test_bad_input_gets_one_message_and_exit_2(tmp_path):
    path = str(config(tmp_path))
    cases = [(("keys", "add", "al ice", "-d", path), "user name"),
             (("keys", "add", "alice", "-d", path, "--expires", "yesterday"), "neither a duration"),
             (("keys", "add", "alice", "-d", path, "--expires", "2001-01-01"), "in the past"),
             (("keys", "add", "alice", "-d", "no-such-deployment"), "no-such-deployment"),
             (("keys", "revoke", "nobody", "-d", path), "no live key"),
             (("keys", "add", "alice", "-d", path, "--rpm", "0"), "greater than or equal to 1"),
             (("keys", "add", "alice", "-d", path, "--project", ""), "project ''"),
             (("keys", "add", "alice", "-d", path, "--project", "chem; rm"), "project 'chem; rm'"),
             (("keys", "add", "alice", "-d", path, "--model", " "), "--model ''"),
             (("usage", path, "--by", "colour"), "colour")]
    for args, said in cases:
        result = run_cli_here(*args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert said in result.stderr + result.stdout and "Traceback" not in result.stderr, (args, result.stderr)


def test_a_password_in_the_database_url_is_refused(tmp_path):
    data = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    data["tenancy"] = {"database": "postgresql://svc:hunter2@db.example/hpcserve"}
    path = tmp_path / "pw.yaml"
    path.write_text(yaml.safe_dump(data))
    result = run_cli_here("validate", str(path))
    assert result.returncode == 2 and ".pgpass" in result.stderr + result.stdout
    assert "hunter2" not in result.stderr + result.stdout
