"""Before the app starts its actors: can every role pinned by `placement:` ever find a node?

A role's actors ask Ray for its custom resource (actors/node_roles.py). If a node declares it now,
they start there. If none does but a node type the autoscaler may launch declares it, Ray keeps them
pending, the autoscaler sees the demand and starts such a node: the app says so in its log and
waits. If no node and no node type can ever host the role, the app would hang forever: it refuses
to start instead, naming the role, its resource and what the cluster has.

The autoscaler's node types come from the cluster config Ray keeps in its GCS (KubeRay and
autoscaler v2 write it there) or, on a head started by `ray up`, from the bootstrap config `ray up`
leaves in the home folder (the file the head's `--autoscaling-config` points at).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from actors.node_roles import NodeRoles
from deploy.config import ConfigError

logger = logging.getLogger(__name__)

BOOTSTRAP_CONFIG = Path("~/ray_bootstrap_config.yaml")


class NoNodeForRole(ConfigError):
    """A role pinned to a custom resource that no node declares and no node type can bring."""


def check_placement(roles: NodeRoles, node_resources: list[Mapping[str, float]],
                    node_types: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Raises `NoNodeForRole` for the roles nothing can host; returns a message for each role only
    a node type the autoscaler may add can host (their actors wait for it). `node_resources`: each
    live node's total resources; `node_types`: the autoscaler's node types and their resources."""
    waiting, missing = [], []
    for role, resource in roles.assigned().items():
        if any(resource in node for node in node_resources):
            continue
        types = sorted(name for name, res in node_types.items() if resource in res)
        if types:
            waiting.append(f"placement.{role}: no node has the resource {resource!r} yet; waiting for the "
                           f"autoscaler to start a node of type {', '.join(types)}")
        else:
            missing.append(f"placement.{role} needs a node with the resource {resource!r}")
    if missing:
        have = sorted({k for node in node_resources for k in node if not k.startswith("node:")})
        raise NoNodeForRole(f"{'; '.join(missing)}, but no node of the Ray cluster has it (resources seen: "
                            f"{', '.join(have) or 'none'}) and no node type the autoscaler can start declares "
                            f"it{' (node types: ' + ', '.join(sorted(node_types)) + ')' if node_types else ''}; "
                            "add it to a node type's resources (README: Many nodes) or unset the role")
    return waiting


def check_ray_placement(roles: NodeRoles) -> None:
    """`check_placement` on the Ray cluster this process is connected to; logs the waits."""
    if not roles.assigned():
        return
    import ray

    live = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    for message in check_placement(roles, live, autoscaler_node_types()):
        logger.warning("%s", message)


def autoscaler_node_types() -> dict[str, dict[str, float]]:
    """The node types the autoscaler may launch, with their resources ({} without an autoscaler)."""
    types = _gcs_node_types()
    if types:
        return types
    path = BOOTSTRAP_CONFIG.expanduser()
    if not path.is_file():
        return {}
    return node_types_of(yaml.safe_load(path.read_text()) or {})


def node_types_of(cluster_config: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """`available_node_types` of a `ray up` cluster config: name -> resources."""
    return {name: dict(spec.get("resources") or {})
            for name, spec in (cluster_config.get("available_node_types") or {}).items()}


def _gcs_node_types() -> dict[str, dict[str, float]]:
    try:  # a private accessor: absent or shaped otherwise in another Ray, it only loses this source
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001
        return {}
    if config is None:
        return {}
    return {group.name: dict(group.resources) for group in config.node_group_configs}
