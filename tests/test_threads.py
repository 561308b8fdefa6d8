"""specdec/serving/threads.py: in a confined service process, torch ops outside the compute thread start no
OpenMP team of their own (a second team makes libgomp put every team to sleep between regions,
which slowed the target's verify ~1.6x). Checked by counting the process's threads, in a fresh
interpreter each time because confinement is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import os, sys, torch
from specdec.serving import threads
from specdec.serving.engine_host import EngineHost
if sys.argv[1] == "confine":
    threads.confine()
host = EngineHost("target")
threads = lambda: len(os.listdir("/proc/self/task"))
inner = host.executor.submit(lambda: (torch.randn(512, 512) @ torch.randn(512, 512), torch.get_num_threads())[1]).result()
before = threads()
x = torch.randn(4000, 600)
x.clamp(-1.0, 1.0).half()  # an op big enough for a parallel region, on the main (event-loop) thread
torch.randn(512, 512) @ torch.randn(512, 512)
again = host.executor.submit(torch.get_num_threads).result()
print(inner, again, torch.get_num_threads(), before, threads())
"""


def run(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)), env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    return [int(v) for v in out.stdout.split()]


@pytest.mark.skipif(not os.path.exists("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="needs Linux and 2 cores")
def test_confined_process_keeps_one_openmp_team_and_the_worker_keeps_its_threads():
    inner, again, main, before, after = run("confine")
    assert (inner, again) == (2, 2)  # the compute thread keeps torch's threads
    assert main == 1
    assert after == before  # the main thread's ops started no team
    # the same script without confinement grows a team: the check above can fail
    inner, again, main, before, after = run("plain")
    assert main == 2 and after > before
