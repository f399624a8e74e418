"""The sbatch script of a deployment, rendered from slurm/templates/job.sh.j2.

Data (paths, names, Slurm values) is shell-quoted; cluster.setup and cluster.sbatch_extra are
the user's own shell lines and #SBATCH options and go in verbatim. The site profile (site:, see
hpcserve.site) decides what surrounds the driver and each node's Ray (a container, srun options) and
whether GPUs are requested through GRES. Nothing time- or machine-dependent goes in, so the same
inputs give the same script (reference files in tests).
"""

from __future__ import annotations

import functools
import os
import shlex
from collections.abc import Mapping
from pathlib import Path

import jinja2

from hpcserve.core.config import DeploymentConfig
from hpcserve.core.errors import ConfigError
from hpcserve.site.profiles import STEP_ENV, profile_for, shell_words

TEMPLATE = "job.sh.j2"
CONFIG_MARKER = "HPCSERVE_CONFIG"  # ends the config heredoc; must not be a line of the config
# Shorter key values could appear in a script by chance; such keys are too weak to guard anyway.
MIN_SECRET_LENGTH = 8
DRIVER_MODULE = "hpcserve.deployment.driver"


def render_batch_script(cfg: DeploymentConfig, config_yaml: str, python: str, results_dir: Path,
                        driver_module: str = DRIVER_MODULE) -> str:
    """The batch script for `cfg`. `config_yaml` is written into the run folder for the driver;
    `python` is the interpreter on the compute nodes; `results_dir` must be absolute (the job
    does not run where the user typed the command). driver_module: what the job execs (a test may
    run a stand-in member instead of the driver)."""
    values = {**template_values(cfg, config_yaml, python, Path(results_dir)),
              "driver_module": checked_module(driver_module)}
    script = _environment().get_template(TEMPLATE).render(**values)
    leaked = leaked_secret(script, cfg.serve.api_key_env, os.environ)
    if leaked:
        raise ConfigError(
            f"the value of ${leaked} appears in the batch script (in cluster.setup, engine.env or "
            f"engine.args?): write the variable name instead; it reaches the job through the environment")
    return script


def template_values(cfg: DeploymentConfig, config_yaml: str, python: str, results_dir: Path) -> dict[str, object]:
    cluster = cfg.cluster
    logs_dir = checked_results_dir(results_dir) / "logs"
    site = profile_for(cfg, results_dir)
    return {
        "name": cfg.name,  # the schema allows [a-z0-9-] only
        "nodes": cluster.nodes,
        "cpus_per_node": cluster.cpus_per_node,
        "gpus_per_node": cluster.gpus_per_node,
        "time": shlex.quote(cluster.time),
        "partition": quoted_or_none(cluster.partition, "cluster.partition"),
        "account": quoted_or_none(cluster.account, "cluster.account"),
        "qos": quoted_or_none(cluster.qos, "cluster.qos"),
        "early_log": shlex.quote(f"{logs_dir}/.slurm-%j.out"),
        "sbatch_extra": [single_line(option, "cluster.sbatch_extra") for option in cluster.sbatch_extra],
        "setup": list(cluster.setup),
        "logs_dir": shlex.quote(str(logs_dir)),
        "marker": CONFIG_MARKER,
        "config_yaml": heredoc_body(config_yaml),
        "python": shlex.quote(site.python or python),
        "gres": cfg.site.gres,
        "exclusive": site.exclusive,
        "runtime": site.runtime,
        "step_env_name": STEP_ENV,
        "step_env": "" if site.step.is_plain else shlex.quote(site.step.to_env()),
        "driver_prefix": shell_words(site.driver) + " " if site.driver else "",
    }


def checked_module(name: str) -> str:
    """A dotted module name (it goes into the script unquoted)."""
    if not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"{name!r} is not a Python module name")
    return name


def checked_results_dir(results_dir: Path) -> Path:
    if not results_dir.is_absolute():
        raise ValueError(f"results_dir must be an absolute path (the job runs elsewhere), got {str(results_dir)!r}")
    return results_dir


def quoted_or_none(value: str | None, field: str) -> str | None:
    return shlex.quote(single_line(value, field)) if value else None


def single_line(value: str, field: str) -> str:
    # A newline would end the #SBATCH line and start a shell command.
    if "\n" in value or "\r" in value:
        raise ConfigError(f"'{field}' = {value!r}: must be one line")
    return value


def heredoc_body(config_yaml: str) -> str:
    body = config_yaml.rstrip("\n")
    if CONFIG_MARKER in body.splitlines():
        raise ValueError(f"the config contains a line '{CONFIG_MARKER}', which would end the heredoc early")
    return body


def leaked_secret(script: str, api_key_env: str | None, environ: Mapping[str, str]) -> str | None:
    """The name of the API-key variable if its value appears in the script, else None."""
    if not api_key_env:
        return None
    value = environ.get(api_key_env, "")
    if len(value) >= MIN_SECRET_LENGTH and value in script:
        return api_key_env
    return None


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("hpcserve.slurm", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,          # a shell script, not HTML; quoting is done with shlex above
        trim_blocks=True,          # {% %} lines leave no blank lines behind
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
