"""Ray at the edge of the prefix cache: the store as an actor, and the pool's handle for it.

Mental model: `PrefixCacheActor` is the plain `PrefixCacheStore` run as a Ray actor with a tenth of
a CPU (it mostly waits on memory copies and file I/O, and the embedded default must fit 2 cores).
`RayStoreHandle` adapts an actor handle to the pool's `StoreHandle` contract: `call` submits the
method and returns the ObjectRef; `result` waits on it with the remaining deadline and translates
Ray's failures into the pool's named errors. This file is the only one in the package that
imports Ray. A store actor that crashes is restarted by Ray (`max_restarts=-1`; the same handle
serves on, the store comes back empty, its disk folder cleared); the pool drops it on its first
failed call and takes it back once a probe gets an answer (pool.py). One killed on purpose
(`ray.kill(..., no_restart=True)`) stays dead: whoever owns the deployment may start a new store
and `add_store` it.
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors.node_roles import NodeRoles
from actors.prefix_cache.handles import PendingCall, StoreMethod, StoreTimeout, StoreUnavailable
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore

STORE_NUM_CPUS = 0.1

PrefixCacheActor = ray.remote(num_cpus=STORE_NUM_CPUS, max_restarts=-1)(PrefixCacheStore)


class _RayPending:
    def __init__(self, ref: ray.ObjectRef) -> None:
        self._ref = ref

    def result(self, timeout_s: float) -> object:
        try:
            return ray.get(self._ref, timeout=timeout_s)
        except GetTimeoutError as e:
            raise StoreTimeout(f"no answer within {timeout_s:.3f} s") from e
        except RayActorError as e:
            raise StoreUnavailable(str(e).splitlines()[0] if str(e) else "actor died") from e


class RayStoreHandle:
    def __init__(self, actor: ray.actor.ActorHandle) -> None:
        self.actor = actor

    def call(self, method: StoreMethod, *args: object) -> PendingCall:
        # Submitting never blocks on the actor; a dead actor only shows up at result().
        return _RayPending(getattr(self.actor, method).remote(*args))


def start_store_actors(
    cfg: PrefixCacheConfig, num_stores: int, id_prefix: str = "prefix-cache", roles: NodeRoles = NodeRoles()
) -> dict[StoreId, RayStoreHandle]:
    """Starts `num_stores` store actors named `<id_prefix>-<i>` (on the nodes of the `cache` role,
    where `roles` names one); the id also names each one's disk folder, so two pools in one
    FERRY_HOME need different prefixes."""
    handles = {}
    for i in range(num_stores):
        store_id = StoreId(f"{id_prefix}-{i}")
        actor = PrefixCacheActor.options(  # type: ignore[attr-defined]
            name=store_id, **roles.options("cache")).remote(cfg, store_id)
        handles[store_id] = RayStoreHandle(actor)
    return handles

