"""The server's garbage-collector settings (proxy/_gc.py): no full collection while
thousands of streams open, and what start-up made is out of every collection.

Each check runs in a fresh interpreter: the settings are process-wide.
"""

from __future__ import annotations

import subprocess
import sys

# 4,000 streams opening, each keeping ~100 container objects (what an open stream
# holds: protocols, parsers, callbacks, timers, coroutines): prints the number of
# full collections that ran meanwhile.
_RAMP = """
import gc, sys
from proxy._gc import tune_collector
if sys.argv[1] == "tuned":
    tune_collector()
full = []
gc.callbacks.append(
    lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None
)
streams = [[[] for _ in range(100)] for _ in range(4000)]
print(len(full))
"""

# ``context-proxy serve`` up to the point where it would start the event loop.
_SERVE = """
import gc, sys
import proxy._cli as cli
def run(main, name):
    main.close()
    print(gc.get_threshold()[2], gc.get_freeze_count())
cli.run_loop = run
cli.main(["serve", "--port", "0"], standalone_mode=False)
"""


def _python(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_thousands_of_streams_opening_cause_no_full_collection() -> None:
    # Each full collection visits every object the process tracks; at 4,000 open
    # streams that stopped the event loop for 40-480 ms, six times in a 4 s ramp.
    assert int(_python(_RAMP, "default")) >= 3  # CPython's own thresholds
    assert int(_python(_RAMP, "tuned")) == 0


def test_serve_freezes_start_up_objects_and_spaces_full_collections() -> None:
    threshold2, frozen = _python(_SERVE).split()
    assert threshold2 == "100"
    # The imports' modules, classes and functions: tens of thousands of objects.
    assert int(frozen) > 10_000
