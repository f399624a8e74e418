"""The one interface to Slurm's commands (sbatch, squeue, scontrol, sacct, scancel).

Every call is an argument list (no shell) with a timeout, run through a swappable `runner`, so
tests hand in a fake one instead of patching this module (like an httpx transport). The default
runner inherits the environment, so SLURM_CONF and PATH reach Slurm. Failures raise SlurmError
quoting the command's output, with a hint from hpcserve.slurm.parse.diagnose.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hpcserve.core.errors import HpcserveError, SlurmError, UsageError
from hpcserve.slurm.parse import (
    PENDING_FORMAT,
    SACCT_FORMAT,
    SQUEUE_FORMAT,
    SlurmParseError,
    SlurmProblem,
    WillRun,
    diagnose,
    optional,
    parse_hostnames,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_jobs,
    parse_squeue,
    parse_test_only,
    queue_position,
)
from hpcserve.slurm.states import JobInfo

Runner = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]

DEFAULT_TIMEOUT_S = 30.0
SCRIPT_NAME = "job.sbatch"


class SlurmJobNotFound(SlurmError):
    """No Slurm command knows the job: squeue, scontrol and accounting were all asked."""

    def __init__(self, job_id: str, answers: list[str]):
        self.job_id = job_id
        hint = (f"Slurm does not know job {job_id}: it never existed, or it ended longer ago than the "
                "controller keeps jobs (MinJobAge) and accounting has no record of it")
        super().__init__(["squeue", "scontrol", "sacct"], 1, "\n".join(answers), hint)
        self.args = (f"Slurm job {job_id} not found. What each command said:\n"
                     + "\n".join(f"  {answer}" for answer in answers) + f"\nHint: {hint}",)


class JobWaitTimeout(HpcserveError):
    """wait_for's deadline passed; `info` is the job as last seen."""

    def __init__(self, job_id: str, info: JobInfo, timeout_s: float):
        self.job_id = job_id
        self.info = info
        super().__init__(f"Slurm job {job_id} is still {info.describe()} after {timeout_s:g} s")


def run_subprocess(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """The default runner: no shell, no stdin, the caller's environment, text output."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)


class SlurmClient:
    def __init__(self, runner: Runner | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self._runner = runner or run_subprocess
        self._timeout = timeout
        self._clock = clock
        self._sleep = sleep

    # ------------------------------------------------------------ public API

    def submit(self, script_text: str, workdir: Path, hold: bool = False) -> str:
        """Write the script to workdir/job.sbatch, sbatch it, return the job id.

        The folders of the script's #SBATCH --output/--error are created first: Slurm does not
        create them, and a job whose log folder is missing fails without any log. hold: the job
        waits until release(), so that files named after its id can be put in place first.
        """
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        script = workdir / SCRIPT_NAME
        script.write_text(script_text)
        for folder in log_folders(script_text):
            folder.mkdir(parents=True, exist_ok=True)
        argv = ["sbatch", "--parsable", *(["--hold"] if hold else []), str(script)]
        result = self._checked(argv)
        try:
            return parse_sbatch_parsable(result.stdout).job_id
        except SlurmParseError as exc:
            raise SlurmError(argv, result.returncode, combined_output(result),
                             hint=f"{exc} (is sbatch wrapped by a site script?)") from None

    def will_run(self, script_text: str) -> WillRun:
        """When Slurm would start this batch script if it were submitted now, and where (`sbatch
        --test-only`: the scheduler's own test, nothing is queued). Slurm assumes every running job
        uses its whole time limit and does not count pending jobs of higher priority."""
        with tempfile.TemporaryDirectory(prefix="hpcserve-test-only-") as folder:
            script = Path(folder) / SCRIPT_NAME
            script.write_text(script_text)
            argv = ["sbatch", "--test-only", str(script)]
            result = self._checked(argv)
        try:
            return parse_test_only(combined_output(result))
        except SlurmParseError as exc:
            raise SlurmError(argv, result.returncode, combined_output(result), hint=str(exc)) from None

    def job(self, job_id: str) -> JobInfo:
        """The job's state: squeue (cheap, live), then scontrol (exit codes of finished jobs, kept
        for MinJobAge), then accounting (sacct, or sacct -c without slurmdbd)."""
        job_id = checked_job_id(job_id)
        said: list[str] = []
        queued = self._from_squeue(job_id, said)
        if queued is not None and not queued.state.finished:
            return queued
        found = self._from_scontrol(job_id, said) or queued or self._from_accounting(job_id, said)
        if found is None:
            raise SlurmJobNotFound(job_id, said)
        return found

    def job_now(self, job_id: str) -> JobInfo | None:
        """The job as scontrol shows it now (PreemptTime included, which squeue does not print), None when
        scontrol no longer knows it. One call: for a moment that needs it, not for polling."""
        return self._from_scontrol(checked_job_id(job_id), [])

    def release(self, job_id: str) -> None:
        """Let a job submitted with hold=True start."""
        self._checked(["scontrol", "release", checked_job_id(job_id)])

    def jobs(self, job_ids: list[str]) -> dict[str, JobInfo]:
        """The live state of many jobs from one squeue call (sites rate-limit squeue: one call for all,
        as submitit's watcher does). Jobs squeue no longer shows (ended longer ago than MinJobAge) are
        absent from the answer: ask job() for those. squeue answers "Invalid job id" when it knows none
        of them: then the answer is empty."""
        ids = sorted({checked_job_id(j) for j in job_ids}, key=job_sort_key)
        if not ids:
            return {}
        argv = ["squeue", "--noheader", "--states=all", f"--jobs={','.join(ids)}", f"--format={SQUEUE_FORMAT}"]
        return {info.job_id: info for info in self._query(argv, parse_squeue) if info.job_id in ids}

    def queue_position(self, job_id: str) -> int | None:
        """The pending job's place among its partition's pending jobs by priority (1 = next; None when it
        is not pending). One squeue call over all pending jobs: ask it seldom (sites rate-limit squeue)."""
        job = checked_job_id(job_id)
        argv = ["squeue", "--noheader", "--states=PENDING", "--sort=-p,i", f"--format={PENDING_FORMAT}"]
        return queue_position(self._checked(argv).stdout, job)

    def cancel(self, job_id: str, signal: str | None = None, batch_only: bool = False) -> None:
        """Cancel the job, or only send it `signal` (e.g. "TERM") for a graceful stop.

        With a signal, --full makes it reach the batch script (the hpcserve driver) too: plain
        --signal only reaches job steps. batch_only sends it to the batch script alone (--batch), so
        the driver can stop the steps in its own order. A job Slurm no longer knows counts as cancelled.
        """
        job_id = checked_job_id(job_id)
        argv = ["scancel"]
        if signal is not None:
            argv += [f"--signal={checked_signal(signal)}", "--batch" if batch_only else "--full"]
        argv.append(job_id)
        result = self._run(argv)
        if result.returncode != 0 and diagnose(combined_output(result)).problem is not SlurmProblem.INVALID_JOB_ID:
            raise self._error(argv, result)

    def hostnames(self, nodelist: str) -> list[str]:
        """Slurm's own expansion of a node list ("hsn[1-3]" -> hsn1, hsn2, hsn3)."""
        if optional(nodelist) is None:
            return []
        argv = ["scontrol", "show", "hostnames", nodelist]
        result = self._checked(argv)
        try:
            return parse_hostnames(result.stdout, result.stderr)
        except SlurmParseError as exc:
            raise SlurmError(argv, result.returncode, combined_output(result), hint=str(exc)) from None

    def wait_for(self, job_id: str, predicate: Callable[[JobInfo], bool], timeout: float,
                 poll: float = 2.0, max_poll: float = 15.0) -> JobInfo:
        """Poll until predicate(info) holds or the job has finished (it cannot change any more);
        return the last JobInfo, so check it. Raises JobWaitTimeout after `timeout` seconds.

        Polls start every `poll` seconds and back off by 1.5x up to `max_poll`, to spare the
        controller; deadlines use the monotonic clock.
        """
        deadline = self._clock() + timeout
        delay = poll
        while True:
            info = self.job(job_id)
            if predicate(info) or info.state.finished:
                return info
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise JobWaitTimeout(job_id, info, timeout)
            self._sleep(min(delay, remaining))
            delay = min(delay * 1.5, max_poll)

    def default_account(self, user: str, timeout_s: float = 5.0) -> str | None:
        """The user's default account in Slurm's accounting (`sacctmgr -nP show user USER
        format=defaultaccount`), or None when it cannot say: no sacctmgr on PATH, no slurmdbd (the
        command fails), no such user in accounting, or no answer within timeout_s. Never raises: the
        answer is a nicety (a self-service key's project), asked while a user waits for their key."""
        if not _UNIX_NAME.match(user):
            return None  # not a name sacctmgr could know, and never an option for it
        argv = ["sacctmgr", "-nP", "show", "user", user, "format=defaultaccount"]
        try:
            result = self._runner(argv, min(timeout_s, self._timeout))
        except (subprocess.TimeoutExpired, OSError):
            return None
        if result.returncode != 0:
            return None
        return parse_default_account(result.stdout)

    # ------------------------------------------------------------ lookups behind job()

    def _from_squeue(self, job_id: str, said: list[str]) -> JobInfo | None:
        # --states=all: without it squeue hides finished jobs even when asked for them by id.
        argv = ["squeue", "--noheader", "--states=all", f"--jobs={job_id}", f"--format={SQUEUE_FORMAT}"]
        return self._lookup(argv, parse_squeue, job_id, said)

    def _from_scontrol(self, job_id: str, said: list[str]) -> JobInfo | None:
        argv = ["scontrol", "show", "job", "-o", job_id]
        return self._lookup(argv, parse_scontrol_jobs, job_id, said)

    def _from_accounting(self, job_id: str, said: list[str]) -> JobInfo | None:
        argv = ["sacct", "--parsable2", "--noheader", f"--jobs={job_id}", f"--format={SACCT_FORMAT}"]
        try:
            return self._lookup(argv, parse_sacct, job_id, said)
        except SlurmError as exc:
            said.append(f"{command_label(argv)}: {exc.output}")
            if diagnose(exc.output).problem is not SlurmProblem.ACCOUNTING_DISABLED:
                return None  # e.g. slurmdbd down: report what was asked, not this error
        # No slurmdbd: `sacct -c` reads the job completion file, if the cluster writes one.
        argv.insert(1, "-c")
        try:
            return self._lookup(argv, parse_sacct, job_id, said)
        except SlurmError as exc:
            said.append(f"{command_label(argv)}: {exc.output}")
            return None

    def _query(self, argv: list[str], parse: Callable[[str], list[JobInfo]]) -> list[JobInfo]:
        """Run one query; [] when Slurm knows none of the jobs asked for; raise on real errors."""
        result = self._run(argv)
        if result.returncode != 0:
            if diagnose(combined_output(result)).problem is SlurmProblem.INVALID_JOB_ID:
                return []
            raise self._error(argv, result)
        try:
            return parse(result.stdout)
        except SlurmParseError as exc:
            raise SlurmError(argv, result.returncode, combined_output(result), hint=str(exc)) from None

    def _lookup(self, argv: list[str], parse: Callable[[str], list[JobInfo]], job_id: str,
                said: list[str]) -> JobInfo | None:
        """Run one query; None if it does not know the job (noted in `said`); raise on real errors."""
        result = self._run(argv)
        if result.returncode != 0:
            output = combined_output(result)
            if diagnose(output).problem is SlurmProblem.INVALID_JOB_ID:
                said.append(f"{command_label(argv)}: {output}")
                return None
            raise self._error(argv, result)
        try:
            jobs = parse(result.stdout)
        except SlurmParseError as exc:
            raise SlurmError(argv, result.returncode, combined_output(result), hint=str(exc)) from None
        match = next((info for info in jobs if info.job_id == job_id), None)
        if match is None:
            said.append(f"{command_label(argv)}: no such job in its output")
        return match

    # ------------------------------------------------------------ running commands

    def _checked(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        result = self._run(argv)
        if result.returncode != 0:
            raise self._error(argv, result)
        return result

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        try:
            return self._runner(argv, self._timeout)
        except subprocess.TimeoutExpired as exc:
            output = as_text(exc.stderr) + as_text(exc.stdout)
            raise SlurmError(argv, None, output,
                             hint=f"no answer within {self._timeout:g} s: the controller may be overloaded or "
                                  "unreachable; `scontrol ping` shows its state") from None
        except FileNotFoundError:
            raise SlurmError(argv, 127, f"{argv[0]}: command not found",
                             hint="Slurm's client commands are not on PATH: run on a login node, or load "
                                  "the site's Slurm module") from None

    def _error(self, argv: list[str], result: subprocess.CompletedProcess[str]) -> SlurmError:
        output = combined_output(result)
        return SlurmError(argv, result.returncode, output, hint=diagnose(output).hint)


# ---------------------------------------------------------------- small pure helpers

_JOB_ID = re.compile(r"^\d+(_\d+)?$")  # 123, or 123_4 for one task of a job array
_SIGNAL = re.compile(r"^(SIG)?[A-Z][A-Z0-9]*$|^\d+$")


def checked_job_id(job_id: str) -> str:
    text = str(job_id).strip()
    if not _JOB_ID.match(text):
        raise UsageError(f"{job_id!r} is not a Slurm job id: expected digits such as 12345")
    return text


def job_sort_key(job_id: str) -> tuple[int, int]:
    """Numeric order of job ids ("9" before "10", "12_3" after "12"). Pure."""
    head, _, task = job_id.partition("_")
    return int(head), int(task or -1)


def checked_signal(signal: str) -> str:
    if not _SIGNAL.match(signal):
        raise UsageError(f"{signal!r} is not a signal: use a name such as TERM or INT, or a number")
    return signal


def command_label(argv: list[str]) -> str:
    """ "sacct -c" for the completion-file query, else the command name."""
    return " ".join(argv[:2]) if argv[1:2] == ["-c"] else argv[0]


def combined_output(result: subprocess.CompletedProcess[str]) -> str:
    """stderr first (where Slurm writes its errors), then stdout."""
    return "\n".join(part.strip() for part in (result.stderr or "", result.stdout or "") if part.strip())


def as_text(data: str | bytes | None) -> str:
    # subprocess.TimeoutExpired carries bytes even when text=True was asked for.
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


_LOG_DIRECTIVE = re.compile(r"^#SBATCH\s+(?:--output|--error|-o|-e)(?:=|\s+)(.+)$", re.MULTILINE)


def log_folders(script_text: str) -> list[Path]:
    """Folders of the script's #SBATCH --output/--error files (those without % patterns in them)."""
    folders = []
    for match in _LOG_DIRECTIVE.finditer(script_text):
        try:
            words = shlex.split(match.group(1), comments=True)  # sbatch reads quoted values too
        except ValueError:  # unbalanced quotes: sbatch will say so itself
            continue
        folder = Path(words[0]).parent if words else None
        if folder is not None and "%" not in str(folder) and folder not in folders:
            folders.append(folder)
    return folders


_UNIX_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\$?$")


def parse_default_account(stdout: str) -> str | None:
    """The account of `sacctmgr -nP show user USER format=defaultaccount`: its first non-empty line
    (a trailing '|' of older parsable output dropped), None when accounting has no such user. Pure."""
    for line in stdout.splitlines():
        account = line.strip().rstrip("|").strip()
        if account:
            return account
    return None
