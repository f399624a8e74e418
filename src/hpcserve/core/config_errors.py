"""A validation error of the deployment file as one line a user can act on: the field, its value (secrets
masked), what is wrong and the fix; an unknown key with the keys valid there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from hpcserve.core.config_checks import is_api_key_option


def format_error(err: Mapping[str, Any], raw: dict[str, Any], schema: type[BaseModel]) -> str:
    """One line: field, bad value, what is wrong and how to fix it. schema: the model the file was
    validated against (DeploymentConfig), which lists the valid keys."""
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    field = ".".join(_printable(part) for part in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        parent = _model_at(schema, loc[:-1])
        valid = ", ".join(parent.model_fields) if parent else "see the docs"
        return f"unknown key '{field}'. Valid keys here: {valid}"
    if err["type"] == "missing":
        return f"'{field}' is required: add it (see examples/local.yaml)"
    message = err["msg"].removeprefix("Value error, ")
    if loc:
        return f"'{field}' = {short(redacted(loc, err.get('input')))}: {message}"
    return message


def redacted(loc: list[str], value: Any) -> Any:
    """The value an error quotes, with what may be a secret masked (engine.env's values, an --api-key's
    value): errors end up in terminals, CI logs and issue reports. Pure."""
    if loc[-1:] == ["env"] and isinstance(value, dict):
        return {name: "***" for name in value}
    if loc[-1:] in (["args"], ["engine_args"]) and isinstance(value, list):
        masked, hide_next = [], False
        for arg in value:
            text = str(arg)
            masked.append("***" if hide_next else (text.split("=", 1)[0] + "=***" if "=" in text and
                                                    is_api_key_option(text) else arg))
            hide_next = is_api_key_option(text) and "=" not in text
        return masked
    if loc[-1:] == ["database"] and isinstance(value, str) and "@" in value:  # user:password@host
        scheme, _, rest = value.partition("://")
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return value


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part.startswith("literal[") or part in {"Layout", "function-after[_local_is_one_node(), ClusterSpec]"})


def _model_at(schema: type[BaseModel], loc: list[str]) -> type[BaseModel] | None:
    """The schema model at this place of the file (list items: their element's model)."""
    model = schema
    for part in loc:
        if part.isdigit():  # an item of a list of models (replica_groups.0)
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        inner = _model_in(field.annotation)
        if inner is None:
            return None
        model = inner
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, getattr(annotation, "__args__", ())) if m is not None), None)


def _printable(text: str) -> str:
    """A key as an error can show it on one line (a control character in a key would break the line)."""
    return text if text.isprintable() else repr(text)[1:-1]


def short(value: Any) -> str:
    """A value as an error quotes it: at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
