"""The rolling refit (refit.rollout waves) on real vLLM CPU engines, one 2-shard fleet:

- under continuous load, a refit in waves keeps at least refit.min_serving shards serving
  throughout (``fleet.status()`` sampled every 50 ms: serving and not in its wave) and cuts no
  request: every result has one version span and no "abort";
- a 3-turn session (``fleet.session()``) spanning a rolling refit runs every turn on the version
  it began on, on one shard, and its trajectory says so; with refit.rollout all, the same
  session's spans show the switch.

Runs under the engine lock: ``flock /tmp/nemo_gen_engine.lock ... pytest tests/engine/test_rolling_refit.py``.
The same logic on fake engines: tests/fake/test_rolling_refit.py."""

from __future__ import annotations

import threading
import time

import pytest

from nemo_gen import GenerationFleet
from nemo_gen.core.waves import Rollout
from nemo_gen.tiny_model import make_tiny_model

pytestmark = pytest.mark.engine

PROMPTS = [f"{w} the quick brown fox jumps over the lazy dog" for w in ("One", "Two", "Three", "Four")]
SERVING = {"healthy", "suspect"}


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("rolling-models") / "tiny-b", seed=1)


@pytest.fixture(scope="module")
def fleet(ray_cluster, make_settings):
    f = GenerationFleet.launch(make_settings(
        fleet__name="rolling", fleet__num_shards=2, health__probe_interval_s=60,
        generation__vllm_cfg__max_model_len=512, refit__rollout="waves", refit__wave_size=1, refit__min_serving=1))
    yield f
    f.shutdown()


def _serving(fleet) -> int:
    return sum(1 for s in fleet.status() if s.state in SERVING and s.rolling != "moving")


def test_waves_keep_min_serving_under_load_and_abort_nothing(fleet, model_b):
    stop, results, errors, samples = threading.Event(), [], [], []

    def load():
        while not stop.is_set():
            try:
                results.extend(fleet.generate(PROMPTS, max_new_tokens=48, temperature=0.0))
            except Exception as exc:  # noqa: BLE001 - the test reads every failure
                errors.append(exc)

    def sample():
        while not stop.is_set():
            samples.append((_serving(fleet), [s.rolling for s in fleet.status()]))
            time.sleep(0.05)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)] + [threading.Thread(target=sample,
                                                                                               daemon=True)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the load is running on both shards
    before = fleet.weight_version
    report = fleet.refit(str(model_b))
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(120)
    assert report.ok and {s.shard for s in report.shards} == {0, 1}
    assert not errors
    assert min(n for n, _ in samples) >= fleet.settings.refit.min_serving, samples
    assert any("moving" in rows for _, rows in samples)  # the sampler saw the roll
    assert all(r.finish_reason != "abort" and len(r.weight_versions) == 1 for r in results)
    assert {r.weight_version for r in results} == {before, report.version}
    assert {s.weight_version for s in fleet.status()} == {report.version}


def _three_turns(fleet, between):
    with fleet.session() as s:
        messages = [{"role": "user", "content": "Tell me about foxes."}]
        for turn in range(3):
            r = s.chat(messages, max_new_tokens=8, temperature=0.0)
            messages += [{"role": "assistant", "content": r.text}, {"role": "user", "content": f"More {turn}."}]
            if turn == 0:
                between()
        return s.trajectory().to_json()


def test_a_session_spanning_a_rolling_refit_stays_on_its_version_and_all_switches_it(fleet, model_b,
                                                                                    tiny_model_dir):
    start = fleet.weight_version
    done, errors = [], []

    def refit_in_background():
        def run():
            try:
                done.append(fleet.refit(str(tiny_model_dir)))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threading.Thread(target=run, daemon=True).start()
        deadline = time.monotonic() + 300
        # the other shard has moved; the session's waits for it
        while time.monotonic() < deadline and not any(s.rolling == "moved" for s in fleet.status()):
            time.sleep(0.05)

    traj = _three_turns(fleet, refit_in_background)
    deadline = time.monotonic() + 300
    while not (done or errors) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not errors and done and done[0].ok
    turns = traj["turns"]
    assert [{v for v, _ in t["weight_versions"]} for t in turns] == [{start}] * 3  # one version, every turn
    assert len({t["shard"] for t in turns}) == 1
    assert fleet.weight_version == done[0].version == start + 1

    # the same session with rollout all: the refit lands between turns 1 and 2
    fleet.settings.refit = fleet.settings.refit.model_copy(update={"rollout": Rollout.ALL, "wave_size": None,
                                                                    "min_serving": None})
    try:
        traj = _three_turns(fleet, lambda: done.append(fleet.refit(str(model_b))))
    finally:
        fleet.settings.refit = fleet.settings.refit.model_copy(update={"rollout": Rollout.WAVES, "wave_size": 1,
                                                                        "min_serving": 1})
    versions = [{v for v, _ in t["weight_versions"]} for t in traj["turns"]]
    assert versions == [{start + 1}, {start + 2}, {start + 2}]  # the spans show the switch
