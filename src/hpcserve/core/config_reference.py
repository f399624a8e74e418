"""The configuration reference (docs/configuration.md), generated from the schema in core/config.py: the
sections in the order of DeploymentConfig's fields, one table row per field, its type and constraints
read from the pydantic annotation and metadata, its default, and its description. Nothing is kept by hand.

    python -m hpcserve.core.config_reference > docs/configuration.md
"""

from __future__ import annotations

import enum
import inspect
import math
import types
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from hpcserve.core.config import DeploymentConfig

REGENERATE = "python -m hpcserve.core.config_reference > docs/configuration.md"

# A small deployment showing the sections (examples/local.yaml's content: this machine, no GPU, the tiny
# model). Embedded, not read from examples/: the package does not know the repository's layout.
EXAMPLE = """\
name: local-tiny
model:
  path: builtin:tiny-llama      # random-weight Llama built on first use (no download)
  served_name: tiny
  dtype: float32
  max_model_len: 512
cluster:
  scheduler: local              # or slurm: partition, account, qos, time, setup, sbatch_extra
  nodes: 1
  gpus_per_node: 0              # 0 = vLLM on CPUs
  cpus_per_node: 2
parallelism:                    # or: auto (the planner chooses)
  tensor: 1
  pipeline: 1
  replicas: 1
engine:
  args: ["--kv-cache-memory-bytes", "67108864"]
serve:
  host: 127.0.0.1
  port: 8000
  api_key_env: HPCSERVE_API_KEY   # unset or empty: hpcserve generates a key
# replica_groups, site: Slurm only (below); autoscale (min 0: scale to zero) works here too
results_dir: results
"""


def render_reference() -> str:
    """The whole reference as markdown. Pure: a function of the schema alone."""
    sections = [_section(name, field) for name, field in DeploymentConfig.model_fields.items()]
    index = " · ".join(f"[{_heading(name, field)}](#{_anchor(_heading(name, field))})"
                       for name, field in DeploymentConfig.model_fields.items())
    head = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the schema (src/hpcserve/core/config.py): do not edit. Regenerate: {REGENERATE} -->",
        "",
        _paragraph(DeploymentConfig) + " Every field below, its type, default and description, is generated "
        "from the pydantic schema in `src/hpcserve/core/config.py` (each field's description); after changing "
        f"it, regenerate this file: `{REGENERATE}`. Unknown keys are rejected with the list of valid ones; "
        "a field left out takes its default.",
        "",
        "A small deployment (this machine, no GPU, the tiny model; `examples/` holds more):",
        "",
        "```yaml",
        EXAMPLE.rstrip("\n"),
        "```",
        "",
        "Sections: " + index,
    ]
    return "\n".join(head) + "\n" + "".join("\n" + section for section in sections)


# ---------------------------------------------------------------- sections and rows

def _heading(name: str, field: FieldInfo) -> str:
    return f"{name}[]" if _is_list(field.annotation) and _model_in(field.annotation) else name


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than '-' and '_' dropped."""
    return "".join(c for c in heading.lower() if c.isalnum() or c in "-_")


def _section(name: str, field: FieldInfo) -> str:
    heading = _heading(name, field)
    lines = [f"## {heading}", ""]
    model = _model_in(field.annotation)
    if model is not None:
        lines += [_paragraph(model), ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    lines += [_row(path, f) for path, f in _rows(name, field)]
    return "\n".join(lines) + "\n"


def _rows(path: str, field: FieldInfo) -> list[tuple[str, FieldInfo]]:
    """This field, then the fields of the section it holds (if any), depth first, in the schema's order."""
    rows = [(path, field)]
    model = _model_in(field.annotation)
    if model is not None:
        prefix = f"{path}[]" if _is_list(field.annotation) else path
        for name, sub in model.model_fields.items():
            rows += _rows(f"{prefix}.{name}", sub)
    return rows


def _row(path: str, field: FieldInfo) -> str:
    cells = [f"`{path}`", type_text(field), default_text(field), _oneline(field.description or "")]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def section_fields() -> list[tuple[str, FieldInfo]]:
    """Every field of the deployment file with its dotted path (as in the tables), top level included."""
    return [row for name, field in DeploymentConfig.model_fields.items() for row in _rows(name, field)]


def section_models() -> list[type[BaseModel]]:
    """The models whose docstrings describe a section: DeploymentConfig and the ones its fields hold."""
    found: list[type[BaseModel]] = [DeploymentConfig]
    for _, field in section_fields():
        model = _model_in(field.annotation)
        if model is not None and model not in found:
            found.append(model)
    return found


# ---------------------------------------------------------------- types

def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds: itself, or inside `X | None`, a union, or a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, get_args(annotation)) if m is not None), None)


def _is_list(annotation: Any) -> bool:
    return get_origin(annotation) is list or any(map(_is_list, get_args(annotation)))

def type_text(field: FieldInfo) -> str:
    """`int ≥ 1`, `one of: auto, ray`, `list of str`, `str or null`: from the annotation and its constraints."""
    return _type_of(field.annotation, field.metadata)


def _type_of(annotation: Any, metadata: list[Any]) -> str:
    args = get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        text = " or ".join(_type_of(a, metadata) for a in kinds)
        return f"{text} or null" if len(kinds) < len(args) else text
    if get_origin(annotation) is Literal:
        return ("one of: " if len(args) > 1 else "") + ", ".join(str(a) for a in args)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of: " + ", ".join(str(member.value) for member in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    if get_origin(annotation) is list:
        inner = _type_of(args[0], [])
        return "list of " + ("mappings" if inner == "mapping" else inner)
    if get_origin(annotation) is dict:
        return f"mapping of {_type_of(args[0], [])} to {_type_of(args[1], [])}"
    names = {bool: "bool", int: "int", float: "number", str: "str"}
    if annotation not in names:
        raise TypeError(f"no readable name for the type {annotation!r}: teach config_reference._type_of")
    return " ".join([names[annotation], *_constraints(annotation, metadata)])


def _constraints(annotation: Any, metadata: list[Any]) -> list[str]:
    """The metadata's bounds and pattern as text; an int's strict bound as the inclusive one it means."""
    low = high = pattern = None
    for item in metadata:
        if isinstance(item, annotated_types.Gt):
            low = f"≥ {_number(_bound(item.gt) + 1)}" if annotation is int else f"> {_number(_bound(item.gt))}"
        elif isinstance(item, annotated_types.Ge):
            low = f"≥ {_number(_bound(item.ge))}"
        elif isinstance(item, annotated_types.Lt):
            high = f"≤ {_number(_bound(item.lt) - 1)}" if annotation is int else f"< {_number(_bound(item.lt))}"
        elif isinstance(item, annotated_types.Le):
            high = f"≤ {_number(_bound(item.le))}"
        elif getattr(item, "pattern", None):
            pattern = f"matching `{item.pattern}`"
        else:
            raise TypeError(f"no readable text for the constraint {item!r}: teach config_reference._constraints")
    if low and high and low.startswith("≥") and high.startswith("≤"):
        return [f"from {low[2:]} to {high[2:]}"]
    return [", ".join(bound for bound in (low, high) if bound)] if (low or high) else ([pattern] if pattern else [])


def _bound(value: object) -> float:
    """A bound as a number: annotated_types allows anything comparable, the schema's bounds are numbers."""
    if not isinstance(value, (int, float)):
        raise TypeError(f"no readable text for the bound {value!r}: teach config_reference._constraints")
    return value


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------- defaults

def default_text(field: FieldInfo) -> str:
    """The default as YAML would write it, `required`, or, for a section at its own defaults, 'the defaults below'."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, BaseModel) and value == type(value)():
        return "the defaults below"
    return f"`{_yaml(_plain(value))}`"


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _yaml(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=math.inf, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


# ---------------------------------------------------------------- text

def _paragraph(model: type[BaseModel]) -> str:
    """The class docstring, as one markdown paragraph."""
    return _oneline(inspect.cleandoc(model.__dict__.get("__doc__") or ""))


def _oneline(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    """Text that cannot end or split a table cell."""
    return text.replace("|", "\\|")


if __name__ == "__main__":
    print(render_reference(), end="")
