"""The toy model (``tests/gates/toy_model.py``) with slow builds, for the tests that interrupt or kill a run mid-way.

``api()`` is the toy's ``ModelAPI`` whose ``build_log_probs`` first sleeps ``$NXGATES_TEST_SLOW_S`` seconds (0 when
unset), in the main process when ``$NXGATES_TEST_SLOW_WHERE`` is "main", in prefetch worker processes when it is
"workers" (the default), so a test can interrupt or kill a run at a known point; with ``$NXGATES_TEST_SLOW_IF`` set to
a flag's name, only the builds whose flags set it away from the control's value sleep (a slow candidate). Importable
by worker processes (``api_factory="tests.gates.slow_toy:api"``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time

from tests.gates import toy_model


def _slow(build):
    def build_log_probs(cfg, flags, *args, **kwargs):
        in_worker = multiprocessing.parent_process() is not None
        where = os.environ.get("NXGATES_TEST_SLOW_WHERE", "workers")
        key = os.environ.get("NXGATES_TEST_SLOW_IF")
        if (where == "workers") == in_worker and (not key or getattr(flags, key) != getattr(cfg.control, key)):
            print(f"slow_toy: pid {os.getpid()} building slowly", file=sys.stderr, flush=True)
            time.sleep(float(os.environ.get("NXGATES_TEST_SLOW_S", "0")))
        return build(cfg, flags, *args, **kwargs)

    return build_log_probs


def api():
    base = toy_model.api()
    return dataclasses.replace(base, build_log_probs=_slow(base.build_log_probs))
