"""Many jobs followed with one squeue call per interval, whatever their number (submitit's InfoWatcher
does the same "so as not to overload" Slurm: sites rate-limit squeue, and slurmctld answers every
client in turn).

    jobs = JobWatcher(SlurmClient(), interval_s=5.0)
    jobs.watch("123")            # a new job: the next call includes it
    jobs.info("123")             # JobInfo as of the last call (at most interval_s old), None if unknown
    jobs.forget("123")

A call is made when the last one is older than interval_s, or when a watched job has no answer yet (a
job submitted this round is asked about in the same call as all the others). A job that squeue no
longer shows (it ended longer ago than MinJobAge) is asked about alone, once, through SlurmClient.job
(scontrol, then accounting). Finished jobs cannot change: they are not asked about again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from hpcserve.core.errors import SlurmError
from hpcserve.slurm.client import SlurmClient, SlurmJobNotFound
from hpcserve.slurm.states import JobInfo

DEFAULT_INTERVAL_S = 5.0


def jobs_to_ask(watched: set[str], known: dict[str, JobInfo | None]) -> list[str]:
    """The jobs one squeue call must ask about: every watched job not known to have finished, nor known
    to be unknown to Slurm (None: no command knows it; asking again would not change that). Pure."""
    return sorted(j for j in watched if j not in known or ((info := known[j]) is not None and not info.state.finished))


def refresh_due(last_call: float | None, now: float, interval_s: float, watched: set[str],
                known: dict[str, JobInfo | None]) -> bool:
    """Ask Slurm now? When the last answer is older than interval_s, or a watched job has no answer
    yet (and at least a second has passed, so that a burst of launches costs one call). Pure."""
    if last_call is None:
        return bool(watched)
    if not jobs_to_ask(watched, known):
        return False
    age = now - last_call
    return age >= interval_s or (any(j not in known for j in watched) and age >= 1.0)


class JobWatcher:
    """Thread-safe: the controller's loop and its background stops share one."""

    def __init__(self, client: SlurmClient | None = None, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.client = client or SlurmClient()
        self.interval_s = interval_s
        self.clock = clock
        self.watched: set[str] = set()
        self.known: dict[str, JobInfo | None] = {}  # None: no Slurm command knows the job
        self.last_call: float | None = None
        self.asked: set[str] = set()  # jobs asked about at least once
        self.calls = 0  # squeue calls made (what sites rate-limit), for status and the benchmarks
        self.last_error: str | None = None
        self._lock = threading.Lock()

    def watch(self, job_id: str) -> None:
        with self._lock:
            self.watched.add(job_id)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self.watched.discard(job_id)
            self.known.pop(job_id, None)

    def info(self, job_id: str) -> JobInfo | None:
        """The job as of the last answer; None when Slurm does not know it (or did not answer). A job
        never asked about is asked about now (with all others: watch() jobs first, and one call answers
        for all of them), so that "not asked yet" is never taken for "unknown to Slurm"."""
        with self._lock:
            self.watched.add(job_id)
            if job_id not in self.asked or refresh_due(self.last_call, self.clock(), self.interval_s,
                                                       self.watched, self.known):
                self._refresh()
            return self.known.get(job_id)

    def _refresh(self) -> None:
        asked = jobs_to_ask(self.watched, self.known)
        self.asked |= set(asked)
        self.last_call = self.clock()
        self.calls += 1
        try:
            answer = self.client.jobs(asked)
        except SlurmError as exc:  # Slurm busy or down: keep the last answers, try again next interval
            self.last_error = str(exc)[:300]
            return
        self.last_error = None
        self.known.update(answer)
        for job_id in (j for j in asked if j not in answer):
            self._ask_alone(job_id)

    def _ask_alone(self, job_id: str) -> None:
        """squeue forgot it: scontrol or accounting may still know how it ended."""
        try:
            self.known[job_id] = self.client.job(job_id)
        except SlurmJobNotFound:
            self.known[job_id] = None
        except SlurmError:  # Slurm did not answer: asked again with the next call
            pass
