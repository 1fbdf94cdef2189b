"""The adapter registry (fresh ids, versions, the bound, eviction) and the manifest check."""

from __future__ import annotations

import pytest

from nemo_gen.core.adapters import AdapterError, AdapterRegistry, base_lora_manifest, check_adapter, refuse

# -- registry ---------------------------------------------------------------------------------


def load(reg: AdapterRegistry, name: str, version=None, base=0):
    r = reg.reserve(name, version, base)
    reg.commit(r)
    return r


def test_every_load_gets_a_fresh_id_and_a_name_serves_its_newest_version():
    reg = AdapterRegistry(max_adapters=4)
    first = load(reg, "a").entry
    second = load(reg, "a").entry
    other = load(reg, "b").entry
    ids = [first.engine_id, second.engine_id, other.engine_id]
    assert len(set(ids)) == 3 and ids == sorted(ids)
    assert (second.version, first.version) == (2, 1)
    assert first.engine_name != second.engine_name  # vLLM keys its caches by name: unique per load
    got = reg.acquire("a", 0)
    assert got is second and not first.current
    reg.release(got)


def test_a_refused_reservation_consumes_its_id_and_leaves_the_old_version_serving():
    reg = AdapterRegistry(max_adapters=2)
    old = load(reg, "a").entry
    pending = reg.reserve("a", None, 0)  # never committed: the load failed on a shard
    again = reg.reserve("a", None, 0)
    assert again.entry.engine_id > pending.entry.engine_id > old.engine_id
    assert again.entry.version == 2  # the failed load did not take version 2
    assert reg.acquire("a", 0) is old


def test_ids_continue_past_those_an_engine_already_holds():
    reg = AdapterRegistry(max_adapters=2, first_id=42)
    assert load(reg, "a").entry.engine_id == 42


def test_versions_only_move_forward():
    reg = AdapterRegistry(max_adapters=2)
    load(reg, "a", version=5)
    with pytest.raises(AdapterError, match="not newer"):
        reg.reserve("a", 5, 0)
    with pytest.raises(AdapterError, match="positive integer"):
        reg.reserve("b", 0, 0)
    assert load(reg, "a").entry.version == 6


def test_eviction_takes_superseded_then_least_recently_used_never_one_in_flight():
    reg = AdapterRegistry(max_adapters=3)
    a1 = load(reg, "a").entry
    b = load(reg, "b").entry
    c = load(reg, "c").entry
    busy = reg.acquire("b", 0)  # b now used last, and in flight
    r = reg.reserve("a", None, 0)
    # A slot must go: c (idle), not b (in flight), nor a1 (it serves on if this load fails).
    assert [e.engine_id for e in r.evict] == [c.engine_id]
    reg.commit(r)
    r = reg.reserve("d", None, 0)
    assert [e.engine_id for e in r.evict] == [a1.engine_id]  # superseded goes first
    reg.commit(r)
    with pytest.raises(AdapterError, match="not loaded.*evicted"):
        reg.acquire("c", 0)
    reg.release(busy)
    assert b.in_flight == 0 and reg.current("b") is b


def test_when_every_slot_has_requests_in_flight_a_refit_is_refused():
    reg = AdapterRegistry(max_adapters=1)
    load(reg, "a")
    held = reg.acquire("a", 0)
    with pytest.raises(AdapterError, match="in flight"):
        reg.reserve("b", None, 0)
    with pytest.raises(AdapterError, match="in flight"):
        reg.reserve("a", None, 0)  # its own old version is busy too
    reg.release(held)
    assert [e.name for e in reg.reserve("b", None, 0).evict] == ["a"]


def test_new_base_weights_make_an_adapter_refuse_until_refit():
    reg = AdapterRegistry(max_adapters=2)
    load(reg, "a", base=3)
    with pytest.raises(AdapterError, match="base weights v3.*v4"):
        reg.acquire("a", 4)
    assert [e.name for e in reg.forget_all()] == ["a"]
    with pytest.raises(AdapterError, match="refit it again"):
        reg.acquire("a", 4)
    assert load(reg, "a", base=4).entry.version == 2


def test_unknown_and_bad_names():
    reg = AdapterRegistry(max_adapters=1)
    with pytest.raises(AdapterError, match="no such adapter"):
        reg.acquire("nope", 0)
    for bad in ("", "a#1", None):
        with pytest.raises(AdapterError, match="name"):
            reg.reserve(bad, None, 0)


# -- manifest check ----------------------------------------------------------------------------

BASE_TENSORS = {
    f"model.layers.{i}.self_attn.{m}.weight": ((128, 128), "float32") for i in range(2) for m in ("q_proj", "v_proj", "o_proj")
} | {f"model.layers.{i}.mlp.down_proj.weight": ((128, 256), "float32") for i in range(2)} | {
    "model.embed_tokens.weight": ((512, 128), "float32"), "model.norm.weight": ((128,), "float32")}
BASE = base_lora_manifest(BASE_TENSORS, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], 8, ["/m/tiny"])


def adapter(rank=8, targets=("q_proj",), base="/m/tiny", shape_a=None):
    shapes = {}
    for i in range(2):
        for t in targets:
            name = f"base_model.model.model.layers.{i}.self_attn.{t}"
            shapes[f"{name}.lora_A.weight"] = shape_a or (rank, 128)
            shapes[f"{name}.lora_B.weight"] = (128, rank)
    return {"r": rank, "lora_alpha": 16, "target_modules": list(targets), "base_model_name_or_path": base}, shapes


def test_a_fitting_adapter_passes():
    assert check_adapter("ok", *adapter(), BASE) == []
    assert check_adapter("ok", *adapter(base="tiny"), BASE) == []  # a hub-style name of the same model


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 16}, "rank 16 exceeds the fleet's max rank 8"),
    ({"targets": ("lm_head",)}, "target module 'lm_head' is not one the engine can adapt"),
    ({"base": "/m/other"}, "trained on base model '/m/other'"),
    ({"shape_a": (8, 64)}, "shape (8, 64), the base layer needs (8, 128)"),
])
def test_a_bad_adapter_is_refused_by_name(kwargs, message):
    problems = check_adapter("bad", *adapter(**kwargs), BASE)
    assert any(message in p for p in problems), problems
    with pytest.raises(AdapterError, match=r"adapter 'bad' refused, nothing changed"):
        refuse("bad", problems)


def test_tensors_of_layers_the_base_lacks_are_refused():
    config, shapes = adapter()
    shapes["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = (8, 128)
    shapes["base_model.model.model.layers.0.self_attn.q_proj.bias"] = (128,)
    problems = check_adapter("x", config, shapes, BASE)
    assert any("layers.7" in p and "no such layer" in p for p in problems)
    assert any("not a lora_A/lora_B weight" in p for p in problems)
    assert check_adapter("x", config, {}, BASE) == ["it holds no tensors"]
