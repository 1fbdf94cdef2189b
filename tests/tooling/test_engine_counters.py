"""bench/lora_fp8_gpu.py's reading of vLLM's own counters around a throughput batch (engine
steps, tokens a step carried, preemptions, the KV cache's size), over rows shaped as
``nemo_gen.shard.vllm_compat.metrics`` gives them (the benchmark's CPU dry run, ``--device cpu
--tiny``, reads them from real engines)."""

from __future__ import annotations

import pytest

from bench.lora_fp8_gpu import batch_engine_figures, engine_counters


class Fleet:
    def __init__(self, per_shard):
        self.per_shard = per_shard

    def vllm_metrics(self):
        return self.per_shard


def rows(steps, tokens, preemptions, blocks=100, block_size=16):
    return [
        {"name": "vllm:iteration_tokens_total", "labels": {"engine": "0"}, "kind": "histogram", "count": steps,
         "sum": tokens, "buckets": {}},
        {"name": "vllm:num_preemptions", "labels": {"engine": "0"}, "kind": "counter", "value": preemptions},
        {"name": "vllm:cache_config_info", "labels": {"num_gpu_blocks": str(blocks), "block_size": str(block_size)},
         "kind": "gauge", "value": 1.0},
        {"name": "vllm:num_requests_running", "labels": {}, "kind": "gauge", "value": 3.0},
    ]


def test_a_batchs_steps_tokens_per_step_and_preemptions_are_the_differences_over_every_shard():
    before = engine_counters(Fleet({0: rows(10, 100, 0), 1: rows(5, 50, 1)}))
    after = engine_counters(Fleet({0: rows(30, 500, 2), 1: rows(25, 450, 1)}))
    figures = batch_engine_figures(before, after, seconds=2.0)
    assert figures == {"engine_steps": 40, "tokens_per_step": 20.0, "ms_per_step": 50.0, "preemptions": 2,
                       "kv_cache_tokens": 3200}


def test_engines_without_their_stats_give_no_figures_rather_than_a_division_by_zero():
    empty = engine_counters(Fleet({0: []}))
    figures = batch_engine_figures(empty, empty, seconds=1.0)
    assert figures["engine_steps"] == 0 and figures["tokens_per_step"] is None and figures["ms_per_step"] is None


@pytest.mark.parametrize("name", ["vllm:num_preemptions", "vllm:num_preemptions_total"])
def test_a_counter_is_read_with_or_without_prometheus_total_suffix(name):
    counted = engine_counters(Fleet({0: [{"name": name, "labels": {}, "kind": "counter", "value": 4.0}]}))
    assert counted["preemptions"] == 4.0
