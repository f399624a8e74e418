"""The doctor's checks: pure functions from captured command output (and the config) to findings.

Each one names what it saw and the fix; none runs anything, so each is tested on saved output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from hpcserve.core.config import DeploymentConfig
from hpcserve.doctor.findings import Finding, blocker, info, ok, warning
from hpcserve.planning.walltime import WalltimeCheck, startup_before_measurement
from hpcserve.slurm.parse import SlurmParseError, parse_test_only, slurm_epoch

SLURM_COMMANDS = ("sbatch", "squeue", "sinfo", "srun", "scontrol")
SERVE_MARGIN_S = 600.0  # less serving time than this after loading is not worth a job


@dataclass(frozen=True)
class Captured:
    """One command's result. rc None: it timed out; 127: not found."""

    argv: tuple[str, ...]
    rc: int | None
    stdout: str = ""
    stderr: str = ""

    @property
    def text(self) -> str:
        return (self.stderr.strip() or self.stdout.strip()).replace("\n", " | ")[:400]


# ---------------------------------------------------------------- login node

def check_commands(found: Mapping[str, str | None]) -> list[Finding]:
    missing = [c for c in SLURM_COMMANDS if not found.get(c)]
    if missing:
        return [blocker("commands", f"not on PATH: {', '.join(missing)}",
                        "run on a login node of the cluster, or load Slurm's module (e.g. `module load slurm`)")]
    return [ok("commands", "sbatch, squeue, sinfo, srun, scontrol on PATH")]


def check_controller(squeue: Captured) -> list[Finding]:
    if squeue.rc == 0:
        return [ok("controller", "slurmctld answers (squeue)")]
    why = "no answer in time" if squeue.rc is None else squeue.text
    return [blocker("controller", f"squeue failed: {why}",
                    "check SLURM_CONF and that the controller is up (`scontrol ping`); ask the admins if it is down")]


@dataclass(frozen=True)
class Partition:
    name: str
    available: bool
    time_limit_s: float | None   # None: unlimited
    nodes: int
    gres: tuple[str, ...]        # e.g. ("gpu:a100:4",); empty: none
    cpus: int
    default: bool = False


SINFO_FORMAT = "%P|%a|%l|%D|%G|%c"


def parse_sinfo(text: str) -> dict[str, Partition]:
    """`sinfo -h -o '%P|%a|%l|%D|%G|%c'`: one line per partition and node configuration; merged."""
    parts: dict[str, Partition] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 6:
            continue
        name, avail, limit, nodes, gres, cpus = fields
        default = name.endswith("*")
        name = name.rstrip("*")
        gres_list = tuple(g for g in gres.split(",") if g and g != "(null)")
        old = parts.get(name)
        new = Partition(name, avail == "up", slurm_seconds(limit), int(nodes or 0), gres_list,
                        int(re.sub(r"\D", "", cpus) or 0), default)
        if old:
            new = Partition(name, old.available or new.available, new.time_limit_s, old.nodes + new.nodes,
                            tuple(dict.fromkeys(old.gres + new.gres)), min(old.cpus, new.cpus), old.default)
        parts[name] = new
    return parts


def slurm_seconds(value: str) -> float | None:
    """Slurm's time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds; None for unlimited."""
    value = value.strip()
    if value.lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, s = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60.0 + s
    if len(parts) == 1:
        return parts[0] * 60.0
    if len(parts) == 2:
        return parts[0] * 60.0 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60.0 + parts[2]


def gpu_count(gres: tuple[str, ...]) -> int:
    """GPUs per node from sinfo's GRES strings (gpu:4, gpu:a100:4, gpu:a100:4(S:0-1))."""
    best = 0
    for item in gres:
        match = re.match(r"gpu(?::[^:(]+)?:(\d+)", item)
        if match:
            best = max(best, int(match.group(1)))
    return best


def check_partition(cfg: DeploymentConfig, sinfo: Captured) -> list[Finding]:
    if sinfo.rc != 0:
        return [blocker("partition", f"sinfo failed: {sinfo.text}", "check that Slurm's controller answers")]
    parts = parse_sinfo(sinfo.stdout)
    wanted = cfg.cluster.partition or next((p.name for p in parts.values() if p.default), None)
    if wanted is None or wanted not in parts:
        names = ", ".join(sorted(parts)) or "none visible"
        what = f"partition '{wanted}' does not exist" if wanted else "no partition set and the site has no default"
        return [blocker("partition", f"{what}; partitions: {names}", "set cluster.partition to one of them")]
    part = parts[wanted]
    findings = [ok("partition", f"'{wanted}': {part.nodes} nodes, {part.cpus} CPUs each, GRES "
                                f"{','.join(part.gres) or 'none'}")]
    if not part.available:
        findings.append(blocker("partition", f"partition '{wanted}' is not up", "pick another partition or ask the admins"))
    if part.nodes < cfg.cluster.nodes:
        findings.append(blocker("partition", f"cluster.nodes = {cfg.cluster.nodes} but '{wanted}' has {part.nodes}",
                                "lower cluster.nodes or pick a larger partition"))
    if part.cpus and cfg.cluster.cpus_per_node > part.cpus:
        findings.append(blocker("partition", f"cluster.cpus_per_node = {cfg.cluster.cpus_per_node} but nodes of "
                                f"'{wanted}' have {part.cpus}", f"set cluster.cpus_per_node to {part.cpus} or less"))
    limit = slurm_seconds(cfg.cluster.time)
    if part.time_limit_s is not None and limit is not None and limit > part.time_limit_s:
        findings.append(blocker("time", f"cluster.time = {cfg.cluster.time} exceeds the partition's limit "
                                f"({part.time_limit_s / 3600:.1f} h)", "lower cluster.time"))
    return findings + check_gres(cfg, part)


def check_gres(cfg: DeploymentConfig, part: Partition) -> list[Finding]:
    gpus = cfg.cluster.gpus_per_node
    have = gpu_count(part.gres)
    if not gpus:
        return []
    if cfg.site.gres and have == 0:
        return [blocker("gres", f"partition '{part.name}' has no GPU GRES (sinfo shows "
                        f"'{','.join(part.gres) or 'none'}'), but the config requests --gpus-per-node={gpus}",
                        "if its nodes have GPUs that Slurm does not manage, set site.gres: false; "
                        "otherwise pick a GPU partition")]
    if cfg.site.gres and have < gpus:
        return [blocker("gres", f"cluster.gpus_per_node = {gpus} but nodes of '{part.name}' have {have} "
                        f"({','.join(part.gres)})", f"set cluster.gpus_per_node to {have} or less")]
    if not cfg.site.gres and have:
        return [warning("gres", f"site.gres is false but '{part.name}' manages GPUs as GRES ({','.join(part.gres)}): "
                        "the job gets whole nodes instead of their GPUs", "set site.gres: true")]
    return [ok("gres", f"{gpus} GPUs per node " + (f"from GRES {','.join(part.gres)}" if cfg.site.gres
                                                     else "without GRES (whole nodes)"))]


TEST_ONLY_FIXES = [
    ("invalid partition", "set cluster.partition to one that `sinfo -s` lists"),
    ("invalid account", "set cluster.account to one of yours (`sacctmgr show assoc user=$USER`)"),
    ("invalid qos", "set cluster.qos to one your account may use (`sacctmgr show assoc user=$USER format=qos`)"),
    ("gres", ("GRES names or types differ on this site: compare `sinfo -o '%P %G'` with cluster.gpus_per_node and "
     "any --gres in cluster.sbatch_extra (with GPUs, hpcserve already asks for --gpus-per-node)")),
    ("node configuration is not available", ("the request does not fit any node: compare gpus_per_node, "
     "cpus_per_node, nodes and cluster.sbatch_extra (e.g. --gres types) with `sinfo -o '%P %D %c %G'`")),
    ("time limit", "lower cluster.time below the partition's limit"),
    ("job violates accounting/qos policy", ("the account/QOS does not allow this size or time: lower them or "
     "use another QOS")),
]


def check_submission(test_only: Captured) -> list[Finding]:
    """`sbatch --test-only SCRIPT` on the script `up` would submit: Slurm's own verdict, nothing queued."""
    if test_only.rc == 0:
        return [ok("submission", "Slurm accepts the rendered batch script (sbatch --test-only)")]
    message = test_only.text
    lower = message.lower()
    fix = next((f for key, f in TEST_ONLY_FIXES if key in lower), "read Slurm's message; `hpcserve render CONFIG` "
               "shows the script")
    return [blocker("submission", f"sbatch --test-only refuses the job: {message or 'no answer in time'}", fix)]


# ---------------------------------------------------------------- accounting

def parse_associations(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """`sacctmgr -n -P show assoc user=U format=account,partition,qos`: (account, partition, qos names)."""
    rows = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 3 and fields[0]:
            rows.append((fields[0], fields[1], tuple(q for q in fields[2].split(",") if q)))
    return rows


def check_accounting(cfg: DeploymentConfig, assoc: Captured, enforce: str) -> list[Finding]:
    """Account and QOS against the user's associations. Without slurmdbd nothing can be looked up:
    then it only matters whether the site enforces them (AccountingStorageEnforce)."""
    account, qos = cfg.cluster.account, cfg.cluster.qos
    if not account and not qos:
        return [ok("account", "no account or QOS set: the defaults apply")]
    if assoc.rc != 0:
        enforced = enforce and enforce.lower() not in ("none", "0", "")
        level = warning if enforced else info
        names = " and ".join(f"{k} '{v}'" for k, v in (("account", account), ("QOS", qos)) if v)
        return [level("account", f"{names} cannot be checked: sacctmgr failed ({assoc.text}); "
                      f"AccountingStorageEnforce = {enforce or 'unknown'}",
                      "ask the admins which accounts/QOS you may use" if enforced else
                      "nothing to do: this site does not enforce accounts or QOS")]
    rows = parse_associations(assoc.stdout)
    findings = []
    accounts = sorted({r[0] for r in rows})
    if account and account not in accounts:
        findings.append(blocker("account", f"account '{account}' is not one of yours ({', '.join(accounts) or 'none'})",
                                "set cluster.account to one of them"))
    if qos:
        allowed = sorted({q for r in rows if not account or r[0] == account for q in r[2]})
        if qos not in allowed:
            findings.append(blocker("qos", f"QOS '{qos}' is not allowed for account '{account or 'default'}' "
                                    f"(allowed: {', '.join(allowed) or 'none'})", "set cluster.qos to one of them"))
    return findings or [ok("account", f"account '{account or 'default'}'" + (f", QOS '{qos}'" if qos else "") + " allowed")]


# ---------------------------------------------------------------- time

def check_time(cfg: DeploymentConfig, weight_bytes: int | None, test_only: Captured | None = None,
               now: float | None = None) -> list[Finding]:
    """The walltime against the expected start-up and, behind an endpoint on Slurm, against the walltime
    handover (planning.walltime; the queue wait from `sbatch --test-only`'s estimate when given)."""
    limit = slurm_seconds(cfg.cluster.time)
    load, basis = startup_before_measurement(weight_bytes, cfg.serve.startup_s)
    if limit is None:
        return [ok("time", "no time limit")]
    handover = handover_check(cfg, limit, load, basis, test_only, now)
    if handover is not None and not handover.enough:
        works = max(handover.walltime_that_works_s, load + SERVE_MARGIN_S)
        return [blocker("time", handover.what("cluster.time"), f"set cluster.time to at least {minutes(works)}")]
    if limit <= load:
        return [blocker("time", f"cluster.time = {cfg.cluster.time} ({limit / 60:.0f} min) is shorter than the expected "
                        f"start-up (~{load / 60:.0f} min, {basis})",
                        f"set cluster.time to at least {minutes(load + SERVE_MARGIN_S)}")]
    findings = []
    if limit < load + SERVE_MARGIN_S:
        findings.append(warning("time", f"cluster.time = {cfg.cluster.time} leaves under {SERVE_MARGIN_S / 60:.0f} min "
                                f"of serving after the expected start-up (~{load / 60:.0f} min)",
                                f"set cluster.time to {minutes(load + 3600)} or more"))
    if limit < cfg.engine.startup_timeout_s:
        findings.append(warning("time", f"cluster.time ({limit:.0f} s) is shorter than engine.startup_timeout_s "
                                f"({cfg.engine.startup_timeout_s:.0f} s): a slow start ends as TIMEOUT, not as a "
                                "diagnosed failure", "raise cluster.time or lower engine.startup_timeout_s"))
    handed = (f"; successors launched ~{handover.lead_s / 60:.0f} min before each job ends" if handover else "")
    return findings or [ok("time", f"cluster.time = {cfg.cluster.time}; expected start-up ~{load / 60:.0f} min"
                                   + handed)]


def handover_check(cfg: DeploymentConfig, limit: float, load: float, basis: str, test_only: Captured | None,
                   now: float | None) -> WalltimeCheck | None:
    """Behind an endpoint on Slurm every job is handed over to a successor before its limit."""
    if not cfg.hands_over:
        return None
    queue, queue_basis = 0.0, "no estimate"
    if test_only is not None and test_only.rc == 0 and now is not None:
        try:
            start = slurm_epoch(parse_test_only(test_only.stderr + test_only.stdout).start)
        except SlurmParseError:
            start = None
        if start is not None:
            queue, queue_basis = max(0.0, start - now), "Slurm's estimate, sbatch --test-only"
    return WalltimeCheck(limit, load, queue, basis, queue_basis)


def minutes(seconds: float) -> str:
    total = int(-(-seconds // 60))
    return f"{total // 60}:{total % 60:02d}:00"
