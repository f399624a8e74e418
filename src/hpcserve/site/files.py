"""`--site FILE`: a YAML file holding only the site mapping, which replaces the config's `site:`."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from hpcserve.core.config import DeploymentConfig, SiteSpec, load_config
from hpcserve.core.config_errors import format_error
from hpcserve.core.errors import ConfigError


def load_site_file(path: str | Path) -> SiteSpec:
    """Read and validate a site file (runtime, image, container_command, binds, gres). Raises ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such site file. Pass a YAML file with the site keys, e.g. "
                          f"runtime: apptainer and image: /path/to/image.sif")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    if isinstance(raw, dict) and set(raw) == {"site"} and isinstance(raw["site"], dict):
        raw = raw["site"]  # a file written as `site: {...}` works too
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping with keys {', '.join(SiteSpec.model_fields)}")
    try:
        return SiteSpec.model_validate(raw)
    except ValidationError as exc:

        lines = [format_error({**e, "loc": ("site", *e["loc"])}, {"site": raw}, DeploymentConfig) for e in exc.errors(include_url=False)]
        raise ConfigError(f"{path}: " + "; ".join(lines)) from None


def with_site(cfg: DeploymentConfig, site: SiteSpec | None) -> DeploymentConfig:
    """The config with its site section replaced (validated again as a whole)."""
    if site is None:
        return cfg
    return DeploymentConfig.model_validate({**cfg.model_dump(mode="json"), "site": site.model_dump(mode="json")})


def load_with_site(config_path: str | Path, site_path: str | Path | None) -> DeploymentConfig:
    """`CONFIG [--site FILE]`: the deployment file, its site section replaced by the site file if given."""
    return with_site(load_config(config_path), load_site_file(site_path) if site_path else None)
