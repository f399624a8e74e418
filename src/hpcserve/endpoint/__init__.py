"""The endpoint: one OpenAI URL in front of member deployments, in two rooms and the contract between them.

    dataplane/   the HTTP server that forwards requests (python -m hpcserve.endpoint.dataplane): routing/
                 (the routing state, its indexes and policies), admission, streams and migration,
                 its admin routes, its worker processes
    control/     the controller (python -m hpcserve.endpoint.control.process): members, the pool of probed
                 replicas, decisions (pure), policies/ (scaling, handover, ...), plane_client (its client of
                 the data plane); and the commands' side: run, adoption, status
    protocol.py  the data plane's admin API, typed once; both rooms import it, neither imports the other
                 (an import-linter contract)

What the rest of hpcserve uses (api.py, cli/) is this module's surface, below. It is loaded on first use:
the data plane's process imports this package too, and must not pay for the control plane's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcserve.endpoint.control.adoption import adopt, adoptable
    from hpcserve.endpoint.control.holding import describe as describe_holding
    from hpcserve.endpoint.control.joining import host_endpoint, refuse_down_while_joined
    from hpcserve.endpoint.control.policies.member_requests import MEMBER_DOWN_TIMEOUT_S, retire
    from hpcserve.endpoint.control.run import start_endpoint, stop_deployment
    from hpcserve.endpoint.control.status import DeploymentStatus, acknowledge, deployment_status, lost_line

_SURFACE = {  # name -> (module, name there)
    "adopt": ("hpcserve.endpoint.control.adoption", "adopt"),
    "adoptable": ("hpcserve.endpoint.control.adoption", "adoptable"),
    "describe_holding": ("hpcserve.endpoint.control.holding", "describe"),
    "host_endpoint": ("hpcserve.endpoint.control.joining", "host_endpoint"),
    "refuse_down_while_joined": ("hpcserve.endpoint.control.joining", "refuse_down_while_joined"),
    "MEMBER_DOWN_TIMEOUT_S": ("hpcserve.endpoint.control.policies.member_requests", "MEMBER_DOWN_TIMEOUT_S"),
    "retire": ("hpcserve.endpoint.control.policies.member_requests", "retire"),
    "start_endpoint": ("hpcserve.endpoint.control.run", "start_endpoint"),
    "stop_deployment": ("hpcserve.endpoint.control.run", "stop_deployment"),
    "DeploymentStatus": ("hpcserve.endpoint.control.status", "DeploymentStatus"),
    "deployment_status": ("hpcserve.endpoint.control.status", "deployment_status"),
    "acknowledge": ("hpcserve.endpoint.control.status", "acknowledge"),
    "lost_line": ("hpcserve.endpoint.control.status", "lost_line"),
}
# _SURFACE's names, spelled out: linters and type checkers read __all__ without running it.
__all__ = ["MEMBER_DOWN_TIMEOUT_S", "DeploymentStatus", "acknowledge", "adopt", "adoptable", "deployment_status",
           "describe_holding", "host_endpoint", "lost_line", "refuse_down_while_joined", "retire", "start_endpoint",
           "stop_deployment"]


def __getattr__(name: str):
    try:
        module, attribute = _SURFACE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value
