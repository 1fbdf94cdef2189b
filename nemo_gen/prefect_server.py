"""The Prefect server process nemo-gen runs itself: ``prefect server start`` with one fix applied.

Prefect before 3.8 can deadlock a server on SQLite (PrefectHQ/prefect#23055): committing an
automation created, updated or deleted runs a listener that refreshes the server's in-memory
automations by *blocking its event-loop thread* on a coroutine that needs the automations lock —
and the triggers service, on that same loop, may hold that lock at that moment (its periodic
reconcile). The loop never runs again: every later request times out. ``nemo-gen deploy``
re-creates its crash automation on each run, so this is its path (tests/flows/test_prefect_server.py
stages the race). Prefect 3.8 schedules the refresh on the running
loop instead; we cannot take 3.8 (it needs fastapi >= 0.139, vLLM 0.32 pins < 0.137), so
``fix_automation_listener`` installs 3.8's listener into the 3.7 server.

``python -m nemo_gen.prefect_server server start ...`` is ``prefect server start ...`` with the
fix (the managed server of ``nemo_gen.prefect_api`` runs it; in the foreground only: ``--background``
is refused, as Prefect starts that server in a new process the fix never reaches); ``create_app`` is Prefect's app
factory with the fix, for ``uvicorn --factory``. On PostgreSQL or a fixed Prefect it changes
nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

# The factory uvicorn is given, as Prefect's own test harness and CLI name theirs.
PREFECT_APP_FACTORY = "prefect.server.api.server:create_app"
APP_FACTORY = "nemo_gen.prefect_server:create_app"


def needs_fix() -> bool:
    """Whether the installed Prefect has the blocking listener (fixed in 3.8.0)."""
    import prefect
    from packaging.version import Version

    return Version(prefect.__version__).release < (3, 8)


def fix_automation_listener() -> bool:
    """Replace Prefect's ``_notify`` (the automations' after-commit listener) with one that never
    blocks a running event loop; True when installed (idempotent). Create / update / delete look
    ``_notify`` up in their module at each call, so replacing the module's name is enough."""
    global _prefect_notify
    if not needs_fix():
        return False
    from prefect.server.events.models import automations

    if automations._notify is not _notify:
        _prefect_notify, automations._notify = automations._notify, _notify
    return True


_prefect_notify: Any = None  # Prefect's own, for what the fix leaves as it was (PostgreSQL)


async def _notify(session: Any, automation: Any, event: str) -> None:
    """Prefect 3.8's ``_notify``: PostgreSQL as before (NOTIFY in the transaction); SQLite refreshes
    the cache after the commit — on the committing thread's running loop as a task, not by
    blocking that loop until it is done."""
    from prefect.server.events.models import automations as models
    from prefect.server.events.triggers import automation_changed
    from prefect.server.utilities.database import get_dialect
    from prefect.utilities.asyncutils import create_task, run_coro_as_sync

    keys = {"created": "automation__created", "updated": "automation__updated", "deleted": "automation__deleted"}
    if event not in keys or get_dialect(session.sync_session).name == "postgresql":
        return await _prefect_notify(session, automation, event)

    import sqlalchemy as sa

    @sa.event.listens_for(session.sync_session, "after_commit", once=True)
    def update_cache_after_commit(_session) -> None:
        async def update() -> None:
            try:
                await automation_changed(automation.id, keys[event])
            except Exception as exc:  # what Prefect does: the cache is reconciled periodically anyway
                models.logger.error(f"Failed to update in-memory cache for automation {automation.id}, "
                                    f"event: {event}: {exc}", exc_info=True)

        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop on this thread: nothing to block, run it here
            run_coro_as_sync(update())
        else:
            create_task(update())


def create_app(*args: Any, **kwargs: Any):
    """Prefect's server app factory, with the fix installed first (``uvicorn --factory``)."""
    fix_automation_listener()
    from prefect.server.api.server import create_app as prefect_create_app

    return prefect_create_app(*args, **kwargs)


def main() -> None:
    """``prefect <args>`` (e.g. ``server start --port 4200``) in a process with the fix installed;
    Prefect's CLI reads the arguments from ``sys.argv`` itself."""
    import sys

    args = sys.argv[1:]
    if needs_fix() and args[:2] == ["server", "start"] and {"--background", "-b"} & set(args):
        # Prefect serves a background server from a new uvicorn process, which this fix never reaches.
        sys.exit("nemo_gen.prefect_server: --background starts Prefect's server in a process of its own, "
                 "without the fix; run it in the foreground (a service, or `&` in a shell)")
    fix_automation_listener()
    from prefect.cli import app

    app()


if __name__ == "__main__":
    main()
