"""Which thread of a service process runs torch's parallel kernels: one, the engine's worker.

The CPU torch wheels parallelise with GNU OpenMP (libgomp), which gives every thread that enters
a parallel region a team of its own worker threads. Once a process holds more OpenMP threads than
the machine has cores, libgomp stops letting idle team threads spin between regions: they sleep
on a futex, and every region pays a wake-up. A model forward is hundreds of short regions, so the
whole forward slows down, for the rest of the process's life.

One stray op is enough: a single clamp() over a large tensor on the event-loop thread (the
target's feature encoding did one) made every later verify on the engine's worker markedly
slower, so over gRPC with the feature draft the target's verify fell well behind its in-process
time, and a target that had served one feature-draft request stayed that slow for every request
after it.

So `specdec serve` confines torch's parallelism to the compute thread. The engine's worker
(specdec.serving.engine_host.EngineHost) gets the threads torch would have used, and every other thread (the event
loop, executor threads) runs whatever torch ops it has single-threaded. Processes that never call
`confine` (tests, `specdec bench`, in-process stacks) keep torch's defaults.
"""

from __future__ import annotations

import torch

_compute_threads: int | None = None


def confine(threads: int = 0) -> None:
    """Keeps torch's intra-op threads (or `threads`, when > 0: --compute-threads) for the compute
    thread; this thread (the event loop's) gets one. Idempotent; call before any thread of the
    process has run a parallel torch op."""
    global _compute_threads
    if _compute_threads is None:
        _compute_threads = threads or torch.get_num_threads()
        torch.set_num_threads(1)


def enter_compute_thread() -> None:
    """The compute worker's initializer: all the intra-op threads `confine` kept (a no-op in a
    process that did not confine). The setting is per thread under OpenMP."""
    if _compute_threads is not None:
        torch.set_num_threads(_compute_threads)


def compute_threads() -> int:
    """Intra-op threads of the compute thread: what a service reports and logs."""
    return _compute_threads if _compute_threads is not None else torch.get_num_threads()


def loop_computes_alike(device) -> bool:
    """Whether model work on `device` runs as fast on this thread (the event loop's) as on the
    compute thread: where both threads compute on the CPU with one intra-op thread
    (--compute-threads 1, a service pinned to a core), so that this one starts no OpenMP team of
    its own either. A service may then run a lone step here and save the two thread hops
    (specdec/serving/batcher.py, `inline`).

    Not on an accelerator yet, though there the host thread only queues kernels: the CUDA path's
    graphs are captured and replayed on the compute thread, and a step replayed from another thread
    has not been run on a GPU (exactness there is checked by benchmarks/cuda_check.sh)."""
    if torch.device(device).type != "cpu":
        return False
    return compute_threads() == 1 and torch.get_num_threads() == 1
