"""Two fleets of one process share the local Ray cluster the first started: closing either
leaves the other's cluster up; the last one stops it. A cluster the caller connected to first is
never stopped or disconnected by a fleet. Real Ray, in a fresh process each (this session's own
cluster, ``ray_cluster``, must not be the one under test)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.engine

SHARED = """
import ray
from nemo_gen.fleet.cluster import init_ray, shutdown_ray
from nemo_gen.settings import NemoGenSettings

settings = NemoGenSettings.load(overrides={"ray.num_cpus": 1, "ray.namespace": "nemo_gen_ray_sharing"}).ray
first = init_ray(settings)   # starts the private cluster
second = init_ray(settings)  # a second fleet beside it: shares it
assert first.owned and second.owned and first.lease != second.lease
shutdown_ray(first)
assert ray.is_initialized(), "the first fleet's close stopped the cluster the second still uses"
assert ray.get(ray.put(7)) == 7
shutdown_ray(first)  # again: nothing
assert ray.is_initialized()
shutdown_ray(second)
assert not ray.is_initialized(), "the last fleet's close left the cluster running"
third = init_ray(settings)  # a fresh start after that: owned again, and stopped by its close
assert third.owned
shutdown_ray(third)
assert not ray.is_initialized()
print("OK")
"""

CALLERS = """
import ray
from nemo_gen.fleet.cluster import init_ray, shutdown_ray
from nemo_gen.settings import NemoGenSettings

ray.init(address="local", num_cpus=1, include_dashboard=False)  # the caller's own (a trainer's) Ray
conn = init_ray(NemoGenSettings.load().ray)
assert not conn.owned
shutdown_ray(conn)
assert ray.is_initialized() and ray.get(ray.put(1)) == 1, "a fleet's close cut the caller's Ray connection"
ray.shutdown()
print("OK")
"""


@pytest.mark.parametrize("script", [SHARED, CALLERS], ids=["two-fleets", "callers-ray"])
def test_a_fleet_stops_only_the_ray_it_alone_still_uses(script):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
