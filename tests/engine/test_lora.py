"""LoRA adapters on a real vLLM CPU fleet of one shard, against a fresh vLLM engine that loads the
same PEFT directories itself (``tests/engine/lora_reference.py``, its own process, started
beside the fleet). The fleet is shared by the module; each test starts from no adapter loaded
(``lora``: a refit of the base weights, which drops every adapter in vLLM, checked on entry) and
loads the adapters it needs itself, so none depends on another's order or state."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import os

import pytest

from nemo_gen import GenerationFleet
from nemo_gen.core.adapters import AdapterError
from nemo_gen.core.wire import AdapterModules
from tests.lora_adapters import adapter_config, adapter_tensors, module_dims, write_adapter

pytestmark = pytest.mark.engine

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 300, 12], [100, 7, 7, 250, 33, 2]]
MAX_TOKENS = 16
MAX_RANK = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(root / name, tiny_model_dir, targets=targets, seed=seed)
            for name, targets, seed in [("a1", ("q_proj", "v_proj"), 1), ("a2", ("q_proj", "v_proj"), 2),
                                        ("b", ("o_proj", "down_proj"), 3), ("c", ("q_proj",), 4)]}


@pytest.fixture(scope="module")
def setup(ray_cluster, make_settings, tiny_model_dir, adapters, tmp_path_factory):
    work = tmp_path_factory.mktemp("lora-ref")
    spec, out = work / "spec.json", work / "out.json"
    spec.write_text(json.dumps({"model": str(tiny_model_dir), "max_rank": MAX_RANK, "prompts": PROMPTS,
                                "max_tokens": MAX_TOKENS, "adapters": {k: str(v) for k, v in adapters.items()}}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    reference = subprocess.Popen([sys.executable, "-m", "tests.engine.lora_reference", str(spec), str(out)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    fleet = GenerationFleet.launch(make_settings(
        fleet__name="lora", fleet__num_shards=1, health__auto_recover=False,
        **{"generation.vllm_cfg.lora.enabled": True, "generation.vllm_cfg.lora.max_rank": MAX_RANK,
           "generation.vllm_cfg.lora.max_adapters": 2}))
    try:
        _, err = reference.communicate(timeout=300)
        assert reference.returncode == 0, err[-3000:]
        yield fleet, json.loads(out.read_text())
    finally:
        fleet.shutdown()


@pytest.fixture
def lora(setup, tiny_model_dir):
    """The module's fleet and the reference's answers, with no adapter loaded: new base weights
    drop every adapter in vLLM (a refit of the tiny model is ~0.1 s), checked on the shard."""
    fleet, ref = setup
    assert fleet.refit(str(tiny_model_dir), in_flight="drain").ok
    assert held(fleet) == [] and tokens(greedy(fleet)) == ref["base"]
    return fleet, ref


def load(fleet, adapters, *steps):
    """Refit adapter name <- adapters[source] for each (name, source) in order: what a test needs
    loaded before it starts."""
    return [fleet.refit_adapter(name, str(adapters[source])) for name, source in steps]


def next_version(fleet, name):
    return fleet.adapters.registry.next_version(name, None)


def greedy(fleet, adapter=None):
    results = fleet.generate(PROMPTS, adapter=adapter, temperature=0, ignore_eos=True, max_new_tokens=MAX_TOKENS)
    assert all(r.ok for r in results), [r.error for r in results]
    return results


def tokens(results):
    return [r.token_ids for r in results]


def held(fleet):
    handle = fleet.handle(0)
    return list(fleet.driver.fan_out({0: handle}, AdapterModules(), 60)[0].value.held)


def test_an_adapter_refit_generates_what_a_fresh_engine_with_that_adapter_does(lora, adapters):
    fleet, ref = lora
    assert ref["a1"] != ref["base"]  # the adapter changes greedy tokens at all
    version = next_version(fleet, "a")
    report = fleet.refit_adapter("a", str(adapters["a1"]))
    assert (report.name, report.version) == ("a", version)
    results = greedy(fleet, "a")
    assert tokens(results) == ref["a1"]
    assert {(r.adapter, r.adapter_version) for r in results} == {("a", version)}
    base = greedy(fleet)
    assert tokens(base) == ref["base"] and base[0].adapter is None  # the base model serves on beside it


def test_a_new_version_under_the_same_name_is_served_from_its_first_request(lora, adapters):
    fleet, ref = lora
    (old,) = load(fleet, adapters, ("a", "a1"))
    report = fleet.refit_adapter("a", str(adapters["a2"]))
    assert report.version == old.version + 1 and report.engine_id != old.engine_id  # a fresh id, never the old one
    first = fleet.generate(PROMPTS[:1], adapter="a", temperature=0, ignore_eos=True, max_new_tokens=MAX_TOKENS)[0]
    assert (first.token_ids, first.adapter_version) == (ref["a2"][0], report.version)
    assert tokens(greedy(fleet, "a")) == ref["a2"]
    # The old version stays loaded (a request on it could still run) until a slot is needed.
    assert sorted(held(fleet)) == sorted([old.engine_id, report.engine_id])


def test_two_adapters_are_served_side_by_side(lora, adapters):
    fleet, ref = lora
    load(fleet, adapters, ("a", "a1"), ("a", "a2"))  # a v1 superseded but loaded, a v2 current
    report = fleet.refit_adapter("b", str(adapters["b"]))
    assert len(report.evicted) == 1 and report.evicted[0].startswith("a#")  # the superseded a v1 made room
    assert len(held(fleet)) == 2

    async def both():
        calls = [fleet.generate_async(p, adapter=name, temperature=0, ignore_eos=True, max_new_tokens=MAX_TOKENS)
                 for name in ("a", "b") for p in PROMPTS]
        return await asyncio.gather(*calls)

    results = asyncio.run(both())
    n = len(PROMPTS)
    assert [r.token_ids for r in results[:n]] == ref["a2"]
    assert [r.token_ids for r in results[n:]] == ref["b"]
    assert {r.adapter for r in results[n:]} == {"b"}


def test_the_http_model_field_and_a_stream_choose_the_adapter(lora, adapters):
    """The official openai client picks an adapter by ``model`` (completions, chat, a stream);
    /v1/models lists the adapters; an unknown name is a 404 naming it. The library's stream takes
    ``adapter=`` and its result names the adapter's version."""
    import openai

    from nemo_gen.server import start_server

    fleet, ref = lora
    versions = {r.name: r.version for r in load(fleet, adapters, ("a", "a2"), ("b", "b"))}

    async def streamed():
        items = [i async for i in fleet.generate_stream(PROMPTS[0], adapter="b", temperature=0, ignore_eos=True,
                                                       max_new_tokens=MAX_TOKENS)]
        return items[-1]

    last = asyncio.run(streamed())
    assert (last.token_ids, last.adapter, last.adapter_version) == (ref["b"][0], "b", versions["b"])
    with pytest.raises(AdapterError, match="'nope' is not loaded"):
        fleet.generate_stream(PROMPTS[0], adapter="nope")
    with start_server(fleet, port=0) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        models = client.models.list()
        assert {"a", "b"} <= {m.id for m in models.data}
        for name, want in (("a", ref["a2"][0]), ("b", ref["b"][0])):
            out = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            assert out.model == name and out.choices[0].token_ids == want
            assert (out.nemo_gen["adapter"], out.nemo_gen["adapter_version"]) == (name, versions[name])
        chunks = list(client.completions.create(model="b", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}))
        assert [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])] == ref["b"][0]
        chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                              temperature=0)
        assert chat.model == "b" and chat.nemo_gen["adapter"] == "b"
        with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
            client.completions.create(model="nope", prompt="x", max_tokens=2)


def _bad(tmp_path, base, name, **kw):
    tensors = kw.pop("tensors", None)
    config = kw.pop("config", None)
    return write_adapter(tmp_path / name, base, tensors=tensors, config=config, **kw)


@pytest.mark.parametrize("case, message", [
    ("rank", "rank 16 exceeds the fleet's max rank 8"),
    ("target", "target module 'input_layernorm' is not one the engine can adapt"),
    ("base", "trained on base model"),
    ("shape", "the base layer needs"),
])
def test_a_bad_adapter_is_refused_by_name_and_nothing_changes(lora, adapters, tiny_model_dir, tmp_path, case, message):
    fleet, ref = lora
    (serving,) = load(fleet, adapters, ("a", "a2"))
    before = sorted(held(fleet))
    if case == "rank":
        source = write_adapter(tmp_path / case, tiny_model_dir, rank=16)
    elif case == "target":
        config = adapter_config(tiny_model_dir, targets=("input_layernorm",))
        tensors = {"base_model.model.model.layers.0.input_layernorm.lora_A.weight": adapter_tensors()[
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]}
        source = {"config": config, "tensors": tensors}  # live tensors are checked the same way
    elif case == "base":
        source = write_adapter(tmp_path / case, "/models/some-other-model")
    else:  # the right names on a base twice as wide: another model's adapter
        dims = {k: (2 * i, 2 * o) for k, (i, o) in module_dims().items()}
        source = write_adapter(tmp_path / case, tiny_model_dir, tensors=adapter_tensors(dims=dims))
    with pytest.raises(AdapterError, match=f"adapter 'a' refused, nothing changed: .*{message}"):
        fleet.refit_adapter("a", source if isinstance(source, dict) else str(source))
    assert sorted(held(fleet)) == before
    results = greedy(fleet, "a")
    assert tokens(results) == ref["a2"] and results[0].adapter_version == serving.version


def test_live_tensors_refit_and_eviction_keeps_the_bound(lora, adapters):
    from safetensors.torch import load_file

    fleet, ref = lora
    load(fleet, adapters, ("a", "a2"), ("b", "b"))
    greedy(fleet, "a")  # "a" used last: "b" is the least recently used
    live = {"config": json.loads((adapters["c"] / "adapter_config.json").read_text()),
            "tensors": load_file(str(adapters["c"] / "adapter_model.safetensors"))}
    report = fleet.refit_adapter("c", live)
    assert report.evicted and report.evicted[0].startswith("b#")
    assert tokens(greedy(fleet, "c")) == ref["c"]
    assert len(held(fleet)) == 2
    with pytest.raises(AdapterError, match="'b' is not loaded .*evicted"):
        fleet.generate(PROMPTS, adapter="b")


def test_an_adapter_refit_moves_ten_times_fewer_bytes_than_a_full_refit(lora, adapters, tiny_model_dir):
    fleet, ref = lora
    first = fleet.refit_adapter("a", str(adapters["a1"]))
    adapter_bytes = first.bytes
    with pytest.raises(AdapterError, match="use in_flight='drain'"):
        fleet.refit(str(tiny_model_dir), in_flight="keep")
    full = fleet.refit(str(tiny_model_dir), in_flight="drain")
    assert full.ok
    assert full.bytes >= 10 * adapter_bytes, (full.bytes, adapter_bytes)
    print(f"bytes staged: full refit {full.bytes}, adapter refit {adapter_bytes} ({full.bytes / adapter_bytes:.0f}x)")
    # New base weights drop every adapter in vLLM: refused by name until refit again.
    with pytest.raises(AdapterError, match="refit the adapter again"):
        fleet.generate(PROMPTS, adapter="a")
    assert tokens(greedy(fleet)) == ref["base"]
    assert fleet.refit_adapter("a", str(adapters["a1"])).version == first.version + 1
    assert tokens(greedy(fleet, "a")) == ref["a1"]


def test_a_replacement_shard_serves_the_adapters_the_fleet_holds(lora, adapters):
    """Shard 0 is killed and restarted (the fleet is whole again after): it catches up with the
    base weights, then loads the fleet's adapters under the same ids before it serves."""
    import ray

    fleet, ref = lora
    load(fleet, adapters, ("a", "a1"))
    entry = fleet.adapters.registry.current("a")
    old = fleet.handle(0)
    ray.kill(old.actor, no_restart=True)
    fleet.health.mark_dead(0, "killed by the test")
    done = fleet.recovery.restart_shard(0)
    assert done["action"] == "restarted" and fleet.handle(0).name != old.name
    assert held(fleet) == [entry.engine_id]
    results = greedy(fleet, "a")
    assert tokens(results) == ref["a1"] and results[0].adapter_version == entry.version
