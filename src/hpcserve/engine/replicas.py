"""Replicas: N independent engines (each tensor x pipeline), placed on the Ray cluster and watched.

mp executor: one vLLM process per node of a replica (vLLM's multi-node multiprocessing mode when a
replica spans nodes), each inside a placement-group bundle spread across nodes (STRICT_SPREAD).
ray executor: one vLLM API process per replica on its first node; vLLM places its workers itself
through its own placement group on our Ray cluster.
uni executor (auto, for a replica of one worker): one vLLM process, placed like mp's.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcserve.core.config import DeploymentConfig, Layout, ModelSpec
from hpcserve.core.config_checks import slots_per_node
from hpcserve.core.errors import StageError
from hpcserve.core.keys import read_api_key
from hpcserve.core.paths import RunPaths
from hpcserve.engine.args import EngineRole, cpu_thread_binding, engine_argv
from hpcserve.engine.client import completion_probe, engine_sleep, engine_wake_up, health_ok
from hpcserve.engine.compile_cache import (
    CacheUse,
    cache_env,
    cache_folder,
    cache_use,
    vllm_version,
)
from hpcserve.engine.host import EngineHost
from hpcserve.engine.logs import engine_error

logger = logging.getLogger(__name__)

SLEEP_ROUTES_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM serves /sleep, /wake_up and /is_sleeping only with it


def engine_key(cfg: DeploymentConfig, run_dir: Path) -> str | None:
    """The key every engine requires: the run folder's copy, written before the driver started."""
    key = read_api_key(run_dir)
    if key is None and not cfg.serve.insecure_no_api_key:
        raise StageError("engine", f"no API key in {RunPaths(run_dir).api_key}: `hpcserve up` writes it there "
                         "before the driver starts, and engines never run without one", str(run_dir))
    return key


@dataclass(frozen=True)
class ReplicaShape:
    index: int
    nnodes: int
    workers_per_node: int


def replica_shapes(layout: Layout, slots: int) -> list[ReplicaShape]:
    """How many nodes each replica spans and how many workers it puts on each. Pure."""
    workers = layout.workers_per_replica
    nnodes = 1 if workers <= slots else workers // slots
    return [ReplicaShape(i, nnodes, workers // nnodes) for i in range(layout.replicas)]


@dataclass
class EngineProcess:
    replica: int
    rank: int
    actor: Any  # Ray's handle of an EngineHost: Ray's types lack its methods' .remote
    hostname: str
    address: str
    log: Path
    pid: int | None = None
    swap_model: str | None = None  # the engine of this swap model (config swap) on the replica's GPUs

    @property
    def label(self) -> str:
        if self.swap_model:
            return f"replica {self.replica}'s engine of swap model {self.swap_model}"
        return f"replica {self.replica} rank {self.rank}"


@dataclass
class SwapEngine:
    """A swap model's engine on a replica's GPUs (config swap): started, answered, then put to sleep."""

    model: str
    url: str
    process: EngineProcess

    def to_dict(self) -> dict:
        return {"model": self.model, "url": self.url, "replica": self.process.replica, "pid": self.process.pid,
                "log": str(self.process.log)}


@dataclass
class Replica:
    index: int
    url: str
    processes: list[EngineProcess] = field(default_factory=list)
    placement_group: object = None
    placement_seconds: float = 0.0

    def to_dict(self) -> dict:
        """The replica as state.json lists it (url, nodes, processes with their logs, and whether its
        engine loaded compiled graphs from the shared compile cache)."""
        return {"index": self.index, "url": self.url,
                "nodes": [p.hostname for p in self.processes], "placement_s": round(self.placement_seconds, 3),
                "processes": [{"rank": p.rank, "hostname": p.hostname, "address": p.address, "pid": p.pid,
                               "log": str(p.log)} for p in self.processes],
                "compile_cache": self.compile_cache_use()}

    def compile_cache_use(self) -> str:
        """From rank 0's log; "none" before the engine compiled anything (or in eager mode)."""
        log = self.processes[0].log if self.processes else None
        return cache_use(log.read_text(errors="replace")) if log and log.is_file() else CacheUse.NONE


class ReplicaSet:
    def __init__(self, cfg: DeploymentConfig, layout: Layout, model_path: str, run_dir: Path,
                 api_key: str | None, master_port: int, gcs_address: str, load_args: list[str] | None = None,
                 swap_models: list[tuple[ModelSpec, str]] | None = None):
        self.cfg = cfg
        self.layout = layout
        self.model_path = model_path
        self.run_dir = run_dir
        self.api_key = api_key
        self.master_port = master_port
        self.gcs_address = gcs_address
        self.load_args = load_args or []  # --load-format chosen for this node (engine.load_format)
        self.replicas: list[Replica] = []
        self.swap_models = swap_models or []  # config swap: each model with the path its engines load
        self.swap_engines: list[SwapEngine] = []

    # ------------------------------------------------------------ start
    def start(self) -> None:
        """Every replica's engines; returns while they load. With swap, each replica's swap models first,
        one at a time, each answered and asleep before the next (vLLM sizes its KV cache by the GPU memory
        free when it starts): that takes their whole load, and the replica's own model starts last."""
        for shape in replica_shapes(self.layout, slots_per_node(self.cfg.cluster)):
            self.replicas.append(self._start_replica(shape))

    def _start_replica(self, shape: ReplicaShape) -> Replica:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def engine_host(rank: int, bundle: dict) -> Any:
            return ray.remote(EngineHost).options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                # Ray starts workers at nice 15, which a user cannot undo for the engine later; as
                # Ray's own job supervisor does, ask for the job's niceness (engine/host.py says why).
                runtime_env={"env_vars": {"RAY_worker_niceness": "0"}},
            ).remote()

        on_gpu = self.cfg.on_gpu
        executor = self.cfg.executor_for(self.layout.workers_per_replica)
        if executor == "ray":
            # vLLM reserves the GPUs itself; our host only needs a place on some node.
            bundles = [{"CPU": 0.01}]
        elif on_gpu:
            bundles = [{"CPU": 1, "GPU": shape.workers_per_node}] * shape.nnodes
        else:
            bundles = [{"CPU": shape.workers_per_node}] * shape.nnodes
        strategy = "STRICT_SPREAD" if len(bundles) > 1 else "PACK"
        pg = placement_group(bundles, strategy=strategy, name=f"hpcserve-replica-{shape.index}")
        t0 = time.monotonic()
        if not pg.wait(timeout_seconds=60):
            raise StageError("engine", f"replica {shape.index}: Ray could not place {len(bundles)} bundle(s) "
                             f"{bundles[0]} with {strategy} within 60 s: the nodes lack the free CPUs/GPUs "
                             "(check `hpcserve check` and other replicas' use)", None)
        hosts: list[Any] = [engine_host(rank, bundle) for rank, bundle in enumerate(bundles)]  # EngineHost actors
        where = ray.get([h.where.remote() for h in hosts])
        port = self.cfg.serve.port + shape.index
        master = where[0]["address"]
        replica = Replica(shape.index, f"http://{_client_host(self.cfg.serve.host, master)}:{port}", placement_group=pg)
        replica.placement_seconds = time.monotonic() - t0
        if self.cfg.swap is not None:
            if len(hosts) > 1 or executor == "ray":
                raise StageError("engine", f"swap puts several models' engines on one replica's GPUs: replica "
                                 f"{shape.index} spans {len(hosts)} node(s) with the {executor} executor. Swap needs "
                                 "replicas of one node (tensor x pipeline within a node) and engine.executor auto or "
                                 "mp", None)
            # Their own hosts, taking nothing from the bundle: the GPUs are the replica's host's, shown to them.
            gpus = {"CUDA_VISIBLE_DEVICES": where[0]["cuda_visible_devices"]} if where[0]["cuda_visible_devices"] else {}
            for (spec, path), swap_port in zip(self.swap_models, self.cfg.swap_ports(shape.index)):
                self._start_swap_engine(engine_host(0, {}), spec, path, swap_port, shape, executor, gpus)
        for rank, (actor, info) in enumerate(zip(hosts, where)):
            role = EngineRole(replica=shape.index, port=port, tensor=self.layout.tensor, pipeline=self.layout.pipeline,
                              executor=executor, nnodes=len(hosts), node_rank=rank, master_addr=master,
                              master_port=self.master_port + shape.index)
            log = self.run_dir / "engines" / f"replica{shape.index}-rank{rank}-{info['hostname']}.log"
            proc = EngineProcess(shape.index, rank, actor, info["hostname"], info["address"], log)
            # Ray executor: the API process must see the node's GPUs like a plain `vllm serve` (Ray gave
            # this host none); vLLM's own Ray workers get theirs from vLLM's placement group.
            proc.pid = ray.get(actor.start.remote(engine_argv(self.cfg, self.model_path, role, load_args=self.load_args),
                                                  self._engine_env(shape), str(log), executor == "ray"))
            replica.processes.append(proc)
        return replica

    def _start_swap_engine(self, host: Any, spec: ModelSpec, model_path: str, port: int, shape: ReplicaShape,
                           executor: str, gpus: dict[str, str]) -> None:
        """One swap model's engine on the replica's GPUs: started, waited for until it answers, put to sleep."""
        import ray

        swap_cfg = self.cfg.model_copy(update={"model": spec})
        role = EngineRole(replica=shape.index, port=port, tensor=self.layout.tensor, pipeline=self.layout.pipeline,
                          executor=executor)
        info = ray.get(host.where.remote())
        log = self.run_dir / "engines" / f"replica{shape.index}-swap-{spec.name}-{info['hostname']}.log"
        proc = EngineProcess(shape.index, 0, host, info["hostname"], info["address"], log, swap_model=spec.name)
        engine = SwapEngine(spec.name, f"http://{_client_host(self.cfg.serve.host, info['address'])}:{port}", proc)
        self.swap_engines.append(engine)  # stopped with the others, even if it never answers
        env = {**self._engine_env(shape, swap_cfg, model_path), **gpus}
        started = time.monotonic()
        proc.pid = ray.get(host.start.remote(engine_argv(swap_cfg, model_path, role, load_args=self.load_args),
                                             env, str(log)))
        self._wait_answer(engine.url, spec.name, [proc], self.cfg.engine.startup_timeout_s)
        if not engine_sleep(engine.url, self.api_key):
            raise StageError("engine", f"swap model {spec.name}'s engine at {engine.url} did not sleep (POST /sleep "
                             "refused): swap needs vLLM's sleep mode on GPUs (engine.sleep_mode auto or on)", str(log))
        logger.info("swap model %s answered and sleeps after %.1f s: %s", spec.name, time.monotonic() - started,
                 engine.url)

    def _engine_env(self, shape: ReplicaShape, cfg: DeploymentConfig | None = None,
                    model_path: str | None = None) -> dict[str, str]:
        """The environment of one replica's engine (of cfg's model: a swap model's config, else the replica's)."""
        cfg = cfg or self.cfg
        # The compile cache first: engine.env may still name its own VLLM_CACHE_ROOT.
        env = {**cache_env(cache_folder(cfg, model_path or self.model_path, self.layout, vllm_version())),
               **self.cfg.engine.env}
        # vLLM 0.26's Ray executor picks its torch.distributed store port from a window above this one
        # (starting at port 100 when unset): replicas on one node must not share the window.
        env.setdefault("VLLM_DP_MASTER_PORT", str(self.master_port + 100 + 40 * shape.index))
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        if self.cfg.engine_sleeps:  # /sleep, /wake_up, /is_sleeping (vLLM's dev routes, behind engine.guard's key)
            env[SLEEP_ROUTES_ENV] = "1"
        executor = self.cfg.executor_for(self.layout.workers_per_replica)
        if executor == "ray":
            env["RAY_ADDRESS"] = self.gcs_address
        if executor == "uni" and not self.cfg.on_gpu:
            # vLLM on CPU turns uni into mp (a worker process of its own: one more import of torch and
            # vLLM in every start) unless V1 multiprocessing is off; the API server still runs the engine
            # core in a process of its own (benchmarks/results/HISTORY.md: the start it saves).
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not self.cfg.on_gpu and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            binding = cpu_thread_binding(shape.workers_per_node, sorted(os.sched_getaffinity(0)))
            if binding:
                env["VLLM_CPU_OMP_THREADS_BIND"] = binding
        return env

    # ------------------------------------------------------------ readiness
    def wait_ready(self, timeout_s: float) -> dict[int, str]:
        """Until every replica answered a real completion; fails fast when an engine process exits. With swap,
        each replica's own model then sleeps and wakes once: an engine's first sleep takes seconds more than
        later ones (pinning host memory for the weights), paid here rather than by the first swap under load."""
        answers = {replica.index: self._wait_answer(replica.url, self.cfg.model.name, replica.processes, timeout_s)
                   for replica in self.replicas}
        if self.cfg.swap is not None:
            for replica in self.replicas:
                started = time.monotonic()
                if not (engine_sleep(replica.url, self.api_key) and engine_wake_up(replica.url, self.api_key)):
                    raise StageError("engine", f"replica {replica.index} at {replica.url} did not sleep and wake: "
                                     "swap needs vLLM's sleep mode on GPUs (engine.sleep_mode auto or on)",
                                     str(replica.processes[0].log))
                answers[replica.index] = completion_probe(replica.url, self.cfg.model.name, self.api_key)
                logger.info("replica %d slept and woke once, answered again after %.1f s", replica.index,
                            time.monotonic() - started)
        return answers

    def _wait_answer(self, url: str, model: str, processes: list[EngineProcess], timeout_s: float) -> str:
        """The text of the first real completion the engine at url gives; StageError when one of its
        processes exits first or timeout_s passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._raise_if_dead(processes)
            if health_ok(url):
                try:
                    return completion_probe(url, model, self.api_key)
                except Exception:  # noqa: BLE001, S110 - not ready yet; the deadline decides
                    pass
            if time.monotonic() > deadline:
                raise StageError("engine", f"{processes[0].label} at {url} gave no completion within "
                                 f"{timeout_s:.0f} s", str(processes[0].log))
            time.sleep(0.5)

    def processes(self) -> list[EngineProcess]:
        return [p for r in self.replicas for p in r.processes] + [e.process for e in self.swap_engines]

    def swap_rows(self) -> list[dict]:
        """The swap models' engines as state.json lists them (every one asleep once started)."""
        return [e.to_dict() for e in self.swap_engines]

    def rows(self, healthy: bool) -> list[dict]:
        """The replicas as state.json lists them, with the served model's name."""
        return [{**r.to_dict(), "model": self.cfg.model.name, "healthy": healthy} for r in self.replicas]

    def dead_processes(self, processes: list[EngineProcess] | None = None) -> list[tuple[EngineProcess, int]]:
        import ray

        procs = self.processes() if processes is None else processes
        codes = ray.get([p.actor.returncode.remote() for p in procs])
        return [(p, c) for p, c in zip(procs, codes) if c is not None]

    def raise_if_dead(self) -> None:
        self._raise_if_dead(None)

    def _raise_if_dead(self, processes: list[EngineProcess] | None) -> None:
        dead = self.dead_processes(processes)
        if dead:
            proc, code = dead[0]
            text = proc.log.read_text(errors="replace") if proc.log.exists() else ""
            raise StageError("engine", f"{proc.label} on {proc.hostname} exited with code {code}: "
                             f"{engine_error(text)}", str(proc.log))

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        pending = [p.actor.stop.remote() for p in self.processes()]
        try:
            ray.get(pending, timeout=60)
        except Exception:  # noqa: BLE001, S110 - the actors' deaths kill their engines (PDEATHSIG)
            pass
        for replica in self.replicas:
            for proc in replica.processes:
                ray.kill(proc.actor)
            if replica.placement_group is not None:
                remove_placement_group(replica.placement_group)


def _client_host(bind_host: str, node_address: str) -> str:
    """Where clients reach a replica: the node's address, unless the engine binds one address."""
    return node_address if bind_host in ("0.0.0.0", "::", "") else bind_host
