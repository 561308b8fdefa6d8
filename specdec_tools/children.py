"""`specdec serve` services as child processes on loopback: what the benchmarks and the load
tester start their stacks with (`specdec up` runs the same services in-process instead).

One place for spawning (a free port, a log file, JSON logs, optionally pinned to one core with one
compute thread), waiting until every service reports SERVING, and stopping them all.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServiceProcesses:
    """The child services of one stack; subclasses start the services they need in __init__."""

    def __init__(self, logs: pathlib.Path):
        from specdec_tools.cli import _health_ok

        self._health_ok = _health_ok
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.children: list[subprocess.Popen] = []

    def spawn(self, role: str, *flags: str, core: int | None = None, log_level: str | None = None) -> str:
        """Starts `specdec serve ROLE` on a free port; its address. `core`: pinned to that CPU
        core, with one compute thread (a core of its own stands in for a machine of its own)."""
        port = free_port()
        extra = ["--metrics-port", "-1"] if role != "coordinator" else []
        prefix = f"SPECDEC_{role.upper()}_"
        env = {**os.environ, prefix + "LOG_FORMAT": "json", "GRPC_VERBOSITY": "ERROR"}
        if log_level:
            env[prefix + "LOG_LEVEL"] = log_level
        if core is not None:
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        log = open(self.logs / f"{role}-{port}.log", "wb")  # noqa: SIM115 - lives as long as the child
        self.children.append(subprocess.Popen(
            [sys.executable, "-m", "specdec_tools.cli", "serve", role, "--port", str(port), *extra, *flags],
            stdout=log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=(lambda: os.sched_setaffinity(0, {core})) if core is not None else None))
        return f"127.0.0.1:{port}"

    def wait_healthy(self, addresses: list[str], timeout: float = 600.0) -> None:
        """Returns once every address reports SERVING; stops every child before raising, so a
        failed start-up leaves no process behind."""
        deadline = time.monotonic() + timeout
        while not all(self._health_ok(a) for a in addresses):
            if any(c.poll() is not None for c in self.children):
                self.stop()
                raise RuntimeError(f"a service exited during start-up; see the logs in {self.logs}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"services not healthy after {timeout:.0f}s; see the logs in {self.logs}")
            time.sleep(0.2)

    def alive(self) -> bool:
        return all(c.poll() is None for c in self.children)

    def stop(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
