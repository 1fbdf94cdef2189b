"""A LoRA adapter call on a shard's engine: the typed wire message (``AdapterModules``,
``AdapterLoad``, ``AdapterRemove``) turned into the worker extension's RPC
(``nemo_gen.vllm_ext.lora``), and what the engine then holds, which ``lora_request_of`` checks
every request against. Every worker must agree (tensor-parallel ranks each hold their part);
the first answers for all.
"""

from __future__ import annotations

from typing import Any

from nemo_gen.core.adapters import AdapterError
from nemo_gen.core.wire import AdapterCall, AdapterLoad, AdapterModules, AdapterRemove
from nemo_gen.shard.engine_protocol import EngineLike


async def adapter_call(engine: EngineLike | None, call: AdapterCall) -> Any:
    """``AdapterModules`` -> what the engine takes and holds; ``AdapterLoad`` / ``AdapterRemove``
    -> the ids held afterwards."""
    if engine is None:
        raise AdapterError("the shard has no engine")
    if isinstance(call, AdapterModules):
        answers = await engine.rpc("nemo_gen_lora_modules")
        held = answers[0]["held"]
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
    return answers[0]
