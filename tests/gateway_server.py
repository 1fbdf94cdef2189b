"""A server over fake shards (tests/fakes.py) in a process of its own, for the gateway's restart
tests (tests/fake/test_gateway_restart.py): ``python -m tests.gateway_server '<overrides as JSON>'``
prints its URL on one line, then serves until it is killed. The fake engine's tokens are a
function of the prompt (``fakes.fake_token``), so two runs of one conversation compare."""

from __future__ import annotations

import json
import sys
import threading


def main() -> None:
    from nemo_gen.server import start_server
    from nemo_gen.settings import NemoGenSettings
    from tests.fakes import FakeDriver, fake_fleet

    settings = NemoGenSettings.load(overrides=json.loads(sys.argv[1]))
    fleet = fake_fleet(settings, FakeDriver())
    handle = start_server(fleet)
    print(handle.url, flush=True)
    threading.Event().wait()  # until SIGKILL (or SIGTERM)


if __name__ == "__main__":
    main()
