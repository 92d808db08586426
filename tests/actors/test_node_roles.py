"""Node roles as Ray resources: what each actor of a pinned role asks Ray for."""

from __future__ import annotations

import pytest

from actors.node_roles import ROLE_SHARE, NodeRoles
from deploy.config import ConfigError, load_config


def test_a_pinned_role_asks_for_a_sliver_of_its_resource_and_an_unpinned_one_for_nothing() -> None:
    roles = NodeRoles(head="ferry_head", decode="ferry_decode")
    assert roles.options("head") == {"resources": {"ferry_head": ROLE_SHARE}}
    assert roles.options("decode") == {"resources": {"ferry_decode": ROLE_SHARE}}
    assert roles.options("prefill") == {} and roles.resources("cache") == {}


def test_worker_share_sets_how_many_workers_a_node_holds_and_only_for_workers() -> None:
    roles = load_config({"placement": {"head": "ferry_head", "prefill": "ferry_prefill", "decode": "ferry_decode",
                                       "cache": "ferry_cache", "worker_share": 1}}).placement.node_roles()
    assert roles.resources("decode") == {"ferry_decode": 1} and roles.resources("prefill") == {"ferry_prefill": 1}
    # the ingress, the scheduler and the stores are no workers: a node declaring a unit holds them all
    assert roles.resources("head") == {"ferry_head": ROLE_SHARE} and roles.resources("cache") == {"ferry_cache": ROLE_SHARE}


@pytest.mark.parametrize("share", [0, -1, 0.00001, 2000])
def test_a_share_ray_cannot_grant_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="worker_share"):
        NodeRoles(decode="ferry_decode", worker_share=share)
    with pytest.raises((ConfigError, ValueError)):
        load_config({"placement": {"decode": "ferry_decode", "worker_share": share}})
