"""A sidecar's plan build, run as a process of its own: `python -m tests.reading.building`.

    python -m tests.reading.building URI ROOT ORDER_JSON [--kill-helper]

Forks the build helper first, as `splitfeed sidecar` does (sidecar/main.py: run), then
builds epoch 0's plan of the tests' table under ROOT with `planner.build_in_child`, as a
sidecar builds one of more than planner.IN_PROCESS_ROWS rows. With --kill-helper, a
child of the helper that dies without a word is reported first, then the helper is
killed before the build. Prints one JSON line: the helper's pid, the pid of
multiprocessing's fork server (None if none was started), what the dying child's exit
code was reported as, and the plan's location.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from splitfeed.sidecar.forks import forking

HELPER = forking.start()  # first: before any lancedb call or thread, as the sidecar does


def main(argv: list[str]) -> int:
    from multiprocessing import forkserver

    from splitfeed.sidecar.forks import planner
    from splitfeed.sidecar.data import reading
    from splitfeed.sidecar.table import plans
    from tests.reading import dying
    from tests.reading.tables import data_spec

    uri, root, order = argv[0], argv[1], json.loads(argv[2])
    assert HELPER is not None
    died = None
    if "--kill-helper" in argv:
        try:
            HELPER.run(dying.exit_holding, 3)
        except forking.ChildDied as exc:
            died = exc.code
        os.kill(HELPER.pid, signal.SIGKILL)
    table, data = reading.pin(data_spec(uri, **order))
    location = plans.location_for(data, root)
    planner.build_in_child(data, {}, location, 0, reading.layout(table, data).rows)
    print(json.dumps({"helper": HELPER.pid, "died": died, "location": location.uri,
                      "fork_server": getattr(forkserver._forkserver, "_forkserver_pid", None)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
