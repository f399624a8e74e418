"""One name for every file of a run folder `<results_dir>/logs/<name>-<id>/`, so that no module spells a
file name of its own."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hpcserve.core.net import unix_socket_path


def cache_root() -> Path:
    """hpcserve's cache (the built tiny model, vLLM's compile caches): $HPCSERVE_CACHE, else the user's cache
    folder. On a cluster the home folder is shared by every node: what one job caches, the next one finds."""
    root = os.environ.get("HPCSERVE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hpcserve"
    return Path(root)


@dataclass(frozen=True)
class RunPaths:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # what the run is and what it is doing
    @property
    def config(self) -> Path:
        """The deployment's config as validated at `up` (the driver and the controller read it)."""
        return self.root / "config.yaml"

    @property
    def state(self) -> Path:
        """What is running now: status, stage, replicas, members, decisions, the error if any."""
        return self.root / "state.json"

    @property
    def notice(self) -> Path:
        """A member's word to its controller: the signal its job got from Slurm (--signal: preempted, or
        its time limit near) and when (deployment.process.write_notice)."""
        return self.root / "notice.json"

    @property
    def timeline(self) -> Path:
        """One timestamp per stage."""
        return self.root / "timeline.json"

    @property
    def adopt_lock(self) -> Path:
        """Held while a new controller is checked for and started (`hpcserve adopt`): one at a time."""
        return self.root / ".adopt.lock"

    # secrets (mode 0600)
    @property
    def api_key(self) -> Path:
        """The endpoint's key, when hpcserve generated it."""
        return self.root / "api_key"

    @property
    def api_key_source(self) -> Path:
        """Where clients find the key: the file above, $VARIABLE, or none."""
        return self.root / "api_key_source"

    @property
    def router_key(self) -> Path:
        """The key the router process reads (never its command line)."""
        return self.root / ".router_key"

    @property
    def tenancy(self) -> Path:
        """The data plane's tenancy settings (tenancy.settings.TenancySettings as JSON): where the keys and the
        usage record are, the limits, the shares."""
        return self.root / "tenancy.json"

    @property
    def router_admin(self) -> Path:
        """The data plane's admin socket (membership, its metrics): in an owner-only folder of the run
        folder, mode 0600, so only the owner can change what the endpoint serves; in /tmp/hpcserve-UID/
        when the run folder's path is too long for a socket (core.net.unix_socket_path)."""
        return unix_socket_path(self.root / "router" / "admin.sock")

    @property
    def ray_token(self) -> Path:
        """Ray's token authentication for this run's cluster."""
        return self.root / "ray_auth_token"

    # what the processes write
    @property
    def job_script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def slurm_out(self) -> Path:
        return self.root / "slurm.out"

    @property
    def driver_log(self) -> Path:
        return self.root / "driver.log"

    @property
    def endpoint_log(self) -> Path:
        return self.root / "endpoint.log"

    @property
    def router_log(self) -> Path:
        return self.root / "router.log"

    @property
    def health(self) -> Path:
        """The distributed health check's report."""
        return self.root / "health.json"

    @property
    def engines(self) -> Path:
        return self.root / "engines"

    def engine_log(self, replica: int, rank: int, host: str) -> Path:
        return self.engines / f"replica{replica}-rank{rank}-{host}.log"

    @property
    def monitor(self) -> Path:
        """One JSON-lines file of samples per node."""
        return self.root / "monitor"

    def node_dir(self, node: str) -> Path:
        """Ray's files of one node (ray-start.log, launch.log, node.json)."""
        return self.root / "nodes" / node

    @property
    def members(self) -> Path:
        """An endpoint's member deployments: their results folder (their run folders are in logs/)."""
        return self.root / "members"

    def member_run_dirs(self) -> list[Path]:
        return sorted(p for p in (self.members / "logs").glob("*") if p.is_dir())
