"""A sandbox cluster's settings and the names they give: hosts, addresses, files. Pure (no processes)."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from hpcserve.core.errors import UsageError

SETTINGS_FILE = "sandbox.json"  # under root/etc: what the running sandbox was built with


@dataclass
class SandboxLayout:
    """Settings of one sandbox cluster and the names derived from them."""

    root: Path = Path("/tmp/hpcserve-sandbox")
    nodes: int = 3
    prefix: str = "hs"
    net: str = "198.18.0"
    cpus_per_node: int = 4
    mem_mb: int = 4000
    gpus_per_node: int = 2

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not 1 <= self.nodes <= 50:
            raise UsageError(f"nodes must be between 1 and 50, not {self.nodes}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", self.prefix):
            # interface names are at most 15 characters: "v" + prefix + "n50" must fit
            raise UsageError(f"prefix must be 1-6 lower-case letters/digits, not {self.prefix!r}")
        try:
            ipaddress.IPv4Network(f"{self.net}.0/24")
        except ValueError:
            raise UsageError(f"net must be the first three octets of an IPv4 /24, like 198.18.0, "
                             f"not {self.net!r}") from None
        if self.cpus_per_node < 1 or self.mem_mb < 100 or not 0 <= self.gpus_per_node <= 16:
            raise UsageError("need cpus_per_node >= 1, mem_mb >= 100 and 0 <= gpus_per_node <= 16")

    # -------------------------------------------------------------- names and paths
    @classmethod
    def load(cls, root: Path | str = Path("/tmp/hpcserve-sandbox")) -> Self:
        """The sandbox last built under `root` (its saved settings), or the defaults if none was."""
        saved = Path(root) / "etc" / SETTINGS_FILE
        try:
            settings = json.loads(saved.read_text())
        except (OSError, ValueError):
            return cls(root=Path(root))
        settings["root"] = Path(root)
        return cls(**settings)

    @property
    def slurm_conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def controller(self) -> str:
        return f"{self.prefix}ctl"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br0"

    def node_names(self) -> list[str]:
        return [f"{self.prefix}n{i}" for i in range(1, self.nodes + 1)]

    def host_names(self) -> list[str]:
        return [self.controller, *self.node_names()]

    def node_address(self, name: str) -> str:
        """IP address of a node (or of the controller)."""
        if name == self.controller:
            return f"{self.net}.10"
        match = re.fullmatch(rf"{re.escape(self.prefix)}n(\d+)", name)
        if not match or not 1 <= int(match.group(1)) <= 50:
            raise UsageError(f"unknown sandbox host {name!r}; nodes are {', '.join(self.node_names())}")
        return f"{self.net}.{10 + int(match.group(1))}"

    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (sbatch, srun, squeue, ...) on the login node."""
        return {"SLURM_CONF": str(self.slurm_conf)}

    def settings(self) -> dict:
        settings = dataclasses.asdict(self)
        del settings["root"]
        return settings
