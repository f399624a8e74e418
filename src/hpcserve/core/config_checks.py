"""What the deployment file's schema (core/config.py) refuses, as pure functions: secrets where they would
show (an --api-key among vLLM's arguments, a secret in engine.env), no API key off one's own machine, a
layout the cluster cannot hold. Their arguments are the schema's sections (ServeSpec, ClusterSpec, Layout),
not imported here: the schema imports these. The protocols below name the fields each check reads."""

from __future__ import annotations

from typing import Protocol

from hpcserve.core.net import is_loopback

# vLLM's parser takes --api_key for --api-key and any unique prefix of it (--api-k, --api-ke).
API_KEY_OPTION = "--api-key"
# Names of variables that hold secrets by convention (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ...);
# names of files holding them (HF_TOKEN_PATH, ..._FILE) carry a path, not the secret.
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
PATH_SUFFIXES = ("_PATH", "_FILE", "_DIR")


class ServeSpec(Protocol):
    @property
    def host(self) -> str: ...
    @property
    def api_key_env(self) -> str | None: ...
    @property
    def insecure_no_api_key(self) -> bool: ...


class ClusterSpec(Protocol):
    @property
    def scheduler(self) -> str: ...
    @property
    def nodes(self) -> int: ...
    @property
    def gpus_per_node(self) -> int: ...
    @property
    def cpus_per_node(self) -> int: ...


class Layout(Protocol):
    @property
    def tensor(self) -> int: ...
    @property
    def pipeline(self) -> int: ...
    @property
    def replicas(self) -> int: ...
    @property
    def workers_per_replica(self) -> int: ...


def is_api_key_option(arg: str) -> bool:
    """Whether vLLM would read this argument as --api-key. Pure."""
    option = arg.split("=", 1)[0].replace("_", "-")
    return len(option) >= len("--api-k") and API_KEY_OPTION.startswith(option)


def checked_engine_args(args: list[str]) -> list[str]:
    if any(is_api_key_option(a) for a in args):
        raise ValueError("--api-key would show in process lists; hpcserve gives every engine the deployment's "
                         "key itself (serve.api_key_env, or a generated one): remove it")
    return args


def looks_secret(name: str) -> bool:
    """A variable name that by convention holds a secret (not a path to one). Pure.

    Judged word by word (HF_TOKEN, WANDB_API_KEY, DB_PASSWORD, OPENAI_APIKEY), so that
    TOKENIZERS_PARALLELISM or VLLM_MAX_TOKENS are not taken for secrets."""
    upper = name.upper()
    if upper.endswith(PATH_SUFFIXES):
        return False
    return any(part.endswith(word) for part in upper.split("_") for word in SECRET_WORDS)


def no_key_problem(serve: ServeSpec, cluster: ClusterSpec) -> str | None:
    """serve.insecure_no_api_key is for a machine of one's own only. Pure."""
    if not serve.insecure_no_api_key:
        return None
    if serve.api_key_env:
        return "serve.insecure_no_api_key and serve.api_key_env contradict each other: remove one"
    if cluster.scheduler != "local" or not is_loopback(serve.host):
        return ("serve.insecure_no_api_key leaves every engine open to anyone who reaches its port: it is only "
                "allowed with cluster.scheduler 'local' and a loopback serve.host, on a machine of your own. "
                "Remove it (hpcserve then generates a key)")
    return None


def slots_per_node(cluster: ClusterSpec) -> int:
    """Engine workers one node can hold: one per GPU, or one per core on CPU nodes."""
    return cluster.gpus_per_node or cluster.cpus_per_node


def layout_problem(layout: Layout, cluster: ClusterSpec) -> str | None:
    """Why this layout cannot run on this cluster, or None. Pure."""
    slots = slots_per_node(cluster)
    unit = "GPUs" if cluster.gpus_per_node else "CPUs"
    needed = layout.workers_per_replica * layout.replicas
    have = slots * cluster.nodes
    if needed > have:
        return (f"parallelism needs {needed} workers (tensor {layout.tensor} x pipeline {layout.pipeline} x "
                f"replicas {layout.replicas}) but the cluster has {have} {unit} ({cluster.nodes} nodes x {slots}): "
                "lower the parallelism or add nodes")
    if layout.workers_per_replica > slots and layout.workers_per_replica % slots:
        return (f"a replica spanning nodes needs tensor x pipeline ({layout.workers_per_replica}) to be a multiple "
                f"of the {unit} per node ({slots})")
    return None
