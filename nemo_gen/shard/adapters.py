"""A LoRA adapter call on a shard's engine: the typed wire message (``AdapterModules``,
``AdapterLoad``, ``AdapterRemove``) turned into the worker extension's RPC
(``nemo_gen.vllm_ext.lora``), and what the engine then holds, which ``lora_request_of`` checks
every request against. Every worker must agree (tensor-parallel ranks each hold their part);
the first answers for all.
"""

from __future__ import annotations


from nemo_gen.core.adapters import AdapterError
from nemo_gen.core.wire import AdapterCall, AdapterLoad, AdapterModules, AdapterRemove, AdapterState
from nemo_gen.shard.engine_protocol import EngineLike


async def adapter_call(engine: EngineLike | None, call: AdapterCall) -> AdapterState:
    """``AdapterModules`` -> what the engine takes and holds; ``AdapterLoad`` / ``AdapterRemove``
    -> the ids held afterwards (the worker extension's answers, made the wire's record)."""
    if engine is None:
        raise AdapterError("the shard has no engine")
    if isinstance(call, AdapterModules):
        answers = await engine.rpc("nemo_gen_lora_modules")
        modules = answers[0]
        held = modules["held"]
    elif isinstance(call, AdapterLoad):
        answers = await engine.rpc("nemo_gen_load_adapter", call.path, call.total, [list(e) for e in call.entries],
                                   dict(call.config), call.engine_id, list(call.evict))
        held = answers[0]
    elif isinstance(call, AdapterRemove):
        answers = await engine.rpc("nemo_gen_remove_adapters", list(call.engine_ids))
        held = answers[0]
    else:
        raise TypeError(f"not an adapter call: {type(call).__name__}")
    # What lora_request_of checks each request against (a full refit empties vLLM's set).
    engine.adapters_held = (frozenset(held), engine.version)
    if isinstance(call, AdapterModules):
        return AdapterState(tuple(held), tuple(modules["supported"]), int(modules["max_rank"]),
                            int(modules["capacity"]))
    return AdapterState(tuple(held))
