"""Where a deployment's own process runs, and how it is found, watched and stopped:

    LocalRun   a detached process on this machine (the driver in local mode, or an endpoint's controller)
    SlurmRun   a Slurm batch job whose script execs the driver

    launch(cfg, results, key)   start a driver (here or as a job); returns the Record that finds it again
    run_of(record)         the LocalRun or SlurmRun a registered record names
    is_running(record)     whether its process or job still runs
    expected_start(cfg)    when Slurm would start its job if submitted now (nothing is queued)
    Runs                   both for many deployments at once (an endpoint's members): their jobs
                           followed with one squeue call per interval (slurm.watcher.JobWatcher)
    run.gone()             why it can no longer make progress (process exited, job ended), else None
    run.stop()             orderly stop (SIGTERM: it stops what it started), then by recorded PID
    LocalRun.restart(record, module)   a new process in the same run folder (an endpoint's controller
                           adopting what its lost predecessor left running)

Slurm is reached through one SlurmClient, passed in where runs are made (`launch`, `run_of`, `Runs`); a new
one where the caller gives none.

Each run gets a new folder of its own (mode 0700) with its config and its copy of the API key (0600), all
in place before its process starts: the key reaches the driver as a file, never through a command line,
a script or a Slurm job's environment (which slurmctld keeps, and slurmdbd with AccountingStoreFlags=job_env).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil
import yaml

from hpcserve.core.config import DeploymentConfig
from hpcserve.core.errors import HpcserveError, SlurmError
from hpcserve.core.files import write_private_text
from hpcserve.core.folders import private_dir
from hpcserve.core.keys import ApiKey, store_key
from hpcserve.core.osenv import PRIVATE_UMASK, environment_variables, umask
from hpcserve.core.paths import RunPaths
from hpcserve.core.registry import Record
from hpcserve.core.statuses import RunKind
from hpcserve.slurm.client import JobWaitTimeout, SlurmClient
from hpcserve.slurm.parse import WillRun
from hpcserve.slurm.render import DRIVER_MODULE, render_batch_script
from hpcserve.slurm.states import JobInfo, JobState
from hpcserve.slurm.watcher import JobWatcher

CHECK_ONLY_ENV = "HPCSERVE_CHECK_ONLY"  # `hpcserve check`: the driver stops after the health stage
FINISH_POLL_S = 0.5  # how often a stop looks at the shared watcher (which asks Slurm at its own pace)


def launch(cfg: DeploymentConfig, results: Path, key: ApiKey, extra_env: dict[str, str] | None = None,
           driver_module: str = DRIVER_MODULE, slurm: SlurmClient | None = None) -> Record:
    """Start a deployment's driver: detached on this machine (local), or as a Slurm batch job (through
    `slurm`, a new client by default)."""
    if cfg.cluster.scheduler == "local":
        return LocalRun.start(cfg, results, driver_module, RunKind.DRIVER, key, extra_env or {}).record
    return SlurmRun.submit(cfg, results, key, extra_env or {}, driver_module, slurm).record


def run_of(record: Record, jobs: JobWatcher | None = None, slurm: SlurmClient | None = None) -> LocalRun | SlurmRun:
    """slurm: the client a Slurm job is asked about and stopped through; the shared watcher's when
    there is one, else a new one."""
    if not record.job_id:
        return LocalRun(record)
    return SlurmRun(record, jobs, slurm or (jobs.client if jobs is not None else SlurmClient()))


def is_running(record: Record) -> bool:
    """Its process or job still runs (an endpoint's: its controller)."""
    return run_of(record).gone() is None


class Run(Protocol):
    """What a caller may ask of a deployment's run, wherever it runs (LocalRun, SlurmRun, or a test's)."""

    def gone(self) -> str | None: ...

    def stop(self, timeout_s: float = 90.0, grace_s: float = 0.0) -> list[int]: ...

    def queue_line(self) -> str | None: ...

    def info(self) -> JobInfo | None: ...

    def info_now(self) -> JobInfo | None:
        """The job as Slurm shows it at this moment, asked alone (not through the shared watcher), with
        its PreemptTime; None where there is no Slurm job."""
        ...


class WithoutSlurmJob:
    """A Run's Slurm side where there is no job (a process here, a test's stand-in): nothing queued, no job."""

    def queue_line(self) -> str | None:
        return None

    def info(self) -> JobInfo | None:
        return None

    def info_now(self) -> JobInfo | None:
        return None


class Launcher(Protocol):
    """How an endpoint's members are started and found again. Runs is the product's; tests and
    benchmarks hand the controller one of their own (stand-in members)."""

    def launch(self, cfg: DeploymentConfig, results: Path, key: ApiKey, extra_env: dict[str, str]) -> Record: ...

    def run_of(self, record: Record) -> Run: ...

    def slurm_queries(self) -> int | None:
        """Queries about jobs made so far (what sites rate-limit), None where there is no Slurm."""


@dataclass
class Runs:
    """Deployments started here or as Slurm jobs, their jobs followed together: every SlurmRun made by
    run_of shares one JobWatcher, so the state of all of them costs one squeue call per interval.
    driver_module: what the job runs (the driver; a test may run a stand-in member instead)."""

    jobs: JobWatcher
    driver_module: str = DRIVER_MODULE

    @classmethod
    def default(cls, check_every_s: float, driver_module: str = DRIVER_MODULE) -> Runs:
        return cls(JobWatcher(SlurmClient(), check_every_s), driver_module)

    def launch(self, cfg: DeploymentConfig, results: Path, key: ApiKey, extra_env: dict[str, str]) -> Record:
        record = launch(cfg, results, key, extra_env, self.driver_module, self.jobs.client)
        if record.job_id:
            self.jobs.watch(record.job_id)
        return record

    def run_of(self, record: Record) -> LocalRun | SlurmRun:
        return run_of(record, self.jobs)

    def slurm_queries(self) -> int | None:
        return self.jobs.calls


def expected_start(cfg: DeploymentConfig, results: Path, slurm: SlurmClient | None = None) -> WillRun | None:
    """When Slurm would start this deployment's job if it were submitted now (`sbatch --test-only` on the
    script `launch` would submit); None in local mode or when Slurm gives no estimate (an error, a site's
    sbatch wrapper): the caller plans without a queue wait then."""
    if cfg.cluster.scheduler == "local":
        return None
    try:
        return (slurm or SlurmClient()).will_run(render_batch_script(cfg, config_yaml(cfg), sys.executable, results))
    except HpcserveError:
        return None


def config_yaml(cfg: DeploymentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def new_run_dir(results: Path, name: str) -> Path:
    """A run's folder: new (a folder already there under a new run's name was put there by someone, or
    left by an earlier cluster that reused job ids: never taken over) and ours alone (0700)."""
    return private_dir(private_dir(results / "logs") / name, fresh=True)


def without_key_variable(cfg: DeploymentConfig) -> dict[str, None]:
    """The API key's variable unset for sbatch, whose --export=ALL would copy it into Slurm's records."""
    return {cfg.serve.api_key_env: None} if cfg.serve.api_key_env else {}


def fill_run_dir(paths: RunPaths, cfg: DeploymentConfig, key: ApiKey) -> None:
    """What a run's process reads at its start: the config and the key, each a new file only we can read."""
    write_private_text(paths.config, config_yaml(cfg))
    store_key(paths.root, key)


# A process's start as an epoch is its start since boot plus the boot time, which the kernel gives in whole
# seconds, recomputed from the wall clock: when NTP moves the clock across a second, the same process
# starts a second earlier or later (psutil itself identifies processes by the time since boot for this
# reason, psutil#2366). With a 1 s bound CI saw `up` take two live controllers for exited and stop them.
# A reused PID belongs to a process started after ours ended: far more than this apart in practice.
PID_REUSE_S = 10.0


@dataclass
class LocalRun(WithoutSlurmJob):
    """A detached process here: it outlives the command that started it and the terminal it ran in."""

    record: Record

    @classmethod
    def start(cls, cfg: DeploymentConfig, results: Path, module: str, kind: RunKind, key: ApiKey,
              extra_env: dict[str, str]) -> LocalRun:
        tag = "endpoint" if kind is RunKind.ENDPOINT else "local"
        paths = RunPaths(new_run_dir(results, f"{cfg.name}-{tag}-{time.strftime('%Y%m%d-%H%M%S')}"))
        fill_run_dir(paths, cfg, key)
        record = Record(name=cfg.name, scheduler=cfg.cluster.scheduler, run_dir=str(paths.root), kind=kind)
        return cls(record).spawn(module, extra_env)

    @classmethod
    def restart(cls, record: Record, module: str, extra_env: dict[str, str]) -> LocalRun:
        """A new process of `module` in the record's run folder (its log appended to); the returned
        record names the new process."""
        return cls(Record.from_dict(record.to_dict())).spawn(module, extra_env)

    def spawn(self, module: str, env: dict[str, str]) -> LocalRun:
        """Start `python -m module RUN_DIR` detached (its own session: it outlives this command and its
        terminal), for its owner alone (umask 077), and record its PID, start time and host."""
        with umask(PRIVATE_UMASK), open(self.log, "ab") as out:
            process = subprocess.Popen([sys.executable, "-m", module, self.record.run_dir], stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                       env={**os.environ, **env}, umask=PRIVATE_UMASK)
        self.record.driver_pid, self.record.host = process.pid, socket.gethostname()
        self.record.driver_started = psutil.Process(process.pid).create_time()
        return self

    @property
    def log(self) -> Path:
        paths = RunPaths(Path(self.record.run_dir))
        return paths.endpoint_log if self.record.kind is RunKind.ENDPOINT else paths.driver_log

    def elsewhere(self) -> str | None:
        """The host it runs on when that is not this one (a cluster's other login node): its PID cannot be
        checked from here."""
        host = self.record.host
        return host if host and host != socket.gethostname() else None

    def process(self) -> psutil.Process | None:
        """Our process, alive; None once it exited or its PID belongs to another program now."""
        if not self.record.driver_pid or self.elsewhere():
            return None
        try:
            proc = psutil.Process(self.record.driver_pid)
            if self.started_elsewhen(proc.create_time()):
                return None  # the PID was reused by another process
            return proc if alive(proc) else None
        except psutil.NoSuchProcess:
            return None

    def gone(self) -> str | None:
        """None also when it runs on another host: it cannot be checked from here, and taking it for dead
        would let a second controller start beside a live one."""
        if self.elsewhere():
            return None
        if self.process():
            return None
        return f"the {self.record.kind} process exited (see {self.log.name}){self.reused_pid_note()}"

    def started_elsewhen(self, started: float) -> bool:
        """A process that started then is not ours (known only when our start was recorded)."""
        ours = self.record.driver_started
        if not ours:
            return False
        return abs(started - ours) > PID_REUSE_S

    def reused_pid_note(self) -> str:
        """When its PID runs something that did not start when ours did: both start times, so that a
        mistaken 'exited' can be told from a real one."""
        try:
            started = psutil.Process(self.record.driver_pid).create_time()
        except (psutil.Error, ValueError, TypeError):
            return ""
        if not self.started_elsewhen(started):
            return ""  # a zombie of ours, or no start recorded
        return f"; PID {self.record.driver_pid} now runs a process started at {started:.2f}, ours at " \
               f"{self.record.driver_started:.2f}"

    def runner_line(self) -> str:
        """What `status` says of the process."""
        where = f" on {self.elsewhere()} (not checked from here: run `hpcserve status` there)" if self.elsewhere() else ""
        return f"{self.record.kind} pid {self.record.driver_pid}{where}"

    def stop(self, timeout_s: float = 90.0, grace_s: float = 0.0) -> list[int]:
        """SIGTERM (the driver stops engines, then Ray, in order); whatever the orderly stop missed is
        killed by the PIDs recorded before. Returns PIDs still alive afterwards, which should be none.
        grace_s: first give a driver that is finishing on its own this long to end by itself."""
        process = self.process()
        if process is None:
            return []
        if grace_s:
            psutil.wait_procs([process], timeout=grace_s)
        tree = [process] + process.children(recursive=True)
        process.terminate()
        psutil.wait_procs([process], timeout=timeout_s)
        return kill_survivors(tree)


@dataclass
class SlurmRun:
    """A batch job whose script execs the driver; Slurm is asked about it through one client."""

    record: Record
    jobs: JobWatcher | None = None  # shared with other runs: one squeue for all; None: asked alone
    slurm: SlurmClient = field(default_factory=SlurmClient)  # submits, asks (without `jobs`) and cancels

    @classmethod
    def submit(cls, cfg: DeploymentConfig, results: Path, key: ApiKey, extra_env: dict[str, str],
               driver_module: str = DRIVER_MODULE, slurm: SlurmClient | None = None) -> SlurmRun:
        """sbatch --hold, the run folder filled (config, key, script), then the job released: when the job
        starts, what it reads is there, and only we could have put it there."""
        script = render_batch_script(cfg, config_yaml(cfg), sys.executable, results, driver_module)
        staging = private_dir(private_dir(results / "logs") / f".submit-{cfg.name}-{secrets.token_hex(4)}",
                              fresh=True)
        client = slurm or SlurmClient()
        try:
            # sbatch exports the submitter's environment and umask to the job: never the key's variable
            # (the job reads the key from its run folder), the rest as it is (extra_env holds no secret)
            with environment_variables({**extra_env, **without_key_variable(cfg)}), umask(PRIVATE_UMASK):
                job_id = client.submit(script, staging, hold=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # a refused submission leaves nothing behind
            raise
        try:
            paths = RunPaths(new_run_dir(results, f"{cfg.name}-{job_id}"))
            (staging / paths.job_script.name).replace(paths.job_script)
            staging.rmdir()
            fill_run_dir(paths, cfg, key)
            client.release(job_id)
        except BaseException:
            _cancel_quietly(client, job_id)  # a held job that cannot be prepared never runs
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls(Record(name=cfg.name, scheduler="slurm", run_dir=str(paths.root), job_id=job_id), slurm=client)

    @property
    def job_id(self) -> str:
        """Its Slurm job: run_of makes a LocalRun of a record without one."""
        if self.record.job_id is None:
            raise ValueError(f"{self.record.name}: a Slurm run's record names no job")
        return self.record.job_id

    @property
    def log(self) -> Path:
        return RunPaths(Path(self.record.run_dir)).slurm_out

    def info(self) -> JobInfo | None:
        """The job as Slurm knows it now (through the shared watcher: as of its last call, at most its
        interval ago); None when no Slurm command knows it (or Slurm did not answer)."""
        if self.jobs is not None:
            return self.jobs.info(self.job_id)
        try:
            return self.slurm.job(self.job_id)
        except SlurmError:
            return None

    def info_now(self) -> JobInfo | None:
        try:
            return self.slurm.job_now(self.job_id)
        except SlurmError:
            return None

    def gone(self) -> str | None:
        info = self.info()
        if info is None:
            return "the Slurm job is no longer known to Slurm"
        return None if not info.state.finished else f"the Slurm job ended: {info.describe()}"

    def runner_line(self) -> str:
        """What `status` says of the job: its state as Slurm tells it now."""
        info = self.info()
        return f"job {self.job_id}: {info.describe() if info else 'unknown to Slurm'}"

    def queue_position(self) -> int | None:
        """The pending job's place in its partition's queue (1 = next); None when not pending or Slurm did
        not answer."""
        try:
            return self.slurm.queue_position(self.job_id)
        except SlurmError:
            return None

    def queue_line(self) -> str | None:
        """The job's state in one line while Slurm still holds it ("PENDING (Resources)", "RUNNING on ..."),
        else None (finished or unknown)."""
        info = self.info()
        return info.describe() if info is not None and info.state.active else None

    def stop(self, timeout_s: float = 90.0, grace_s: float = 0.0) -> list[int]:
        client = self.slurm
        info = self.info()
        if info is None or info.state.finished:
            return []
        job = self.job_id
        if grace_s and self.wait_finished(grace_s):
            return []
        if info.state is JobState.PENDING:  # nothing runs yet: a signal has nowhere to go
            client.cancel(job)
            self.wait_finished(timeout_s)
            return []
        # TERM to the batch shell alone: the driver stops engines, then Ray, in order (TERM to every step
        # at once kills the Ray head under the driver's feet). If it hangs past the deadline, a plain
        # scancel lets Slurm kill everything.
        client.cancel(job, signal="TERM", batch_only=True)
        if not self.wait_finished(timeout_s):
            client.cancel(job)
            self.wait_finished(60)
        return []

    def wait_finished(self, timeout_s: float) -> bool:
        """Wait until the job has finished; False when timeout_s passed first. With a shared watcher
        the job is seen through its calls (one squeue for all jobs: many members stopping at once do not
        multiply the queries); alone, polled with backoff."""
        if self.jobs is None:
            try:
                return self.slurm.wait_for(self.job_id, lambda j: j.state.finished, timeout=timeout_s,
                                              poll=0.5).state.finished
            except JobWaitTimeout:
                return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.jobs.info(self.job_id)
            if info is None or info.state.finished:
                return True
            time.sleep(FINISH_POLL_S)
        return False


def _cancel_quietly(client: SlurmClient, job_id: str) -> None:
    try:
        client.cancel(job_id)
    except SlurmError:
        pass  # the original failure is the news


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_survivors(procs: list[psutil.Process]) -> list[int]:
    """SIGKILL what is still alive of processes recorded before; returns the PIDs that survived even that."""
    survivors = [p for p in procs if alive(p)]
    for proc in survivors:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(survivors, timeout=10)
    return [p.pid for p in still]
