"""Start or attach the Ray cluster the fleet runs on, and describe its resources.

``ray.address`` unset: a private local cluster (``address="local"``, never a stray ``ray start``
cluster that happens to run on the machine), stopped again by ``shutdown_ray`` once no fleet of
this process uses it: a second fleet launched beside the first shares the cluster the first
started (``LocalCluster``, the one owner of that count), and whichever closes last stops it. Set:
attach, and leave the cluster running afterwards — it is not ours to stop; nor is a cluster the
caller's own code connected to before the first fleet.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray

from nemo_gen.core.placement import ClusterResources
from nemo_gen.settings import RaySettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayConnection:
    """How this process is connected to Ray. ``owned``: a share of the local cluster this process
    started (``lease``: which one): ``shutdown_ray`` gives it back, and the last stops the cluster."""

    address: str
    namespace: str
    owned: bool
    lease: int = 0


class LocalCluster:
    """The private cluster this process started, and the connections still using it."""

    def __init__(self) -> None:
        self.leases: set[int] = set()
        self._next = 0

    def take(self) -> int:
        self._next += 1
        self.leases.add(self._next)
        return self._next

    def give_back(self, lease: int) -> bool:
        """Release ``lease`` (again: nothing); True when it was the last one."""
        if lease not in self.leases:
            return False
        self.leases.discard(lease)
        return not self.leases


LOCAL = LocalCluster()


def init_ray(settings: RaySettings) -> RayConnection:
    """Connect to Ray as the settings say; reuse a connection this process already has (a share
    of it when this process started the cluster)."""
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        if LOCAL.leases:  # started by an earlier fleet of this process, still up: share it
            return RayConnection(address=_gcs_address(), namespace=ctx.namespace, owned=True, lease=LOCAL.take())
        return RayConnection(address=_gcs_address(), namespace=ctx.namespace, owned=False)
    LOCAL.leases.clear()  # whatever this process started before was shut down by someone else
    common = dict(namespace=settings.namespace, log_to_driver=settings.log_to_driver, configure_logging=False)
    if settings.address is None:
        kwargs = dict(
            address="local",
            num_cpus=settings.num_cpus,
            num_gpus=settings.num_gpus,
            include_dashboard=settings.include_dashboard,
            dashboard_host=settings.dashboard_host,
        )
        if settings.object_store_memory_gb:
            kwargs["object_store_memory"] = int(settings.object_store_memory_gb * 2**30)
        ray.init(**kwargs, **common)
        return RayConnection(address=_gcs_address(), namespace=settings.namespace, owned=True, lease=LOCAL.take())
    _use_token_auth()
    ray.init(address=settings.address, **common)
    _warn_if_reaping_unknown()
    return RayConnection(address=_gcs_address(), namespace=settings.namespace, owned=False)


def shutdown_ray(conn: RayConnection | None) -> None:
    """Give back ``conn``'s share of the local cluster this process started; the last share
    disconnects, and the cluster goes down with it (only our own processes). A connection that
    owns nothing is left as it is: other code of this process may be using it."""
    if conn is not None and conn.owned and LOCAL.give_back(conn.lease) and ray.is_initialized():
        ray.shutdown()


def cluster_resources() -> ClusterResources:
    return ClusterResources.from_ray_nodes(ray.nodes())


def _gcs_address() -> str:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # older Ray: not worth failing a launch over a label
        return "unknown"


def _use_token_auth() -> None:
    """Clusters started by Ray >= 2.59 require token auth, and a client naming an address must
    opt in. Ray caches RAY_AUTH_MODE when it is imported, so setting the variable now is not
    enough: refresh the cached config the way Ray's own ``_enable_token_auth`` does. An
    operator's explicit RAY_AUTH_MODE=disabled is left alone."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()


def _warn_if_reaping_unknown() -> None:
    """An attached raylet was started before this driver existed: our environment never reached
    it, so we cannot vouch that it reaps a dead shard's EngineCore (see the seed's docstring)."""
    if os.environ.get("RAY_process_group_cleanup_enabled") != "0":
        log.warning(
            "attached to a Ray cluster this driver did not start: its raylets read "
            "RAY_process_group_cleanup_enabled at their own start. Export "
            "RAY_process_group_cleanup_enabled=1 before `ray start` on every node "
            "(deployments/ray/start-node.sh does) or a killed shard's EngineCore may keep its memory."
        )
