"""A bounded spin for OpenMP's idle team threads, set before torch loads libgomp (no torch import here).

libgomp lets an idle team thread spin a while before it sleeps, but once it counts more threads
than cores it spins almost not at all ("throttled"): every parallel region of a forward then
sleeps and wakes its threads, and on a machine other processes share a woken thread waits for
the scheduler. A service's forward is hundreds of short regions, so it slowed by an order of
magnitude beside a busy neighbour and not at all on a quiet machine
(benchmarks/results/notebook-2026-11/NOTES.md, "OpenMP's spin beside a busy neighbour"). Any spin
count set at all turns the throttling off; this one is short, so idle services still sleep. A
user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
"""

from __future__ import annotations

import os

SPIN_COUNT = "20000"


def bounded_spin() -> None:
    """Call before anything imports torch: libgomp reads its environment once, when it loads."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
