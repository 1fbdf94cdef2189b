"""The fault model (dead / busy / slow / data) against every exception class the installed Ray
and vLLM define.

Each library is walked in a fresh interpreter: every ``.py`` module under the package is
imported, and every ``BaseException`` subclass defined there is classified by
``nemo_gen.core.retry.kind_of`` (an instance made with no arguments when the class allows
it, else an uninitialised one — the taxonomy reads the class, and the HTTP status a
no-argument constructor sets). A module that cannot be imported here (a GPU-only or
optional dependency) is read with ``ast`` instead: its exception classes are rebuilt on
their real bases and classified the same way, so nothing defined in the wheel is missed.

``EXPECTED`` holds a verdict, with its reason, for every class found. The test fails when
the walk finds a class without a verdict (a new Ray or vLLM release added one: decide it,
and if it is not data, name it in ``nemo_gen/core/retry.py``), when ``kind_of`` disagrees with
a verdict, when a verdict names a class that no longer exists, and when ``retry.py`` names
a Ray or vLLM class that does not exist (``PlacementGroupSchedulingError`` did, in a list of
infra names, while Ray 2.60's ``TaskPlacementGroupRemoved`` and
``ActorPlacementGroupRemoved`` fell through to data).

Out of the walk, with the reason: Ray's AI libraries (data, serve, train, tune, rllib, llm,
air, workflow — built on Ray Core, never imported by nemo_gen, so their exceptions cannot
reach a fleet), code vendored from other projects into either wheel (directories named
``thirdparty``, ``thirdparty_files``, ``third_party``: pynvml, dacite, pathspec, aiohttp),
test modules, ``__main__`` modules (importing one runs it), and
``ray.util.client.client_app`` (it connects to a Ray client server when imported; its
source is read with ``ast`` instead).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nemo_gen.core import retry

DEAD, BUSY, DATA = "dead", "busy", "data"

SKIP = {
    "ray": [
        "ray.data", "ray.serve", "ray.train", "ray.tune", "ray.rllib", "ray.llm", "ray.air",
        "ray.workflow",
    ],
    "vllm": [],
}
# Directories of code vendored from other projects, wherever they sit in the wheel.
VENDORED = ("thirdparty", "thirdparty_files", "third_party", "_vendor", "vendor")
# Imported by nothing here: read with ast only (a side effect on import).
READ_ONLY = {"ray": ["ray.util.client.client_app"], "vllm": []}

_WALKER = r'''
import ast, builtins, contextlib, importlib, inspect, io, json, os, sys, warnings
warnings.simplefilter("ignore")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
from nemo_gen.core.retry import kind_of

pkg, skip, read_only, vendored = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
root = os.path.dirname(importlib.util.find_spec(pkg).origin)
if pkg == "vllm":
    # vLLM's CPU platform loads its kernels from the build this CPU runs (_C_AVX2 without AVX-512),
    # which registers torch's "_C" op library; a module that imports vllm._C itself (the ROCm
    # platform) would then register it a second time, and torch aborts the process. Load the
    # platform's kernels first and stand in for vllm._C when another build holds them.
    import types
    from vllm.platforms import current_platform
    current_platform.import_kernels()
    sys.modules.setdefault("vllm._C", types.ModuleType("vllm._C"))

def under(name, prefixes):
    return any(name == p or name.startswith(p + ".") for p in prefixes)

modules = {}  # name -> path
for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d.isidentifier() and d not in ("tests", "test", "__pycache__", *vendored))
    rel = os.path.relpath(dirpath, os.path.dirname(root)).split(os.sep)
    for f in sorted(filenames):
        stem = f[:-3]
        if not f.endswith(".py") or not stem.isidentifier() or stem.startswith("test_") or stem in ("conftest", "__main__"):
            continue
        name = ".".join(rel if stem == "__init__" else rel + [stem])
        if not under(name, skip):
            modules[name] = os.path.join(dirpath, f)

failed = {}
for name in modules:
    if under(name, read_only):
        failed[name] = "not imported: side effect on import"
        continue
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            importlib.import_module(name)
    except BaseException as exc:  # SystemExit and warnings raised as errors included
        failed[name] = f"{type(exc).__name__}: {exc}"[:160]

# Extension modules are not walked (importing vLLM's twice aborts), but those the walk loaded
# (ray._raylet) define classes too.
loaded = [m for m in list(sys.modules) if under(m, [pkg]) and not under(m, skip) and m not in modules
          and not set(m.split(".")) & set(vendored)]
found = {}
for name in [*modules, *loaded]:
    mod = sys.modules.get(name)
    if mod is None:
        continue
    for value in list(vars(mod).values()):
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
            found[f"{name}.{value.__qualname__}"] = value

# Modules that could not be imported: their classes, rebuilt on their real bases.
by_simple = {}
for cls in found.values():
    by_simple.setdefault(cls.__name__, cls)
for n in dir(builtins):
    obj = getattr(builtins, n)
    if isinstance(obj, type) and issubclass(obj, BaseException):
        by_simple.setdefault(n, obj)
unresolved = {}
for name in sorted(failed):
    tree = ast.parse(open(modules[name]).read())
    pending = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    progress = True
    while pending and progress:
        progress = False
        for node in list(pending):
            bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
            resolved = [by_simple.get(b) for b in bases]
            if resolved and all(resolved) and any(issubclass(r, BaseException) for r in resolved):
                try:
                    cls = type(node.name, tuple(resolved), {"__module__": name})
                except TypeError:
                    continue
                found[f"{name}.{node.name}"] = cls
                by_simple.setdefault(node.name, cls)
                pending.remove(node)
                progress = True
    for node in pending:  # bases from a package not installed here, or not exceptions
        bases = [ast.unparse(b) for b in node.bases]
        if any(b.endswith(("Error", "Exception", "Exit", "Warning")) for b in bases):
            unresolved[f"{name}.{node.name}"] = bases

def instance(cls):
    try:
        return cls()
    except Exception:
        return cls.__new__(cls)

verdicts = {}
for qual, cls in sorted(found.items()):
    try:
        verdicts[qual] = kind_of(instance(cls))
    except Exception as exc:
        verdicts[qual] = f"kind_of raised {type(exc).__name__}: {exc}"
defined = sorted({c.__name__ for c in found.values()} | {n for n in dir(builtins)})
print("WALK " + json.dumps({"modules": len(modules), "failed": failed, "verdicts": verdicts,
                            "unresolved": unresolved, "names": defined}), flush=True)
os._exit(0)  # some of what was imported crashes at interpreter teardown (SIGSEGV); the walk is done
'''


def walk(package: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _WALKER, package, json.dumps(SKIP[package]), json.dumps(READ_ONLY[package]),
         json.dumps(VENDORED)],
        capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("WALK ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][5:])


@pytest.fixture(scope="module", params=["ray", "vllm"])
def walked(request):
    return request.param, walk(request.param)


# Every exception class the walk finds, with its verdict. Why, group by group.
EXPECTED: dict[str, str] = {
    # ---- ray.exceptions: a worker, actor, node, object or the control plane went away ----
    "ray.exceptions.RayActorError": DEAD,
    "ray.exceptions.ActorDiedError": DEAD,
    "ray.exceptions.ActorUnavailableError": DEAD,
    "ray.exceptions.ActorUnschedulableError": DEAD,  # e.g. its node-affinity target died
    "ray.exceptions.ActorPlacementGroupRemoved": DEAD,  # a new placement can succeed
    "ray.exceptions.TaskPlacementGroupRemoved": DEAD,
    "ray.exceptions.TaskUnschedulableError": DEAD,
    "ray.exceptions.WorkerCrashedError": DEAD,
    "ray.exceptions.NodeDiedError": DEAD,
    "ray.exceptions.LocalRayletDiedError": DEAD,
    "ray.exceptions.GetTimeoutError": DEAD,
    "ray.exceptions.RpcError": DEAD,
    "ray.exceptions.PendingCallsLimitExceeded": BUSY,  # back-pressure: the call queue is full for now
    "ray.exceptions.OutOfMemoryError": DEAD,
    "ray.exceptions.OutOfDiskError": DEAD,
    "ray.exceptions.ObjectStoreFullError": DEAD,
    # An object's copies are gone; re-running the task that made it makes it again.
    "ray.exceptions.ObjectLostError": DEAD,
    "ray.exceptions.OwnerDiedError": DEAD,
    "ray.exceptions.ObjectFetchTimedOutError": DEAD,
    "ray.exceptions.ObjectFreedError": DEAD,
    "ray.exceptions.ObjectReconstructionFailedError": DEAD,
    "ray.exceptions.ReferenceCountingAssertionError": DEAD,
    # Ray's own machinery failed (compiled-graph channels, direct transport, replay).
    "ray.exceptions.RaySystemError": DEAD,
    "ray.exceptions.RayChannelError": DEAD,
    "ray.exceptions.RayChannelTimeoutError": DEAD,
    "ray.exceptions.RayCgraphCapacityExceeded": DEAD,
    "ray.exceptions.RayDirectTransportError": DEAD,
    "ray.exceptions.StreamingGeneratorReplayInconsistentError": DEAD,
    "ray._private.memory_monitor.RayOutOfMemoryError": DEAD,
    # ---- ray.exceptions: the same call fails the same way again ----
    "ray.exceptions.RayError": DATA,  # the bare base says nothing: unknown is data
    "ray.exceptions.RayTaskError": DATA,  # a wrapper: classified by its cause (test_retry.py)
    "ray.exceptions.UserCodeException": DATA,
    "ray.exceptions.CrossLanguageError": DATA,
    "ray.exceptions.UnserializableException": DATA,
    "ray.exceptions.OufOfBandObjectRefSerializationException": DATA,
    "ray.exceptions.RuntimeEnvSetupError": DATA,  # a bad runtime_env fails on every node
    "ray.exceptions.AuthenticationError": DATA,  # a missing or wrong token: settings
    "ray.exceptions.ActorAlreadyExistsError": DATA,  # the name is taken: two fleets, one name
    "ray.exceptions.ActorHandleNotFoundError": DATA,  # no actor of that name: nothing to attach
    "ray.exceptions.TaskCancelledError": DATA,  # cancelled on purpose, not a failure
    # Control flow inside Ray, never raised to a caller (exit_actor, end of a stream, a
    # plasma fetch that Ray itself retries).
    "ray.exceptions.AsyncioActorExit": DATA,
    "ray.exceptions.ObjectRefStreamEndOfStreamError": DATA,
    "ray.exceptions.PlasmaObjectNotAvailable": DATA,
    # ---- the rest of Ray Core: programming, packaging and tooling errors ----
    "ray.actor.ActorClassInheritanceException": DATA,
    "ray._private.serialization.DeserializationError": DATA,
    "ray._private.runtime_env._clonevirtualenv.UserError": DATA,
    "ray._private.runtime_env.conda_utils.ShellCommandException": DATA,
    "ray._private.runtime_env.utils.SubprocessCalledProcessError": DATA,
    "ray.util.multiprocessing.pool.PoolTaskError": DATA,  # wraps a user function's error
    "ray.util.queue.Empty": DATA,  # queue control flow
    "ray.util.queue.Full": DATA,
    "ray.util.iter._NextValueNotReady": DATA,
    "ray.util.tracing.tracing_helper._ImportFromStringError": DATA,
    # The state API (ray.util.state, a dashboard query nemo_gen never makes).
    "ray.util.state.exception.RayStateApiException": DATA,
    "ray.util.state.exception.ServerUnavailable": DATA,
    "ray.util.state.exception.DataSourceUnavailable": DATA,
    # Warnings are not failures.
    "ray._raylet.NumReturnsWarning": DATA,
    "ray._private.tensor_serialization_utils.ZeroCopyTensorsWarning": DATA,
    "ray.util.annotations.RayDeprecationWarning": DATA,
    # Cluster tooling (autoscaler, dashboard): run by the cluster's daemons and CLI, never
    # raised into a driver's call.
    "ray.autoscaler._private.cli_logger.SilentClickException": DATA,
    "ray.autoscaler._private.cluster_dump.CommandFailed": DATA,
    "ray.autoscaler._private.cluster_dump.LocalCommandFailed": DATA,
    "ray.autoscaler._private.cluster_dump.RemoteCommandFailed": DATA,
    "ray.autoscaler._private.subprocess_output_util.ProcessRunnerError": DATA,
    "ray.autoscaler.node_launch_exception.NodeLaunchException": DATA,
    "ray.autoscaler.v2.instance_manager.node_provider.CloudInstanceProviderError": DATA,
    "ray.autoscaler.v2.instance_manager.node_provider.LaunchNodeError": DATA,
    "ray.autoscaler.v2.instance_manager.node_provider.TerminateNodeError": DATA,
    "ray.dashboard.modules.metrics.metrics_head.PrometheusQueryError": DATA,
    "ray.dashboard.utils.FrontendNotFoundError": DATA,
    # Experimental features nemo_gen does not use: the default (data) holds.
    "ray.experimental.rdt.nixl_memory_pool.NixlOutOfMemoryError": DATA,  # pool too small: settings
    "ray.experimental.sandbox.exceptions.SandboxError": DATA,
    "ray.experimental.sandbox.exceptions.SandboxCreationError": DATA,
    "ray.experimental.sandbox.exceptions.SandboxTimeoutError": DATA,
    "ray.experimental.sandbox.exceptions.SandboxExecError": DATA,
    "ray.experimental.sandbox.exceptions.SandboxNotFoundError": DATA,
    "ray.experimental.sandbox.http.app._ApiError": DATA,
    "ray.experimental.sandbox.http.app._SchedulingTimeout": DATA,
    # ---- vllm.exceptions: VLLMServerError (5xx) is the server, VLLMClientError (4xx) the request ----
    "vllm.exceptions.VLLMServerError": DEAD,
    "vllm.exceptions.GenerationError": DEAD,  # finish_reason said internal server error
    "vllm.exceptions.RetryableRequestError": DEAD,  # "safe for clients to retry"
    "vllm.v1.engine.exceptions.EngineDeadError": DEAD,  # the EngineCore process died
    "vllm.v1.engine.exceptions.EngineGenerateError": DEAD,
    "vllm.exceptions.QueueOverflowError": BUSY,  # 503: "retry on a different instance"
    "vllm.exceptions.MaxQueuedTokensError": BUSY,  # 503, the same
    "vllm.exceptions.ProfilerAlreadyActiveError": DATA,  # 409
    "vllm.exceptions.GracefulHTTPError": DATA,  # classified by the status it carries; none here
    "vllm.exceptions.VLLMError": DATA,
    "vllm.exceptions.VLLMClientError": DATA,
    "vllm.exceptions.VLLMValidationError": DATA,
    "vllm.exceptions.VLLMNotFoundError": DATA,
    "vllm.exceptions.LoRAAdapterNotFoundError": DATA,
    "vllm.exceptions.VLLMUnprocessableEntityError": DATA,
    "vllm.connections.HTTPResponseSizeExceededError": DATA,
    "vllm.connections.MediaDownloadSizeExceededError": DATA,
    "vllm.renderers.chat_utils.ChatTemplateResolutionError": DATA,
    "vllm.v1.engine.async_llm.InputStreamError": DATA,  # wraps the input generator's error (.cause)
    "vllm.v1.metrics.perf.InvalidComponent": DATA,
    "vllm.compilation.backends.StopCompiling": DATA,  # control flow (a BaseException)
    "vllm.distributed.weight_transfer.sharded_rdt_fake._UnsupportedFakeOp": DATA,
    # Features nemo_gen does not run (disaggregated KV/encoder transfer, snapshots, the
    # weight-cache daemon, multimodal caches, tool parsing, structured decisions, one AMD
    # model path): the default (data) holds.
    "vllm.distributed.aux_output_connector.store.BlockObjectStoreError": DATA,
    "vllm.distributed.ec_transfer.ec_connector.cpu.scheduler._RemoteUnavailable": DATA,
    "vllm.distributed.ec_transfer.ec_connector.mooncake.worker._FanoutError": DATA,
    "vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client.EmbeddingStoreError": DATA,
    "vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client.EmbeddingStoreOperationError": DATA,
    "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common.MoRIIOError": DATA,
    "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common.HandshakeError": DATA,
    "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common.TransferError": DATA,
    "vllm.snapshot.manifest.SnapshotCompatibilityError": DATA,
    "vllm.snapshot.manifest.SnapshotSecurityError": DATA,
    "vllm.snapshot.runtime.SnapshotCreateError": DATA,
    "vllm.snapshot.runtime.SnapshotRestoreError": DATA,
    "vllm.snapshot.server.SnapshotBarrierError": DATA,
    "vllm.snapshot.server.SnapshotCanaryError": DATA,
    "vllm.model_executor.model_loader.weight_cache.protocol.WeightCacheUnavailableError": DATA,
    "vllm.model_executor.model_loader.weight_cache.protocol.CacheConfigMismatchError": DATA,
    "vllm.model_executor.model_loader.weight_cache.protocol.UnsupportedQuantForIPCError": DATA,
    "vllm.model_executor.model_loader.weight_cache.protocol.UnsupportedPlatformForIPCError": DATA,
    "vllm.multimodal.cache.base.MultiModalCacheMissError": DATA,
    "vllm.tool_parsers.utils.UnexpectedAstError": DATA,
    "vllm.entrypoints.generate.structured_decisions.question_types.StructuredDecisionError": DATA,
    "vllm.models.deepseek_v41.amd.mono.common.plan.ShardError": DATA,
    "vllm.models.deepseek_v41.amd.mono.common.peer_memory.MonoUnsupported": DATA,  # read with ast here
}


def test_every_exception_class_has_a_verdict_and_kind_of_agrees(walked):
    package, report = walked
    verdicts = report["verdicts"]
    assert report["modules"] > 100 and len(verdicts) > 20  # the walk really covered the package
    assert report["unresolved"] == {}, "exception classes whose bases cannot be resolved here"
    unclassified = sorted(set(verdicts) - set(EXPECTED))
    assert unclassified == [], f"{package} defines exception classes with no verdict in EXPECTED"
    wrong = {q: {"kind_of": v, "expected": EXPECTED[q]} for q, v in verdicts.items() if v != EXPECTED[q]}
    assert wrong == {}
    gone = sorted(q for q in EXPECTED if q.startswith(package + ".") and q not in verdicts)
    assert gone == [], f"verdicts for classes {package} no longer defines"


def test_every_name_retry_matches_on_is_one_the_libraries_define(walked):
    """A name in retry.py that Ray or vLLM does not define matches nothing: it hides a gap."""
    package, report = walked
    names = set(report["names"])
    theirs = {
        "ray": retry.RAY_INFRA_NAMES | (retry.BUSY_NAMES & {"PendingCallsLimitExceeded"}),
        "vllm": retry.ENGINE_INFRA_NAMES | {"GracefulHTTPError"} | (retry.BUSY_NAMES - {"PendingCallsLimitExceeded"}),
    }[package]
    assert sorted(theirs - names) == []
