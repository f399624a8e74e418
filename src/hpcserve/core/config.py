"""The one deployment file: its schema, and loading it with errors a user can act on.

Every error names the field, the bad value and the fix; unknown keys list the valid ones.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from hpcserve.core.config_checks import (
    checked_engine_args,
    layout_problem,
    looks_secret,
    no_key_problem,
    slots_per_node,
)
from hpcserve.core.config_errors import format_error, short
from hpcserve.core.errors import ConfigError
from hpcserve.core.statuses import Routing

BUILTIN_TINY = "builtin:tiny-llama"
NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"
# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^UNLIMITED$|^infinite$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(Strict):
    """What to serve: the weights, the name clients ask for, and how vLLM loads them."""

    path: str = Field(description=f"local folder, a hub id, or {BUILTIN_TINY} (a random-weight Llama built on "
                      "first use into ~/.cache/hpcserve, no download); on Slurm a folder every compute node can read")
    catalog: str | None = Field(None, description="a catalogue name such as llama-3.1-70b: the model's shape and "
                                "recommended settings without reading config.json (`hpcserve plan --list-models`)")
    served_name: str | None = Field(None, description="name clients use in requests (their `model`); default: "
                                    "the folder name, the last part of path")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="vLLM --dtype of weights and activations; auto: the checkpoint's, except float32 "
        "checkpoints, which vLLM runs in bfloat16. The planner sizes memory by it. float32 works on every CPU "
        "(bfloat16 crashes some with SIGILL)")
    max_model_len: int | None = Field(None, gt=0, description="context length in tokens (vLLM --max-model-len); "
                                      "default: the model's")
    quantization: str | None = Field(None, description="vLLM --quantization, e.g. awq, gptq, fp8")

    @property
    def name(self) -> str:
        if self.served_name:
            return self.served_name
        return Path(self.path.removeprefix("builtin:")).name or self.path


class ClusterSpec(Strict):
    """Where the deployment runs, this machine or Slurm, and the resources of each node."""

    scheduler: Literal["local", "slurm"] = Field(
        "local", description="local: everything on this machine (one node); slurm: the engines run in Slurm "
        "batch jobs submitted from this machine (a login node)")
    nodes: int = Field(1, gt=0, description="nodes of the deployment: parallelism must fit in nodes x the workers "
                       "a node holds (one per GPU, or per CPU core with gpus_per_node 0), and the planner searches "
                       "within them. Slurm: the job's --nodes with serve.router false; behind the router each "
                       "replica's job gets the nodes its layout needs. local: 1")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node, one engine worker each (--gpus-per-node unless "
                               "site.gres is false); 0 runs vLLM on CPUs")
    cpus_per_node: int = Field(2, gt=0, description="CPU cores per node: the job's --cpus-per-task (one task per "
                               "node) and Ray's CPUs on each node; with gpus_per_node 0 also the engine workers a "
                               "node holds, one per core")
    gpu_memory_gb: float = Field(80.0, gt=0, description="memory of one GPU in GiB, used by the planner to fit "
                                 "weights and KV cache")
    partition: str | None = Field(None, description="Slurm partition (--partition); null: the cluster's default "
                                  "partition")
    account: str | None = Field(None, description="Slurm account charged (--account); null: your default account")
    qos: str | None = Field(None, description="Slurm quality of service (--qos); null: your account's default")
    time: str = Field("01:00:00", description="Slurm walltime of each job (--time): minutes (30), H:M:S "
                      "(1:00:00) or D-H:M:S (2-00:00:00); UNLIMITED and infinite work too")
    setup: list[str] = Field(default_factory=list, description="shell lines run on every node first: module load, venv, container")
    sbatch_extra: list[str] = Field(default_factory=list, description="extra #SBATCH options, e.g. --constraint=h100")

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not SLURM_TIME.match(value):
            raise ValueError("not a Slurm time; use minutes (30), H:M:S (1:00:00) or D-H:M:S (2-00:00:00)")
        return value

    @model_validator(mode="after")
    def _local_is_one_node(self) -> ClusterSpec:
        if self.scheduler == "local" and self.nodes != 1:
            raise ValueError("scheduler 'local' runs on this machine only: set nodes: 1, or scheduler: slurm")
        return self


class Layout(Strict):
    """How a replica is split over workers (GPUs, or CPU cores on CPU nodes) and how many replicas serve;
    `parallelism: auto` lets the planner choose (`hpcserve plan CONFIG` shows its choice, docs/planner.md)."""

    tensor: int = Field(1, gt=0, description="tensor-parallel size (GPUs that split each layer)")
    pipeline: int = Field(1, gt=0, description="pipeline-parallel size (stages, usually one per node)")
    replicas: int = Field(1, gt=0, description="independent engines behind the endpoint")

    @property
    def workers_per_replica(self) -> int:
        return self.tensor * self.pipeline


class EngineSpec(Strict):
    """How each vLLM engine is started: executor, weight loading, compile cache, extra arguments and
    environment."""

    executor: Literal["auto", "ray", "mp", "uni"] = Field("auto", description="auto: a replica of one worker runs in "
                                                         "one process (uni), bigger ones on ray with GPUs, mp on CPUs "
                                                         "(vLLM on CPU refuses ray)")
    args: list[str] = Field(default_factory=list, description="extra vLLM arguments, e.g. ['--enforce-eager']")
    env: dict[str, str] = Field(default_factory=dict, description="environment for every engine process on every node")
    startup_timeout_s: float = Field(600, gt=0, description="seconds the engines get, once started, to answer a "
                                     "real completion; after that the start fails. `hpcserve up` waits at most "
                                     "this + 600 s (its --timeout)")
    load_format: str = Field("auto", pattern=r"^[a-z0-9_]+$", description="how vLLM reads the weights: auto (the "
                             "fastest loader installed on the nodes, benchmarks/results/gpu.md), or a vLLM "
                             "--load-format such as safetensors, runai_streamer, fastsafetensors, instanttensor")
    sleep_mode: Literal["auto", "on", "off"] = Field("auto", description="vLLM's sleep mode (--enable-sleep-mode, "
                                                    "with VLLM_SERVER_DEV_MODE=1 for its /sleep and /wake_up): an "
                                                    "idle model at zero (autoscale.min 0) then sleeps instead of "
                                                    "stopping: its job keeps the allocation, the weights go to host "
                                                    "RAM, GPU memory is freed, and a request wakes it in seconds; "
                                                    "after autoscale.release_after_s asleep the job ends. auto: on "
                                                    "with GPUs and autoscale.min 0, off otherwise (vLLM on CPU "
                                                    "cannot sleep); off: an idle model at zero stops (its job ends)")
    compile_cache: str = Field("auto", description="vLLM's compile cache, shared by every job of the deployment "
                               "and later ones: auto (one folder per model x vLLM version x layout under "
                               "$HPCSERVE_CACHE or ~/.cache/hpcserve), off (vLLM's own default), or a folder "
                               "every node can reach")

    @field_validator("compile_cache")
    @classmethod
    def _cache_setting(cls, value: str) -> str:
        if value not in ("auto", "off") and not value.startswith(("/", "~")):
            raise ValueError("use auto, off, or an absolute folder every node can reach (e.g. /scratch/me/cache)")
        return value

    @field_validator("args")
    @classmethod
    def _no_secrets_in_args(cls, args: list[str]) -> list[str]:
        return checked_engine_args(args)

    @field_validator("env")
    @classmethod
    def _no_secrets_in_env(cls, env: dict[str, str]) -> dict[str, str]:
        secret = next((name for name in env if looks_secret(name)), None)
        if secret:
            raise ValueError(f"{secret} looks like a secret, and engine.env is written into the run's config.yaml "
                             "and job script (and kept by Slurm): put the secret in a file only you can read and "
                             f"give its path instead (e.g. HF_TOKEN_PATH, or `hf auth login`), or export {secret} "
                             "before `hpcserve up` (it reaches the job through Slurm's --export=ALL)")
        return env


class ServeSpec(Strict):
    """The OpenAI-compatible endpoint: its address and API key, the router in front of the replicas, walltime
    handovers."""

    host: str = Field("127.0.0.1", description="address the endpoint binds; 0.0.0.0 on a cluster")
    port: int = Field(8000, ge=1, le=65535, description="TCP port of the endpoint; the replicas' engines take "
                      "the ports above it (without the router: replica i on serve.port + i)")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="name of the environment variable that holds the API key; "
                                    "unset or empty: hpcserve generates one (run folder, mode 0600)")
    insecure_no_api_key: bool = Field(False, description="no API key at all: anyone who can reach a port uses "
                                      "the engines. Only for a machine of your own (scheduler local, loopback "
                                      "host): every user of a shared machine reaches its loopback")
    expected_concurrency: int | None = Field(None, gt=0, description="requests in flight you expect: the "
                                             "planner scores layouts at this load, not at their capacity")
    router: bool = Field(True, description="one endpoint on serve.port in front of all replicas; false: each "
                         "replica is its own endpoint on serve.port + index")
    handover: bool = Field(True, description="Slurm: launch each job's successor ahead of its time limit, so that "
                           "no replica is lost to a walltime (docs/endpoint.md); false: a job is drained at its "
                           "limit and replaced then, a gap in capacity (for jobs far longer than the deployment "
                           "will serve)")
    handover_s: float | None = Field(None, gt=0, description="Slurm: submit a job's successor at least this long "
                                     "before its time limit; the lead is timed from Slurm's queue estimate and the "
                                     "measured startups (docs/endpoint.md)")
    startup_s: float | None = Field(None, gt=0, description="Slurm: a member's startup (job start to serving) as "
                                    "measured on your cluster, for walltime handovers before this deployment "
                                    "measured one (default: 120 s + the weights read at 500 MB/s); `up` judges "
                                    "cluster.time by it, and the startups measured later replace it")
    routing: Routing = Field(Routing.PREFIX, description="how the endpoint picks a replica: prefix (the default: "
                             "a prompt to the replica whose prefix cache holds most of it, unless that one is "
                             "loaded a quarter of its capacity above the lightest; a session header pins a "
                             "conversation: docs/routing.md), least_loaded (fewest in flight per unit of "
                             "capacity), or round_robin")
    admit_kv_share: float = Field(0.4, ge=0, le=1, description="prefix routing with the engines' KV events: "
                                  "while the prompts in flight take more than this share of the replicas' KV "
                                  "caches, new prefills wait in the endpoint and those whose prefix a replica "
                                  "holds go first (more throughput under prefill-heavy overload, a later median "
                                  "first token: docs/routing.md); 0: never wait")
    router_workers: int | None = Field(None, ge=1, le=64, description="processes serving the endpoint's port "
                                       "(one core each); default: a quarter of this machine's cores, 1 to 8")
    migrations: int = Field(2, ge=0, le=16, description="times a stream in flight may continue on another "
                            "replica, from the tokens already sent, when its replica fails or is drained (its job "
                            "ends, a scale-down, `down --member`); 0: a stream dies with its replica")
    hold_s: float = Field(60.0, ge=0, description="while no replica can take a request (none in the pool yet, "
                          "or the only one being replaced), the endpoint holds new requests this long and "
                          "sends them on as soon as one joins; after that they get 503 with Retry-After. "
                          "0: answer 503 at once")
    join: str | None = Field(None, pattern=NAME_PATTERN, description="the name of a running endpoint "
                             "deployment of yours: this model joins its URL (and its API key) instead of "
                             "opening one of its own; requests naming this model's served name come here, with "
                             "this deployment's own replicas, routing, hold_s, autoscale and handover. "
                             "serve.host and serve.port then only place this deployment's engines (they take the "
                             "ports above serve.port). `down` of this deployment takes its model out and leaves the "
                             "other serving (docs/endpoint.md, Many models behind one URL)")


class BurstSpec(Strict):
    """Replicas beyond autoscale.max on a preemptible partition (a scavenger queue): Slurm may take their
    nodes back for a higher-priority job at any time. Its SIGTERM grace (the partition's GraceTime) is when
    the replica's streams move to the others and it leaves the pool; a replacement is asked for where there
    is room (docs/endpoint.md, Burst on preemptible partitions)."""

    partition: str = Field(description="the preemptible partition the burst replicas' jobs go to (--partition)")
    qos: str | None = Field(None, description="their quality of service (--qos), e.g. a site's scavenger QOS; "
                            "null: cluster.qos")
    max: int = Field(1, ge=1, description="burst replicas at most, on top of autoscale.max on the main partition")
    first: bool = Field(False, description="scale up on the burst partition before the main one (cheap cycles "
                        "first); false: only once the main partition's replicas reached autoscale.max")
    signal_s: int = Field(30, ge=1, le=3600, description="the job's --signal=B:USR1@signal_s: before its time "
                          "limit, and at once when it is preempted (the site's SlurmctldParameters="
                          "preempt_send_user_signal), the member tells the controller, which drains it. The "
                          "partition's GraceTime must cover the drain: streams move at once, requests that are "
                          "not streamed finish where they run (or are sent again)")


class AutoscaleSpec(Strict):
    """Replicas follow the load: one Slurm job (or local process) per extra replica, drained and stopped when
    idle. With min 0 the model sleeps: its last replica goes after idle_s without a request, and a request
    for it wakes one (held up to wake_wait_s meanwhile; docs/endpoint.md, Scale to zero)."""

    min: int = Field(1, ge=0, description="replicas always kept; 0: the model sleeps after autoscale.idle_s "
                     "without a request (no job runs) and the next request wakes it")
    max: int = Field(4, ge=1, description="replicas at most")
    target_queue: float = Field(4.0, gt=0, description="waiting requests per replica above which one is added "
                                "(those the engines queue and those the data plane holds back)")
    scale_up_after_s: float = Field(10.0, gt=0, description="how long the queue must stay above target")
    scale_down_after_s: float = Field(60.0, gt=0, description="how long a replica must be idle to be removed")
    idle_s: float | None = Field(None, gt=0, description="with min 0: how long the model must go without a request "
                                 "(none in flight or held) before its last replica goes (its job ends); required "
                                 "with min 0")
    wake_wait_s: float = Field(600.0, gt=0, description="with min 0: how long a request for a sleeping model waits "
                               "for a replica to wake (a job queued and started, the engine loaded); a stream gets "
                               "SSE comments meanwhile. When Slurm's expected start is later, or the time is up: "
                               "503 with Retry-After and the reason (Slurm's pending reason while queued)")
    burst: BurstSpec | None = Field(None, description="more replicas on a preemptible partition when the load "
                                    "rises (beyond max, or first with burst.first); a preempted one hands its "
                                    "streams over and is replaced where there is room")

    release_after_s: float = Field(3600.0, gt=0, description="with min 0 and engines that sleep (engine.sleep_mode): "
                                   "how long a sleeping replica keeps its allocation (a woken one answers in "
                                   "seconds) before its job ends; a request after that waits for a new job")

    @model_validator(mode="after")
    def _min_le_max(self) -> AutoscaleSpec:
        if self.min > self.total_max:
            raise ValueError(f"autoscale.min ({self.min}) is larger than autoscale.max ({self.max})"
                             + (f" + autoscale.burst.max ({self.burst.max})" if self.burst else "")
                             + ": lower min or raise max")
        if self.min == 0 and self.idle_s is None:
            raise ValueError("autoscale.min 0 lets the model sleep: give autoscale.idle_s, how long it must go "
                             "without a request before its last replica goes (e.g. idle_s: 900)")
        if self.min > 0 and self.idle_s is not None:
            raise ValueError(f"autoscale.idle_s is the idle time before the last replica goes, with min 0; "
                             f"autoscale.min is {self.min}: set min 0 or remove idle_s")
        return self

    @property
    def sleeps(self) -> bool:
        """The model goes to zero replicas when idle (min 0)."""
        return self.min == 0

    @property
    def total_max(self) -> int:
        """Replicas at most, the burst partition's included."""
        return self.max + (self.burst.max if self.burst else 0)


# A member's engines take the ports above its replica's: a member slot has 8 (endpoint.control.members),
# its replica's engine and the swap models' engines.
MAX_SWAP_MODELS = 7


class SwapSpec(Strict):
    """Models that share this deployment's GPUs: each member (allocation) starts one engine per model on the
    same GPUs, all but the first asleep (vLLM's sleep mode); a request for a sleeping model puts the least
    recently used awake one to sleep and wakes it (docs/endpoint.md, Several models on one allocation)."""

    models: list[ModelSpec] = Field(min_length=1, max_length=MAX_SWAP_MODELS, description="the other models "
                                    "on the same GPUs (path, served_name, ... as model); each gets its own name "
                                    "at the endpoint (/v1/models says asleep, waking or serving)")
    awake: int = Field(1, ge=1, description="models awake at once on one member's GPUs: their weights and KV "
                       "caches must fit together (vLLM's --gpu-memory-utilization in engine.args shares them)")
    min_awake_s: float = Field(10.0, ge=0, description="a model woken stays awake at least this long before it "
                               "may be put to sleep for another (no swapping back and forth on every request)")
    wake_wait_s: float = Field(60.0, gt=0, description="how long a request for a sleeping model waits for it to "
                               "wake (another put to sleep first, once nothing runs on it and it was awake "
                               "min_awake_s); a stream gets SSE comments meanwhile; then 503 with Retry-After")

    @model_validator(mode="after")
    def _something_to_swap(self) -> SwapSpec:
        if self.awake > len(self.models):
            raise ValueError(f"swap.awake {self.awake} keeps all {len(self.models) + 1} models awake: nothing "
                             f"would sleep. Lower it (at most {len(self.models)}), or serve them as joined "
                             "deployments (serve.join)")
        return self


class SiteSpec(Strict):
    """How a site runs software on its compute nodes (also loadable alone with `--site FILE`)."""

    runtime: Literal["venv", "apptainer", "pyxis"] = Field(
        "venv", description="venv: cluster.setup activates it; apptainer: every process runs in `apptainer exec "
        "--nv IMAGE`; pyxis: srun --container-image=IMAGE")
    image: str | None = Field(None, description="container image (.sif for apptainer, a squashfs or URI for pyxis)")
    container_command: str = Field("apptainer", description="apptainer or singularity (a path works too)")
    binds: list[str] = Field(default_factory=list, description="extra paths mounted into the container; the "
                             "model and results folders are mounted always")
    gres: bool = Field(True, description="false: the partition has no GRES; GPUs are not requested by --gpus-per-node")

    @model_validator(mode="after")
    def _image_for_containers(self) -> SiteSpec:
        if self.runtime != "venv" and not self.image:
            raise ValueError(f"site.runtime '{self.runtime}' needs site.image: the container image to run")
        return self


class ReplicaGroup(Strict):
    """More replicas behind the endpoint in another shape (a heterogeneous pool): other nodes, another
    tensor/pipeline size, other engine arguments. Each of its replicas is its own job, configured as the
    deployment with these fields changed. The endpoint's load-aware rotation sends each replica new
    requests as fast as it finishes them, so traffic follows each replica's capacity."""

    replicas: int = Field(1, gt=0, description="replicas of this shape, each its own Slurm job")
    tensor: int | None = Field(None, gt=0, description="default: parallelism.tensor")
    pipeline: int | None = Field(None, gt=0, description="default: parallelism.pipeline")
    partition: str | None = Field(None, description="default: cluster.partition")
    gpus_per_node: int | None = Field(None, ge=0, description="default: cluster.gpus_per_node")
    cpus_per_node: int | None = Field(None, gt=0, description="default: cluster.cpus_per_node")
    sbatch_extra: list[str] | None = Field(None, description="default: cluster.sbatch_extra")
    engine_args: list[str] = Field(default_factory=list, description="appended to engine.args (the last wins)")

    @field_validator("engine_args")
    @classmethod
    def _no_secrets_in_args(cls, args: list[str]) -> list[str]:
        return checked_engine_args(args)

    def layout(self, base: Layout) -> Layout:
        """One replica of this group's shape."""
        return Layout(tensor=self.tensor or base.tensor, pipeline=self.pipeline or base.pipeline, replicas=1)

    def cluster(self, base: ClusterSpec) -> ClusterSpec:
        changed = {"partition": self.partition, "gpus_per_node": self.gpus_per_node,
                   "cpus_per_node": self.cpus_per_node, "sbatch_extra": self.sbatch_extra}
        return base.model_copy(update={k: v for k, v in changed.items() if v is not None})


class LimitsSpec(Strict):
    """What one key may use (null: no limit). Over a rate: 429 JSON naming the limit, with Retry-After."""

    requests_per_minute: int | None = Field(None, gt=0, description="requests begun in any 60 s")
    tokens_per_minute: int | None = Field(None, gt=0, description="prompt + completion tokens in any 60 s")
    tokens_per_day: int | None = Field(None, gt=0, description="prompt + completion tokens per UTC day")
    max_n: int | None = Field(None, gt=0, description="the most choices one request may ask for (`n`)")
    max_best_of: int | None = Field(None, gt=0, description="the largest `best_of` of one request")
    max_tokens: int | None = Field(None, gt=0, description="the largest max_tokens (max_completion_tokens) of one "
                                   "request; a request without one is sent with this")


class SelfServiceSpec(Strict):
    """Keys without an administrator: a user logged in on the endpoint's host runs `hpcserve keys request
    NAME --owner OWNER` and gets a key of their own, identified by the operating system (the peer credentials
    of a Unix socket), bound to their Unix name and, where Slurm's accounting knows it, their default account
    as the project."""

    allow: bool = Field(False, description="serve the self-service socket while the endpoint runs")
    users: list[str] | None = Field(None, description="Unix names that may ask; null: every user of the host")
    limits: LimitsSpec = Field(LimitsSpec(), description="the limits of a self-service key (over tenancy.limits)")
    expires_days: float | None = Field(30, gt=0, description="a self-service key's lifetime in days; null: no end")
    project_from_slurm: bool = Field(True, description="the key's project: the user's default Slurm account "
                                     "(sacctmgr), where accounting knows it")


class TenancySpec(Strict):
    """Users behind one endpoint: keys of their own, limits, a usage record and a fair share (docs/tenancy.md).
    The deployment's own key stays the owner's and is never limited by a rate."""

    enabled: bool = Field(True, description="users' own keys, limits and the usage record on the endpoint; "
                          "off with serve.insecure_no_api_key (nobody's key to stand beside)")
    database: str | None = Field(None, description="where keys and usage live: null for an SQLite file "
                                 "RESULTS_DIR/NAME-tenancy.sqlite (kept across `down` and `up`), a path of one, or "
                                 "postgresql://USER@HOST/DB for a service on several hosts (its password from "
                                 "~/.pgpass, never in this file)")
    limits: LimitsSpec = Field(LimitsSpec(max_n=16, max_best_of=16), description="every key's limits, the owner's "
                               "caps included; a key's own limits replace these one by one")
    shares: dict[str, float] = Field(default_factory=dict, description="fair-share weights of projects (as Slurm's "
                                     "fair-share weights accounts): while requests wait for a full pool, a project "
                                     "of weight 2 gets twice the turns of one of weight 1; others weigh 1")
    pause_streams: bool = Field(True, description="while a user below their fair share would wait for a place, "
                                "one stream of the user furthest above theirs pauses and continues from its tokens "
                                "when a place frees (its client sees one stream, only slower); off: the request "
                                "waits for one of theirs to end")
    usage_flush_s: float = Field(1.0, gt=0, le=60, description="seconds between the data plane's batched writes "
                                 "of usage rows: what a killed data-plane worker can lose at most")
    self_service: SelfServiceSpec = Field(SelfServiceSpec(), description="keys that cluster users get themselves")

    @field_validator("database")
    @classmethod
    def _no_password_in_url(cls, url: str | None) -> str | None:
        if url and url.startswith(("postgresql://", "postgres://")):
            userinfo = url.split("://", 1)[1].split("@", 1)
            if len(userinfo) == 2 and ":" in userinfo[0]:
                raise ValueError("tenancy.database has a password in it: put it in ~/.pgpass (mode 0600) and "
                                 "write the URL without it, postgresql://USER@HOST/DB")
        return url

    @field_validator("shares")
    @classmethod
    def _positive_shares(cls, shares: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in shares.items() if not v > 0}
        if bad:
            raise ValueError(f"tenancy.shares must be > 0; not {bad}")
        return shares


class DeploymentConfig(Strict):
    """A deployment file: one model served on one cluster behind one endpoint."""

    name: str = Field(pattern=NAME_PATTERN, description="the deployment's name (`hpcserve status NAME`, "
                      "`hpcserve down NAME`): lowercase letters, digits and '-', at most 40")
    model: ModelSpec = Field(description="the model to serve")
    cluster: ClusterSpec = Field(ClusterSpec(), description="where it runs and each node's resources")
    parallelism: Literal["auto"] | Layout = Field(Layout(), description="'auto' or {tensor, pipeline, replicas}")
    engine: EngineSpec = Field(EngineSpec(), description="how each vLLM engine is started")
    serve: ServeSpec = Field(ServeSpec(), description="the endpoint clients use")
    autoscale: AutoscaleSpec | None = Field(None, description="replicas follow the load: Slurm jobs, or local "
                                            "processes; min 0: the model sleeps when idle, a request wakes it")
    replica_groups: list[ReplicaGroup] = Field(default_factory=list, description="more replicas of other shapes "
                                               "behind the endpoint (serve.router), besides parallelism's")
    site: SiteSpec = Field(SiteSpec(), description="how the site runs software on its compute nodes; "
                           "`--site FILE` replaces it (docs/sites.md)")
    tenancy: TenancySpec = Field(TenancySpec(), description="users, keys, limits, usage and fair share")
    swap: SwapSpec | None = Field(None, description="more models on the same GPUs as this one, the ones in "
                                  "demand awake (vLLM's sleep mode, GPUs only)")
    results_dir: str = Field("results", description="folder of the run folders (logs/NAME-ID/: logs, state, the "
                             "generated API key), relative to the current folder; on Slurm one every compute node "
                             "mounts. Refused when others can write into it")

    @model_validator(mode="after")
    def _layout_fits(self) -> DeploymentConfig:
        if isinstance(self.parallelism, Layout):
            problem = layout_problem(self.parallelism, self.cluster)
            if problem:
                raise ValueError(problem)
        if self.site.runtime != "venv" and self.cluster.scheduler == "local":
            raise ValueError(f"site.runtime '{self.site.runtime}' wraps Slurm job steps; scheduler 'local' runs "
                             "outside any container: set cluster.scheduler: slurm or site.runtime: venv")
        problem = self._burst_problem()
        if problem:
            raise ValueError(problem)
        if self.autoscale and not self.serve.router:
            raise ValueError("autoscale adds and removes replicas (Slurm jobs or local processes) behind the "
                             "endpoint: it needs serve.router true (or remove autoscale)")
        for index, group in enumerate(self.replica_groups, start=1):
            problem = self._group_problem(group)
            if problem:
                raise ValueError(f"replica_groups[{index}]: {problem}")
        if (self.engine.executor == "uni" and isinstance(self.parallelism, Layout)
                and self.parallelism.workers_per_replica > 1):
            raise ValueError("engine.executor 'uni' runs a replica in one process: it needs tensor x pipeline = 1 "
                             "(use auto, mp or ray for bigger replicas)")
        problem = no_key_problem(self.serve, self.cluster)
        if problem:
            raise ValueError(problem)
        if self.serve.join is not None and not self.serve.router:
            raise ValueError("serve.join puts this model behind another deployment's endpoint (its router): it "
                             "needs serve.router true (or remove serve.join)")
        if self.serve.join == self.name:
            raise ValueError(f"serve.join '{self.name}' names this deployment itself: name the running endpoint "
                             "whose URL this model joins")
        if self.executor == "ray" and self.cluster.gpus_per_node == 0:
            raise ValueError("engine.executor 'ray' needs GPUs (vLLM on CPU refuses it): use 'mp' or set cluster.gpus_per_node")
        problem = sleep_mode_problem(self.engine.sleep_mode, self.cluster.gpus_per_node, self.autoscale)
        if problem:
            raise ValueError(problem)
        problem = self._swap_problem()
        if problem:
            raise ValueError(problem)
        return self

    def _swap_problem(self) -> str | None:
        swap = self.swap
        if swap is None:
            return None
        if self.cluster.gpus_per_node == 0 or self.engine.sleep_mode == "off":
            return ("swap puts models to sleep on the GPUs they share (vLLM's sleep mode), which needs GPU engines: "
                    "set cluster.gpus_per_node and engine.sleep_mode auto or on (vLLM on CPU cannot sleep; serve "
                    "other models there as joined deployments, serve.join)")
        if self.engine.executor == "ray":  # vLLM's Ray executor takes the GPUs from Ray: a second engine finds none
            return ("swap starts several engines on the same GPUs, and vLLM's Ray executor reserves them for one: "
                    "set engine.executor auto or mp (swap needs replicas within one node)")
        if self.serve.join is not None:  # its rooms would be made in another deployment's data plane
            return ("swap gives every model a name at this deployment's own endpoint: remove serve.join (a joined "
                    "deployment cannot bring swapped models)")
        if self.autoscale is not None:
            return ("swap keeps its models on the members parallelism.replicas starts; autoscale (and scale to "
                    "zero) of swapped models is not supported yet: remove autoscale, or serve the model alone")
        names = [self.model.name, *(m.name for m in swap.models)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            return (f"swap: the served name {twice[0]!r} is there twice (model and swap.models): clients tell the "
                    "models apart by it; give each a model.served_name of its own")
        return None

    def _burst_problem(self) -> str | None:
        burst = self.autoscale.burst if self.autoscale else None
        if burst is None:
            return None
        if self.cluster.scheduler != "slurm":
            return ("autoscale.burst places replicas on a preemptible Slurm partition: it needs cluster.scheduler "
                    "slurm (or remove autoscale.burst)")
        if burst.partition == self.cluster.partition and burst.qos in (None, self.cluster.qos):
            return (f"autoscale.burst.partition '{burst.partition}' is cluster.partition, with the same QOS: "
                    "burst replicas would be ordinary ones. Name the preemptible partition (e.g. scavenger), "
                    "or raise autoscale.max instead")
        return None

    def _group_problem(self, group: ReplicaGroup) -> str | None:
        if not self.serve.router:
            return "replica groups run behind the endpoint: set serve.router true (or remove replica_groups)"
        if not isinstance(self.parallelism, Layout):
            return "give parallelism as {tensor, pipeline, replicas} (not 'auto') with replica_groups"
        cluster = group.cluster(self.cluster)
        layout = group.layout(self.parallelism)
        nodes = -(-layout.workers_per_replica // slots_per_node(cluster))
        return layout_problem(layout, cluster.model_copy(update={"nodes": max(nodes, 1)}))

    @property
    def executor(self) -> str:
        """The executor of a replica of several workers (tensor x pipeline > 1)."""
        if self.engine.executor != "auto":
            return self.engine.executor
        return "ray" if self.cluster.gpus_per_node > 0 else "mp"

    def executor_for(self, workers: int) -> str:
        """A replica of one worker needs no worker processes: vLLM's uni executor runs it in the engine
        core's own process (one process fewer to start: 17-22 s against 27-31 s to the first completion
        for the tiny model on CPU, benchmarks/results/HISTORY.md; on CPU with
        VLLM_ENABLE_V1_MULTIPROCESSING=0, set by engine.replicas)."""
        if self.engine.executor == "auto" and workers == 1:
            return "uni"
        return self.executor

    @property
    def on_gpu(self) -> bool:
        return self.cluster.gpus_per_node > 0

    @property
    def engine_sleeps(self) -> bool:
        """The engines start with vLLM's sleep mode: an idle model at zero sleeps instead of stopping, and
        swapped models sleep while others use their GPUs."""
        if self.engine.sleep_mode == "auto":
            return self.on_gpu and (self.swap is not None or (self.autoscale is not None and self.autoscale.sleeps))
        return self.engine.sleep_mode == "on"

    def swap_ports(self, replica: int = 0) -> list[int]:
        """The ports of one replica's swap model engines, above all the replicas' (replica i on serve.port + i)."""
        if self.swap is None:
            return []
        replicas = self.parallelism.replicas if isinstance(self.parallelism, Layout) else 1
        first = self.serve.port + replicas + replica * len(self.swap.models)
        return list(range(first, first + len(self.swap.models)))

    @property
    def hands_over(self) -> bool:
        """Each job gets a successor before its time limit: behind an endpoint on Slurm, unless turned off."""
        return self.cluster.scheduler == "slurm" and self.serve.router and self.serve.handover


def sleep_mode_problem(mode: str, gpus_per_node: int, autoscale: AutoscaleSpec | None) -> str | None:
    """Why engine.sleep_mode does not fit the rest of the config (None: it does). Pure."""
    if mode != "on":
        return None
    if gpus_per_node == 0:
        return ("engine.sleep_mode 'on' needs GPUs: vLLM on CPU has no sleep mode (an idle model at zero stops "
                "instead). Use sleep_mode auto or off, or set cluster.gpus_per_node")
    if autoscale is not None and not autoscale.sleeps:
        return (f"engine.sleep_mode 'on' is what an idle model at zero does (autoscale.min 0); autoscale.min is "
                f"{autoscale.min}: set autoscale.min 0 with idle_s, or sleep_mode auto")
    return None


# ---------------------------------------------------------------- loading

def load_config(path: str | Path) -> DeploymentConfig:
    """Read and validate a deployment file. Raises ConfigError with one readable message."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file. Pass the path of a deployment YAML, e.g. examples/local.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): is it the deployment YAML? Save it as "
                          "UTF-8") from None
    try:
        raw = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a deployment file: check its brackets") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}. Fix the syntax (indentation, colons, quotes).") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping with keys {', '.join(DeploymentConfig.model_fields)}")
    return parse_config(raw, source=str(path))


def parse_config(raw: dict[str, Any], source: str = "config") -> DeploymentConfig:
    try:
        return DeploymentConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [format_error(err, raw, DeploymentConfig) for err in exc.errors(include_url=False)]
        raise ConfigError(f"{source}: " + ("\n".join(lines) if len(lines) == 1 else "\n  - " + "\n  - ".join(lines))) from None


# ---------------------------------------------------------------- comparing

def config_differences(running: DeploymentConfig, given: DeploymentConfig) -> list[str]:
    """Where two deployments differ, one line per field ('serve.port: 8300 running, 8301 given'). Pure."""
    return _differences(running.model_dump(mode="json"), given.model_dump(mode="json"), "")


def _differences(running: Any, given: Any, where: str) -> list[str]:
    if isinstance(running, dict) and isinstance(given, dict):
        keys = sorted(running.keys() | given.keys(), key=str)
        return [line for key in keys
                for line in _differences(running.get(key), given.get(key), f"{where}.{key}" if where else key)]
    return [] if running == given else [f"{where}: {short(running)} running, {short(given)} given"]
