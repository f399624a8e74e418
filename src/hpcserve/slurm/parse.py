"""Slurm's outputs into typed results. Pure functions: text in, dataclasses out; no subprocess.

Formats were checked against saved outputs of Slurm 22.05 (tests/slurm/data/captured/). Things
that are easy to get wrong:
- sbatch --parsable prints "ID" or "ID;CLUSTER" (the latter on multi-cluster setups).
- squeue hides finished jobs unless --states=all, even with --jobs (it prints nothing, exit 0).
- squeue %r prints a reason with spaces ("Nodes required for job are DOWN, DRAINED or ...");
  scontrol prints the same reason with "_" for each space.
- Job names are free text and may contain "|" and spaces: they go last in delimited formats.
- `scontrol show hostnames` answers a bad list with "Invalid hostlist: ..." on stderr and exit 0.
- sacct -c (the jobcomp file, when there is no slurmdbd) prints Timelimit as minutes ("1").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from enum import Enum

from hpcserve.slurm.states import JobInfo, JobState


class SlurmParseError(ValueError):
    """Slurm printed something this module does not understand; the message quotes it."""


# ---------------------------------------------------------------- sbatch

@dataclass(frozen=True)
class Submission:
    job_id: str
    cluster: str | None = None


_PARSABLE = re.compile(r"^(\d+)(?:;([A-Za-z0-9_.-]+))?$")


def parse_sbatch_parsable(stdout: str) -> Submission:
    """`sbatch --parsable` stdout: "123" or "123;cluster". Anything else is an error quoting it."""
    match = _PARSABLE.match(stdout.strip())
    if not match:
        raise SlurmParseError(
            f"sbatch --parsable printed {stdout!r}; expected a job id such as '123' or '123;cluster'")
    return Submission(job_id=match.group(1), cluster=match.group(2))


# ---------------------------------------------------------------- sbatch --test-only

@dataclass(frozen=True)
class WillRun:
    """`sbatch --test-only`'s answer: when the scheduler would start the job if it were submitted now
    (nothing is queued), on which nodes. start is Slurm's local time as it prints it (ISO, no zone)."""

    job_id: str
    start: str
    processors: int
    nodes: list[str]
    partition: str


_WILL_RUN = re.compile(r"Job (\d+) to start at (\S+) using (\d+) processors on nodes (\S+) in partition (\S+)")


def parse_test_only(output: str) -> WillRun:
    """`sbatch --test-only` prints its answer on stderr: "sbatch: Job 12 to start at 2026-12-02T05:03:31
    using 4 processors on nodes hsn1 in partition debug". Anything else is an error quoting it."""
    match = _WILL_RUN.search(output)
    if not match:
        raise SlurmParseError(f"sbatch --test-only printed {output.strip()!r}; expected 'Job N to start at TIME "
                              "using N processors on nodes LIST in partition NAME'")
    job_id, start, processors, nodes, partition = match.groups()
    return WillRun(job_id, start, int(processors), expand_nodelist(nodes), partition)


# ---------------------------------------------------------------- shared field helpers

# What Slurm prints for "no value", depending on the command and the field.
_NO_VALUE = frozenset({"", "N/A", "NONE", "None", "Unknown", "(null)", "None assigned"})


def optional(text: str) -> str | None:
    text = text.strip()
    return None if text in _NO_VALUE else text


_DURATION = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def normalise_time_limit(text: str) -> str | None:
    """Slurm prints limits trimmed ("1:00" in squeue, "00:01:00" in scontrol): make them HH:MM:SS.

    With colons the parts count from the right (M:S, H:M:S) as squeue prints them; a bare number
    is minutes, as sbatch --time and sacct -c use it. "UNLIMITED" stays; "N/A" or anything
    unexpected gives None.
    """
    text = text.strip()
    if text.upper() in {"UNLIMITED", "INFINITE"}:
        return "UNLIMITED"
    match = _DURATION.match(text)
    if not match:
        return None
    days, *rest = match.groups()
    numbers = [int(p) for p in rest if p is not None]
    if len(numbers) == 1:  # "D-H" counts hours, a bare number minutes
        numbers = [numbers[0], 0, 0] if days else [0, numbers[0], 0]
    hours, minutes, seconds = ([0, 0] + numbers)[-3:]
    return format_duration(int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds)


def time_limit_seconds(text: str | None) -> float | None:
    """A time limit as Slurm prints it (or as cluster.time holds it) in seconds; None when unlimited or
    unknown."""
    normal = normalise_time_limit(text or "")
    if normal is None or normal == "UNLIMITED":
        return None
    days, _, clock = normal.rpartition("-")
    hours, minutes, seconds = (int(p) for p in clock.split(":"))
    return float(int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds)


def slurm_epoch(text: str | None) -> float | None:
    """A time as Slurm prints it (StartTime, EndTime: ISO without a zone, the cluster's local time) as
    epoch seconds; None for "Unknown", "N/A" and the like."""
    value = optional(text or "")
    if value is None:
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def format_duration(seconds: int) -> str:
    """Seconds as Slurm prints durations: HH:MM:SS, or D-HH:MM:SS from one day on."""
    days, rest = divmod(seconds, 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def split_delimited(line: str, fields: tuple[str, ...], free_text: str) -> dict[str, str]:
    """Split a "|"-delimited line into named fields; the free-text field takes any extra "|"."""
    parts = line.split("|")
    if len(parts) < len(fields):
        raise SlurmParseError(f"expected {len(fields)} '|'-separated fields ({', '.join(fields)}), got {line!r}")
    index = fields.index(free_text)
    tail = len(fields) - index - 1
    middle = "|".join(parts[index:len(parts) - tail])
    values = parts[:index] + [middle] + (parts[len(parts) - tail:] if tail else [])
    return dict(zip(fields, values))


# ---------------------------------------------------------------- squeue

SQUEUE_FIELDS = ("JobID", "State", "Reason", "NodeList", "Start", "End", "TimeLimit", "Name")
# Same order as SQUEUE_FIELDS. The name is last: it is the only field that may contain "|".
SQUEUE_FORMAT = "%i|%T|%r|%N|%S|%e|%l|%j"


PENDING_FORMAT = "%i|%P"  # squeue --states=PENDING --sort=-p,i: job id and partition(s), highest priority first


def queue_position(stdout: str, job_id: str) -> int | None:
    """The job's place (1 = next) among the pending jobs of its partition, from `squeue --noheader
    --states=PENDING --sort=-p,i --format=PENDING_FORMAT` (every partition's pending jobs, highest priority
    first). Jobs count when they wait for the same partition (or the same list of partitions) as this one.
    None when the job is not among them (started, gone, or not pending). Pure."""
    rows = [line.strip().split("|", 1) for line in stdout.splitlines() if line.strip()]
    partition = next((row[1] if len(row) > 1 else "" for row in rows if row[0] == job_id), None)
    if partition is None:
        return None
    position = 0
    for row in rows:
        if (row[1] if len(row) > 1 else "") == partition:
            position += 1
            if row[0] == job_id:
                return position
    return None


def parse_squeue(stdout: str) -> list[JobInfo]:
    """`squeue --noheader --format=SQUEUE_FORMAT` output, one JobInfo per line (no exit codes)."""
    return [parse_squeue_line(line) for line in stdout.splitlines() if line.strip()]


def parse_squeue_line(line: str) -> JobInfo:
    row = split_delimited(line, SQUEUE_FIELDS, free_text="Name")
    return JobInfo(
        job_id=row["JobID"].strip(),
        state=JobState.parse(row["State"]),
        reason=optional(row["Reason"]),
        nodes=expand_nodelist(row["NodeList"]),
        node_list_raw=optional(row["NodeList"]) or "",
        start_time=optional(row["Start"]),
        end_time=optional(row["End"]),
        time_limit=normalise_time_limit(row["TimeLimit"]),
        name=row["Name"],
        source="squeue",
    )


# ---------------------------------------------------------------- scontrol show job -o

# A key starts after whitespace: TRES=cpu=1,mem=4000M holds "=" in its value but has no space.
_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=")


def parse_scontrol_fields(line: str) -> dict[str, str]:
    """One `scontrol show job -o` line as key -> value.

    Values run to the next " Key=", so values with spaces (JobName=my job, Command=...) survive;
    a value containing " X=" itself would be cut there (none of the keys read here can).
    """
    matches = list(_SCONTROL_KEY.finditer(line))
    fields: dict[str, str] = {}
    for match, following in zip(matches, matches[1:] + [None]):
        end = following.start() if following else len(line)
        fields[match.group(1)] = line[match.end():end].strip()
    return fields


def parse_scontrol_jobs(stdout: str) -> list[JobInfo]:
    """`scontrol show job -o` output: one line per job (an array gives several)."""
    return [scontrol_job_info(parse_scontrol_fields(line)) for line in stdout.splitlines() if line.strip()]


def scontrol_job_info(fields: dict[str, str]) -> JobInfo:
    missing = [key for key in ("JobId", "JobState") if key not in fields]
    if missing:
        raise SlurmParseError(f"scontrol show job printed no {' or '.join(missing)}: {fields!r}")
    node_list = optional(fields.get("NodeList", "")) or ""
    return JobInfo(
        job_id=fields["JobId"],
        state=JobState.parse(fields["JobState"]),
        reason=optional(fields.get("Reason", "")),
        exit_code=optional(fields.get("ExitCode", "")),
        nodes=expand_nodelist(node_list),
        node_list_raw=node_list,
        start_time=optional(fields.get("StartTime", "")),
        end_time=optional(fields.get("EndTime", "")),
        time_limit=normalise_time_limit(fields.get("TimeLimit", "")),
        name=fields.get("JobName", ""),
        source="scontrol",
        preempt_time=optional(fields.get("PreemptTime", "")),
    )


# ---------------------------------------------------------------- sacct --parsable2

# JobName is free text that may contain "|": split_delimited gives it whatever is left over.
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Start", "End", "Timelimit", "NodeList")
SACCT_FORMAT = ",".join(SACCT_FIELDS)


def parse_sacct(stdout: str, fields: tuple[str, ...] = SACCT_FIELDS) -> list[JobInfo]:
    """`sacct --parsable2 --noheader --format=...` output: one JobInfo per job.

    Step rows (123.batch, 123.extern, 123.0) are left out: the job's own row carries its state.
    """
    rows = [split_delimited(line, fields, free_text="JobName") for line in stdout.splitlines() if line.strip()]
    return [sacct_job_info(row) for row in rows if "." not in row["JobID"]]


def sacct_job_info(row: dict[str, str]) -> JobInfo:
    node_list = optional(row.get("NodeList", "")) or ""
    return JobInfo(
        job_id=row["JobID"].strip(),
        state=JobState.parse(row["State"]),
        exit_code=optional(row.get("ExitCode", "")),
        nodes=expand_nodelist(node_list),
        node_list_raw=node_list,
        start_time=optional(row.get("Start", "")),
        end_time=optional(row.get("End", "")),
        time_limit=normalise_time_limit(row.get("Timelimit", "")),
        name=row.get("JobName", ""),
        source="sacct",
    )


# ---------------------------------------------------------------- node lists

def parse_hostnames(stdout: str, stderr: str = "") -> list[str]:
    """`scontrol show hostnames LIST` output. A bad list is reported on stderr, with exit 0."""
    bad = first_matching_line(stderr + "\n" + stdout, r"^Invalid hostlist")
    if bad:
        raise SlurmParseError(f"scontrol show hostnames: {bad}")
    return [line.strip() for line in stdout.splitlines() if line.strip()]


def expand_nodelist(text: str) -> list[str]:
    """Expand Slurm's compressed node list without asking Slurm: "a1,b[01-02]" -> [a1, b01, b02]."""
    text = text.strip()
    if optional(text) is None:
        return []
    return [name for item in split_outside_brackets(text) for name in expand_hostlist_item(item)]


def split_outside_brackets(text: str) -> list[str]:
    """Split on commas that are not inside [...]: "a1,b[1,3]" -> ["a1", "b[1,3]"]."""
    items, depth, start = [], 0, 0
    for position, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise SlurmParseError(f"not a Slurm node list (nested or unbalanced brackets): {text!r}")
        if char == "," and depth == 0:
            items.append(text[start:position])
            start = position + 1
    if depth:
        raise SlurmParseError(f"not a Slurm node list (unclosed '['): {text!r}")
    items.append(text[start:])
    return [item for item in items if item]


_FIRST_BRACKET = re.compile(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$")


def expand_hostlist_item(item: str) -> list[str]:
    """One item, brackets anywhere and several times: "r[1-2]n[1-2]" -> r1n1, r1n2, r2n1, r2n2."""
    match = _FIRST_BRACKET.match(item)
    if not match:
        if "[" in item or "]" in item:
            raise SlurmParseError(f"not a Slurm node list: {item!r}")
        return [item]
    prefix, ranges, rest = match.groups()
    return [prefix + number + tail for number in expand_ranges(ranges) for tail in expand_hostlist_item(rest)]


def expand_ranges(ranges: str) -> list[str]:
    """ "1-3,5" -> 1 2 3 5; "08-10" keeps the width of the lower bound: 08 09 10."""
    numbers: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
            raise SlurmParseError(f"not a Slurm node range: [{ranges}]")
        width = len(low)
        numbers += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
    return numbers


# ---------------------------------------------------------------- error texts

class SlurmProblem(Enum):
    INVALID_JOB_ID = "invalid job id"
    ACCOUNTING_DISABLED = "accounting disabled"
    NODE_CONFIGURATION = "no node fits the request"
    INVALID_PARTITION = "invalid partition"
    INVALID_ACCOUNT = "invalid account"
    INVALID_QOS = "invalid qos"
    TIME_LIMIT = "time limit not allowed"
    INVALID_TIME = "invalid time"
    POLICY_LIMIT = "accounting/QOS policy"
    CONTROLLER_UNREACHABLE = "controller unreachable"
    AUTHENTICATION = "authentication"
    NO_CONFIGURATION = "no slurm.conf"
    SCRIPT_UNREADABLE = "script unreadable"
    INVALID_HOSTLIST = "invalid host list"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class SlurmDiagnosis:
    problem: SlurmProblem
    line: str   # the line of Slurm's output that says it ("" when UNKNOWN)
    hint: str   # what to do about it


# (pattern searched case-insensitively in the output, problem, hint). The first match wins, so
# causes come before the symptoms they produce (a munge failure also says "submission failed").
_ERROR_PATTERNS: tuple[tuple[str, SlurmProblem, str], ...] = (
    (r"authentication error|munge", SlurmProblem.AUTHENTICATION,
     "munged is not running on this host or its key differs from the cluster's: ask the admins, or check `munge -n | unmunge`"),
    (r"could not establish a configuration source|unable to process configuration file|cannot stat file .*slurm\.conf",
     SlurmProblem.NO_CONFIGURATION,
     "Slurm's client commands found no slurm.conf: run on a login node, or set SLURM_CONF to the cluster's slurm.conf"),
    (r"unable to contact slurm controller", SlurmProblem.CONTROLLER_UNREACHABLE,
     "slurmctld is down or unreachable from this host: retry later; `scontrol ping` shows its state"),
    (r"invalid job id", SlurmProblem.INVALID_JOB_ID,
     "Slurm does not know this job: it never existed, or it ended more than MinJobAge (default 300 s) ago"),
    (r"accounting storage is disabled", SlurmProblem.ACCOUNTING_DISABLED,
     "this cluster keeps no job accounting (no slurmdbd): finished jobs stay visible only for MinJobAge"),
    (r"requested node configuration is not available", SlurmProblem.NODE_CONFIGURATION,
     ("no node offers what the job asks for: compare cluster.gpus_per_node, cpus_per_node and sbatch_extra "
     "with `sinfo -o '%P %D %c %m %G %f'`")),
    (r"invalid partition", SlurmProblem.INVALID_PARTITION,
     "cluster.partition names no partition you may use: `sinfo -s` lists them"),
    (r"invalid account", SlurmProblem.INVALID_ACCOUNT,
     "cluster.account is not one of yours (or not allowed on that partition): `sacctmgr show assoc user=$USER`"),
    (r"invalid qos", SlurmProblem.INVALID_QOS,
     "cluster.qos is not allowed for your account: `sacctmgr show assoc user=$USER format=account,qos`"),
    (r"violates accounting/qos policy", SlurmProblem.POLICY_LIMIT,
     "a QOS or association limit (jobs, GPUs, time) forbids this job: `sacctmgr show qos` shows the limits"),
    (r"requested time limit is invalid", SlurmProblem.TIME_LIMIT,
     "cluster.time exceeds the partition's limit: `sinfo -o '%P %l'` shows the maximum"),
    (r"invalid --time specification", SlurmProblem.INVALID_TIME,
     "cluster.time must be minutes, H:M:S or D-H:M:S"),
    (r"unable to open file", SlurmProblem.SCRIPT_UNREADABLE,
     "sbatch could not read the batch script: check the path and its permissions"),
    (r"invalid hostlist", SlurmProblem.INVALID_HOSTLIST,
     "not a Slurm node list: expected names like hsn1 or hsn[1-3,5]"),
)


def diagnose(output: str) -> SlurmDiagnosis:
    """What a Slurm error text means and what to do. Unknown texts give SlurmProblem.UNKNOWN."""
    for pattern, problem, hint in _ERROR_PATTERNS:
        line = first_matching_line(output, pattern)
        if line is not None:
            return SlurmDiagnosis(problem, line, hint)
    return SlurmDiagnosis(SlurmProblem.UNKNOWN, "", "")


def first_matching_line(output: str, pattern: str) -> str | None:
    regex = re.compile(pattern, re.IGNORECASE)
    return next((line.strip() for line in output.splitlines() if regex.search(line)), None)
