"""The race of PrefectHQ/prefect#23055, staged in one process (run by test_prefect_server.py in a
subprocess of its own, since the unfixed server hangs for good).

``python automation_listener_race.py DB_DIR [--fixed]``: a Prefect server's database on SQLite in
DB_DIR; the automations lock held on the event loop, as the triggers service's periodic
reconcile holds it while it reads; then an automation is created, committed and deleted, as the
API's handlers do, while the lock's holder waits to release it. Prints ``holding`` once the lock
is held, ``committed`` after each commit returns and ``cache`` with what the server's in-memory
automations hold in the end.
Prefect 3.7's listener blocks the loop on the commit — the holder never runs again, nothing
more is printed, the process hangs. With ``--fixed`` (``nemo_gen.prefect_server``'s listener)
both commits return, and the cache follows once the lock is free.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path


async def race() -> None:
    from prefect.server.database import provide_database_interface
    from prefect.server.events import triggers
    from prefect.server.events.actions import DoNothing
    from prefect.server.events.models.automations import create_automation, delete_automation
    from prefect.server.events.schemas.automations import Automation, EventTrigger, Posture

    db = provide_database_interface()
    await db.create_db()
    lock = triggers._automations_lock()
    await lock.acquire()
    print("holding", flush=True)

    async def reconcile_then_release() -> None:
        await asyncio.sleep(0.5)  # "reading the database" while other requests commit
        lock.release()

    holder = asyncio.create_task(reconcile_then_release())
    automation = Automation(
        name="race", trigger=EventTrigger(expect={"x.happened"}, posture=Posture.Reactive, threshold=1),
        actions=[DoNothing()],
    )
    async with db.session_context(begin_transaction=True) as session:
        created = await create_automation(session, automation)
    print("committed", flush=True)
    await holder
    await asyncio.sleep(0.2)  # the cache refresh, queued behind the lock
    print("cache", sorted(str(i) for i in triggers.automations_by_id), "created", created.id, flush=True)
    lock_again = asyncio.create_task(lock.acquire())
    await lock_again
    holder = asyncio.create_task(reconcile_then_release())
    async with db.session_context(begin_transaction=True) as session:
        await delete_automation(session, created.id)
    print("committed", flush=True)
    await holder
    await asyncio.sleep(0.2)
    print("cache", sorted(str(i) for i in triggers.automations_by_id), flush=True)


def main() -> None:
    db_dir = Path(sys.argv[1])
    os.environ["PREFECT_HOME"] = str(db_dir)
    os.environ["PREFECT_API_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{db_dir / 'prefect.db'}"
    if "--fixed" in sys.argv:
        from nemo_gen.prefect_server import fix_automation_listener

        assert fix_automation_listener()
    asyncio.run(race())


if __name__ == "__main__":
    main()
