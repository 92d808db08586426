"""deploy/cluster.yaml passes the checks `ray up` runs before it contacts a cloud: Ray's own
`prepare_config` (defaults merged, setup commands merged, docker config checked, node type bounds)
then `validate_config` (Ray's JSON schema plus its cross-field rules)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[3] / "deploy" / "cluster.yaml"


@pytest.fixture
def raw() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def prepared(cfg: dict[str, Any]) -> dict[str, Any]:
    out = prepare_config(copy.deepcopy(cfg))
    validate_config(out)
    return out


def test_ray_accepts_the_cluster_yaml(raw: dict[str, Any]) -> None:
    cfg = prepared(raw)
    assert cfg["cluster_name"] == "ferry" and cfg["provider"]["type"] == "aws"
    types = cfg["available_node_types"]
    head, workers = types[cfg["head_node_type"]], [t for name, t in types.items() if name != cfg["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and head["max_workers"] == 0
    assert sorted(w["resources"]["GPU"] for w in workers) == [1, 8]
    assert [w["resources"]["GPU"] for w in workers if w["min_workers"] >= 1] == [1]  # a small GPU node from the start
    assert sum(w["max_workers"] for w in workers) <= cfg["max_workers"]


def test_nodes_install_ferry_with_the_right_torch(raw: dict[str, Any]) -> None:
    cfg = prepared(raw)
    head, worker = cfg["head_setup_commands"], cfg["worker_setup_commands"]
    assert any("torch==2.13.0" in c and "whl/cpu" in c for c in head)
    assert any("torch==2.13.0" in c and "whl/cpu" not in c for c in worker)
    for cmds in (head, worker):
        torch_at = next(i for i, c in enumerate(cmds) if "torch==" in c)
        ferry_at = next(i for i, c in enumerate(cmds) if "pip install" in c and "-e ~/ferry" in c)
        assert torch_at < ferry_at  # torch first, or `pip install -e` would pick a build itself
    cupy_at = next(i for i, c in enumerate(worker) if "cupy-cuda" in c)  # for the CUDA IPC KV transport
    assert "torch.version.cuda" in worker[cupy_at] and cupy_at > next(i for i, c in enumerate(worker) if "torch==" in c)
    assert not any("cupy" in c for c in head)
    assert cfg["file_mounts"]["~/ferry"] == "."


def test_ray_auth_stays_on_and_ports_are_fixed(raw: dict[str, Any]) -> None:
    cfg = prepared(raw)
    start = " ".join(cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in start and "disabled" not in start
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in start  # nodes must bind their network address
    head = " ".join(cfg["head_start_ray_commands"])
    for flag in ("--head", "--port=6379", "--dashboard-port=8265", "--metrics-export-port=8080",
                 "--autoscaling-config=~/ray_bootstrap_config.yaml"):
        assert flag in head
    assert "--address=$RAY_HEAD_IP:6379" in " ".join(cfg["worker_start_ray_commands"])
    assert "~/.ray/auth_token" in cfg["file_mounts"]


def test_validation_is_not_a_no_op(raw: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        prepared(raw | {"head_node_typo": "head"})  # Ray's schema rejects unknown top-level keys
    with pytest.raises(ValueError, match="head_node_type"):
        prepared(raw | {"head_node_type": "nope"})
    broken = copy.deepcopy(raw)
    del broken["available_node_types"]["gpu_8x_h100"]["resources"]
    with pytest.raises(jsonschema.ValidationError):
        prepared(broken)
