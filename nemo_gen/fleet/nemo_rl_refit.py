"""NeMo-RL's refit calls on a fleet (what ``refit_policy_generation`` calls on its generation):
``prepare_refit_info`` announces the state dict, then each refit is either
``update_weights_via_ipc_zmq`` (colocated: NeMo-RL's policy streams CUDA IPC handles of packed
buffers over ZMQ, ``nemo_gen.core.ipc_zmq``) or ``init_collective`` once and
``update_weights_from_collective`` per refit (separate GPUs: vLLM's ``nccl`` weight transfer,
``nemo_gen.core.nemo_rl_collective``).

Each goes through the fleet's own refit rules (``Refitter``): under the refit lock, a sleeping
fleet's weights woken first (NeMo-RL's order: wake(weights) -> refit -> wake(kv_cache), the last
the caller's ``prepare_for_generation(tags=["kv_cache"])``), versions that only move forward, a
shard that fails while loading quarantined (half-loaded weights never serve) and the others
serving the new version. The weights come from another process: a replacement cannot catch up
from them and stays STALE until the next refit, as for ``fleet.weight_sync_client``.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from nemo_gen.core.ipc_zmq import Entry, IpcZmqRefit, entries_of, nbytes_of
from nemo_gen.core.manifest import RefitError, RefitReport, TensorMeta, check_manifest, is_floating, next_version
from nemo_gen.core.modes import WeightTarget
from nemo_gen.core.nemo_rl_collective import collective_init_info, collective_update_info
from nemo_gen.errors import ConfigError
from nemo_gen.fleet.refit import Refitter, metas_of

_MARGIN_S = 1.0  # past refit.timeout_s, for a frozen actor


class NemoRlRefit:
    def __init__(self, fleet: Any):
        self.fleet = fleet
        self.refitter: Refitter = fleet.refitter
        self.entries: tuple[Entry, ...] | None = None
        self._client: Any = None  # the fleet's weight-sync client, once init_collective ran

    def prepare_refit_info(self, state_dict_info: Mapping[str, tuple[Any, Any]]) -> None:
        """Announce the trainer's ``{name: (shape, dtype)}``; checked against the engines' own
        manifest now (``RefitError``: nothing will be sent that cannot load)."""
        entries = entries_of(state_dict_info)
        engine_dtype = self.refitter.engine_dtype
        expected = self.refitter.expected(WeightTarget.POLICY)
        offered = [TensorMeta.of(n, shape, engine_dtype if is_floating(dt) else dt) for n, shape, dt in entries]
        check_manifest(metas_of(expected), offered, optional=expected.optional, what="model")
        self.entries = entries

    def _announced(self, call: str) -> tuple[Entry, ...]:
        if self.entries is None:
            raise RefitError(f"{call}: no state dict announced; call prepare_refit_info(state_dict_info) first")
        return self.entries

    def update_weights_via_ipc_zmq(self, version: int | None = None, in_flight: str | None = None,
                                   address: str | None = None) -> RefitReport:
        """Receive one NeMo-RL stream on every shard (``address``: the senders' socket; None: each
        GPU's ``ipc:///tmp/<GPU-UUID>.sock``) and serve it as ``version`` (default previous + 1)."""
        from nemo_gen.settings import policies

        entries = self._announced("update_weights_via_ipc_zmq")
        mode = policies.in_flight(self.fleet.settings, in_flight)
        r, weights = self.refitter, self.refitter.weights
        with weights.refitting():
            r.ready_weights()  # a sleeping fleet's weights come back first
            members = r.refit_members()
            new_version = next_version(weights.version, version)
            report = RefitReport(version=new_version, bytes=sum(nbytes_of(e[1], e[2]) for e in entries),
                                 tensors=len(entries), stage_seconds=0.0, load_seconds=0.0)
            message = IpcZmqRefit(entries, new_version, r.driver.timeouts.refit_s, mode, address)
            t0 = time.perf_counter()
            for member, answer in r.driver.fan_out(members, message, _MARGIN_S).items():
                error = None if answer.ok else f"refit to version {new_version} failed: {answer.error}"
                r.settle(report, member, new_version, error, float(answer.value or 0.0) if answer.ok else 0.0)
            report.load_seconds = time.perf_counter() - t0
            if any(s.ok for s in report.shards):
                weights.landed(new_version, None, None)
                r.count(report)
        return report

    # -- the collective (separate GPUs) ------------------------------------------------------------

    def init_collective(self, ip: str, port: int, world_size: int, train_world_size: int) -> None:
        """Join NeMo-RL's NCCL group at ``ip:port`` (vLLM's nccl backend: ``refit.backend=nccl``)."""
        backend = self.fleet.settings.refit.backend
        if backend != "nccl":
            raise ConfigError(f"init_collective needs engines started with vLLM's nccl weight transfer; "
                              f"refit.backend is {backend!r}: set refit.backend=nccl", field="refit.backend")
        client = self.fleet.weight_sync_client()
        engine_ranks = client.nccl_world_size() - 1  # every worker of every refittable shard
        client.init_weight_transfer_engine(
            collective_init_info(ip, port, world_size, train_world_size, engine_ranks))
        self._client = client

    def update_weights_from_collective(self) -> RefitReport:
        """One round of the trainer's broadcast, over the announced state dict in its order."""
        update = collective_update_info(self._announced("update_weights_from_collective"))
        if self._client is None:
            raise RefitError("update_weights_from_collective: call init_collective first")
        self._client.start_weight_update()
        try:
            self._client.update_weights(update)
        except BaseException:
            self._client.abort_weight_update("the collective round failed")
            raise
        return self._client.finish_weight_update()
