"""Every status word hpcserve writes or shows, as enums. They are `str` enums: state.json keeps the same
words, and a status compares equal to its word."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """A deployment's status, as its driver or endpoint writes it into state.json."""

    SUBMITTED = "submitted"  # nothing written yet: the job waits, or the process is starting
    STARTING = "starting"
    READY = "ready"
    CHECKED = "checked"  # `hpcserve check`: the health check passed and Ray stopped again
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"
    # What `status` says when what is alive now contradicts the file:
    DEAD = "dead"  # the file says running, but its process or job is gone
    DEGRADED = "degraded"  # ready, but a replica does not answer
    UNCONTROLLED = "uncontrolled"  # an endpoint whose controller is gone while its router or replicas run
    HOLDING = "holding"  # an endpoint's data plane has no replica to send to: requests wait (serve.hold_s)
    ASLEEP = "asleep"  # autoscale.min 0: scaled to zero while idle; a request wakes it
    WAKING = "waking"  # asleep, and a replica is queued or starting for the requests that came

    @property
    def final(self) -> bool:
        """`up` stops following at these."""
        return self in (RunStatus.READY, RunStatus.FAILED, RunStatus.STOPPED, RunStatus.CHECKED)

    @property
    def ended(self) -> bool:
        return self in (RunStatus.FAILED, RunStatus.STOPPED)


class RunKind(StrEnum):
    """What a registered deployment's own process is."""

    DRIVER = "driver"  # the stages of one deployment: local process or Slurm job
    ENDPOINT = "endpoint"  # the router and controller in front of member deployments


class MemberStatus(StrEnum):
    """A member deployment behind an endpoint, as its controller sees it."""

    LAUNCHING = "launching"
    SERVING = "serving"  # its replicas are in the pool
    DRAINING = "draining"  # out of the pool on purpose; stops once its requests finished
    SLEEPING = "sleeping"  # out of the pool, its engine asleep in its allocation (engine.sleep_mode): woken on demand
    STOPPING = "stopping"
    GONE = "gone"
    FAILED = "failed"  # never became ready

    @property
    def live(self) -> bool:
        return self in (MemberStatus.LAUNCHING, MemberStatus.SERVING, MemberStatus.DRAINING, MemberStatus.SLEEPING)

    @property
    def lost(self) -> bool:
        return self in (MemberStatus.STOPPING, MemberStatus.GONE, MemberStatus.FAILED)


class Routing(StrEnum):
    """How the endpoint's data plane chooses a replica for each request (endpoint/dataplane/routing/)."""

    LEAST_LOADED = "least_loaded"  # fewest requests in flight through it, per unit of its capacity
    ROUND_ROBIN = "round_robin"  # each in turn
    PREFIX = "prefix"  # requests sharing a session or a prompt prefix go to the same replica (its KV cache)


class MemberRole(StrEnum):
    """Why a member was launched."""

    INITIAL = "initial"
    REPLACEMENT = "replacement"  # self-healing: for a lost one
    SCALE_UP = "scale-up"  # the autoscaler
    SUCCESSOR = "successor"  # the walltime handover


class Adoption(StrEnum):
    """What a new endpoint controller does with a member its lost predecessor left behind."""

    ADOPT = "adopt"  # its job runs and its replicas answered a real completion: serving on, untouched
    WATCH = "watch"  # still starting (its job queued or loading): watched as a launch of ours
    DROP = "drop"  # its job runs but a replica failed the completion: stopped, replaced as usual
    LOST = "lost"  # its job or driver ended meanwhile: replaced as usual (self-healing)
    FINISH = "finish"  # was being drained or stopped: that is finished now
    KEEP = "keep"  # gone or failed before: history, nothing to do


class Stage(StrEnum):
    """The stages of `up`, in timeline.json."""

    SUBMITTED = "submitted"
    QUEUE = "queue"
    RAY = "ray"
    HEALTH = "health"
    ENGINE = "engine"
    ROUTER = "router"
    ADOPT = "adopt"  # a new controller takes over what a lost one left running
    READY = "ready"
    STOPPED = "stopped"
    DRIVER = "driver"


class StageEvent(StrEnum):
    """What happened to a stage, in timeline.json."""

    STARTED = "started"
    DONE = "done"
    FAILED = "failed"
    WAITING = "waiting"  # the job waits in Slurm's queue
