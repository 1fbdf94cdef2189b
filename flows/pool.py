"""nemo-gen's Prefect work pool: its base job template — what a flow run's ``job_variables`` can
change in the process the worker starts — and creating or correcting the pool.

Prefect's default process template makes ``command``, ``env``, ``working_dir``, ``name`` and
``labels`` variables, and the worker lays each run's ``job_variables`` over them: whoever can
create a flow run could pick the program the worker runs, ``LD_PRELOAD`` it, or replace the
``NEMO_GEN_*`` environment that ``flows.trust`` anchors its checks to. This template fixes them:

- ``command`` is fixed to the command Prefect's default would build (``python -m
  prefect.engine``, which the process worker runs with its own interpreter): it loads the flow
  from the deployment's entrypoint.
- ``env`` and ``working_dir`` are absent from ``job_configuration``, so the flow-run process gets
  the worker's own environment (plus Prefect's run variables) and a fresh temporary directory
  (the deployments' pull step then moves to the repository root). Absent, not a fixed ``{}``:
  Prefect merges a run's ``env`` into a dict-valued ``env`` of the template even when ``env`` is
  no variable (``BaseJobConfiguration.from_template_and_values``).
- ``variables`` declares only ``flows.trust.JOB_VARIABLES``, with ``additionalProperties:
  false``: the Prefect server refuses a deployment's run (and a deployment) whose job variables
  hold anything else, naming it, when it is created.

An existing pool whose template differs (Prefect's default, from an older ``nemo-gen deploy`` or
``prefect work-pool create``) is updated to this one by ``nemo-gen deploy``, which says so; a
pool of another type is refused: its workers are not process workers.
"""

from __future__ import annotations

import copy
import enum
from typing import Any

from flows.trust import JOB_VARIABLES
from nemo_gen.errors import ConfigError

POOL_TYPE = "process"


class PoolChange(enum.Enum):
    """What ``ensure_work_pool`` did to the pool."""

    CREATED = "created"
    UPDATED = "updated"      # it had another template: now nemo-gen's
    UNCHANGED = "unchanged"


def base_job_template() -> dict[str, Any]:
    """The process pool's template: command fixed, env and working_dir the worker's own, and only
    ``JOB_VARIABLES`` settable (their schema is Prefect's own for the process worker)."""
    from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

    default = ProcessWorker.get_default_base_job_template()
    properties = default["variables"]["properties"]
    return {
        "job_configuration": {
            # the string the process worker replaces with `<its python> -m prefect.engine`
            "command": ProcessJobConfiguration._base_flow_run_command(),
            **{name: "{{ " + name + " }}" for name in sorted(JOB_VARIABLES)},
        },
        "variables": {
            "type": "object",
            "additionalProperties": False,
            "properties": {name: copy.deepcopy(properties[name]) for name in sorted(JOB_VARIABLES)},
        },
    }


async def ensure_work_pool(name: str) -> PoolChange:
    """Create the process work pool ``name`` with ``base_job_template()``, or update an existing
    one whose template differs; refuse one of another type."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    template = base_job_template()
    async with get_client() as client:
        try:
            pool = await client.read_work_pool(name)
        except ObjectNotFound:
            await client.create_work_pool(WorkPoolCreate(name=name, type=POOL_TYPE, base_job_template=template))
            return PoolChange.CREATED
        if pool.type != POOL_TYPE:
            raise ConfigError(f"the work pool {name!r} is a {pool.type!r} pool; nemo-gen's deployments run on a "
                              f"{POOL_TYPE!r} pool: name another one", field="prefect.work_pool")
        if pool.base_job_template == template:
            return PoolChange.UNCHANGED
        await client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))
        return PoolChange.UPDATED
