"""The fleet side of adapters without engines: reading a source, the LoRA switch, the full-refit
rule, and what a chosen adapter adds to a request and its result."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from nemo_gen.core.adapters import AdapterError
from nemo_gen.core.results import GenerationResult
from nemo_gen.core.wire import InFlight
from nemo_gen.fleet.adapters import FleetAdapters, read_adapter
from nemo_gen.vllm_ext.lora import EXTRA_KEY


def adapters(enabled=True, max_adapters=2, driver=None):
    lora = SimpleNamespace(enabled=enabled, max_rank=8, max_adapters=max_adapters)
    settings = SimpleNamespace(generation=SimpleNamespace(vllm_cfg=SimpleNamespace(lora=lora)),
                               model=SimpleNamespace(path="/m/tiny", name=None),
                               refit=SimpleNamespace(staging_dir="/dev/shm"), fleet=SimpleNamespace(name="t"))
    refitter = SimpleNamespace(after_catch_up=[], engine_dtype="float32")
    return FleetAdapters(refitter=refitter, driver=driver, weights=SimpleNamespace(version=0), settings=settings)


def test_a_directory_without_the_peft_files_is_refused_naming_the_file(tmp_path):
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError, match="not JSON"):
        read_adapter(str(tmp_path))
    with pytest.raises(AdapterError, match="not int"):
        read_adapter(3)
    config, tensors = read_adapter({"config": {"r": 8}, "tensors": {}})
    assert config == {"r": 8} and tensors == {}


def test_a_fleet_without_lora_refuses_adapters_naming_the_setting():
    fleet = adapters(enabled=False)
    with pytest.raises(AdapterError, match="generation.vllm_cfg.lora.enabled"):
        fleet.refit("a", {"config": {}, "tensors": {}}, None)
    with pytest.raises(AdapterError, match="generation.vllm_cfg.lora.enabled"):
        with fleet.selected("a", {}):
            pass
    with fleet.selected(None, {"temperature": 0}) as (chosen, params):  # the base model: unchanged
        assert params == {"temperature": 0} and chosen.entry is None


def test_a_chosen_adapter_rides_with_the_request_and_names_the_result():
    fleet = adapters()
    reservation = fleet.registry.reserve("a", None, 0)
    fleet.registry.commit(reservation)
    result = GenerationResult(index=0, prompt=None, prompt_token_ids=[1], text="x")
    with fleet.selected("a", {"temperature": 0}) as (chosen, params):
        entry = reservation.entry
        assert params == {"temperature": 0, EXTRA_KEY: [f"a#{entry.engine_id}", entry.engine_id]}
        assert entry.in_flight == 1  # never evicted while the request runs
        chosen.stamp([result])
    assert entry.in_flight == 0
    assert (result.adapter, result.adapter_version) == ("a", 1)
    assert json.loads(json.dumps(result.to_json()))["adapter"] == "a"
    assert "adapter" not in GenerationResult(index=0, prompt=None, prompt_token_ids=[1], text="x").to_json()


def test_with_adapters_loaded_a_full_refit_only_drains():
    fleet = adapters()
    with fleet.full_refit(InFlight("keep")):
        pass  # nothing loaded: any mode
    fleet.registry.commit(fleet.registry.reserve("a", None, 0))
    for mode in ("keep", "abort"):
        with pytest.raises(AdapterError, match="use in_flight='drain'"):
            with fleet.full_refit(InFlight(mode)):
                pytest.fail("the refit ran")
    with fleet.full_refit(InFlight("drain")):
        pass


def test_a_newcomer_loads_every_adapter_the_fleet_holds_under_the_same_ids():
    import torch

    calls = []

    class Driver:
        def fan_out(self, handles, message, margin_s):
            calls.append((list(handles), type(message).__name__, message.engine_id, list(message.evict)))
            return {m: SimpleNamespace(ok=True, value=[]) for m in handles}

    fleet = adapters(driver=Driver())
    assert fleet.refitter.after_catch_up == [fleet.catch_up]
    live = {"w": torch.ones(2, 2)}
    for name in ("a", "b"):
        r = fleet.registry.reserve(name, None, 0)
        fleet.registry.commit(r)
        fleet._kept[r.entry.engine_id] = ({"r": 8}, live)
    fleet.weights.version = 1  # a was loaded on the old base weights (vLLM dropped it), b on these
    fleet.registry.loaded()[1].base_version = 1
    fleet.catch_up("newcomer", "handle")
    assert calls == [(["newcomer"], "AdapterLoad", fleet.registry.loaded()[1].engine_id, [])]
