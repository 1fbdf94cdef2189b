"""The death watch (``nemo_gen.fleet.monitor.DeathWatch``) is the one owner of which members are
watched: the spare pool and recovery hand it what they install (no callback up to the facade),
nothing is watched while no monitor runs, and once one runs every member is — the ones there at
its start and those installed later (a replacement spare)."""

from __future__ import annotations

import pytest

from tests.fakes import CountingDriver, fake_fleet
from tests.helpers import wait_until


@pytest.fixture
def settings(fake_fleet_settings):
    return fake_fleet_settings


def spare_names(fleet) -> set[str]:
    return {h.name for h in fleet.members.spares()}


def test_without_a_monitor_nothing_is_watched_not_even_a_new_spare(settings):
    driver = CountingDriver()
    try:
        with fake_fleet(settings(fleet__spares=1), driver, watch=False) as fleet:
            (old,) = spare_names(fleet)
            fleet.spares.drop(old, "a test dropped it")
            wait_until(lambda: spare_names(fleet) - {old}, 5.0, "a replacement spare")
            assert driver.counts["start_watch"] == 0 and not fleet.watches.active
    finally:
        driver.close()


def test_a_running_monitor_watches_every_member_and_each_spare_installed_later(settings):
    driver = CountingDriver()
    try:
        with fake_fleet(settings(fleet__spares=1), driver) as fleet:
            assert fleet.watches.active and driver.counts["start_watch"] == 3  # two slots, one spare
            (old,) = spare_names(fleet)
            fleet.spares.drop(old, "a test dropped it")
            (new,) = wait_until(lambda: spare_names(fleet) - {old}, 5.0, "a replacement spare")
            wait_until(lambda: driver.counts["start_watch"] == 4, 5.0, "the new spare watched")
            driver.set_dead(new, actor=True)  # its watch fires: the pool drops it and starts another
            wait_until(lambda: spare_names(fleet) - {old, new}, 5.0, "the dead spare replaced")
    finally:
        driver.close()
