"""`specdec serve` services as child processes on loopback: what `specdec up`, the benchmarks and
the load tester run their stacks with (specdec_tools/stacks.py says which services and flags).

One place for spawning (a port, JSON logs, optionally pinned to one core with one compute thread),
waiting until every service reports SERVING, and stopping them all. A tool's children (`logs`: a
folder) take free ports, write a log file each and run quiet: no metrics endpoint, no HTTP API,
gRPC's own logging at errors only. `specdec up`'s (`logs` None) print to this terminal and keep
their metrics endpoints and the coordinator's HTTP API.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable


_GIVEN: set[int] = set()  # ports this process handed out


def free_port() -> int:
    """A port free now, and not one handed out before by this process.

    Why the second condition: the port is free only until the child binds it, and a stack spawns
    its children one after another before any has bound; the system may then offer the same port
    twice, and gRPC servers bind with SO_REUSEPORT, so two replicas silently shared one address
    (a clean-clone CI run of tests/test_fleet.py: "target replicas served [8, 16]", two addresses
    for three replicas, and the sequences of the replica it then killed were never re-filled)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def health_ok(address: str, timeout: float = 1.0) -> bool:
    """Whether the service at `address` reports SERVING (the gRPC health protocol)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


class ServiceProcesses:
    """The child services of one stack. `grace`: seconds each gets to exit after SIGTERM.
    `backend_token`: the --backend-token of every child (empty: off)."""

    def __init__(self, logs: pathlib.Path | None, grace: float = 20.0, backend_token: str = ""):
        self.logs = logs
        self.grace = grace
        self.backend_token = backend_token
        self.children: list[subprocess.Popen] = []
        self.roles: dict[str, str] = {}  # address -> role, in start order

    def spawn(self, role: str, *flags: str, core: int | None = None, log_level: str | None = None, port: int = 0) -> str:
        """Starts `specdec serve ROLE` on `port` (0: a free one); its address. `core`: pinned to that
        CPU core, with one compute thread (a core of its own stands in for a machine of its own)."""
        port = port or free_port()
        prefix = f"SPECDEC_{role.upper()}_"
        env = {**os.environ, prefix + "LOG_FORMAT": "json", **({"GRPC_VERBOSITY": "ERROR"} if self.logs is not None else {})}
        if log_level:
            env[prefix + "LOG_LEVEL"] = log_level
        # In the environment, not on the command line `ps` shows; and set on every child, empty too,
        # so that a variable left in the shell cannot give one service of the stack a token the others lack.
        env[prefix + "BACKEND_TOKEN"] = self.backend_token
        if core is not None:
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        log = self._log_file(role, port)
        self.children.append(subprocess.Popen(
            [sys.executable, "-m", "specdec_tools.cli", "serve", role, "--port", str(port), *self._quiet_flags(role), *flags],
            stdout=log, stderr=subprocess.STDOUT if log else None, env=env,
            preexec_fn=(lambda: os.sched_setaffinity(0, {core})) if core is not None else None))
        address = f"127.0.0.1:{port}"
        self.roles[address] = role
        return address

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system, every thread) each role's processes have used so far, from
        /proc ({} where there is none): what a load test charges each service for its tokens."""
        totals: dict[str, float] = {}
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        for role, child in zip(self.roles.values(), self.children):
            try:
                fields = pathlib.Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            totals[role] = totals.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return totals

    def _quiet_flags(self, role: str) -> list[str]:
        """A tool's children: no metrics endpoint (the model services) and no HTTP API (the coordinator)."""
        if self.logs is None:
            return []
        return ["--metrics-port", "-1"] if role != "coordinator" else ["--http-port", "-1"]

    def _log_file(self, role: str, port: int):
        """A tool's child's log file (it lives as long as the child); None: this terminal."""
        if self.logs is None:
            return None
        self.logs.mkdir(parents=True, exist_ok=True)
        return open(self.logs / f"{role}-{port}.log", "wb")  # noqa: SIM115

    def wait_healthy(self, addresses: list[str], timeout: float = 600.0,
                     announce: Callable[[str, str], None] | None = None) -> None:
        """Returns once every address reports SERVING (`announce(role, address)` as each does);
        stops every child before raising, so a failed start-up leaves no process behind."""
        deadline = time.monotonic() + timeout
        pending = self._serving(list(addresses), announce)
        while pending:
            self._check_start_up(pending, deadline, timeout)
            time.sleep(0.2)
            pending = self._serving(pending, announce)

    def _serving(self, pending: list[str], announce: Callable[[str, str], None] | None) -> list[str]:
        """Announces the addresses now SERVING; those still not."""
        healthy = [a for a in pending if health_ok(a)]
        if announce:
            for address in healthy:
                announce(self.roles.get(address, address), address)
        return [a for a in pending if a not in healthy]

    def _check_start_up(self, pending: list[str], deadline: float, timeout: float) -> None:
        """Stops every child and raises when one has exited or the deadline has passed."""
        exited = [(role, c) for role, c in zip(self.roles.values(), self.children) if c.poll() is not None]
        if exited:
            self.stop()
            raise RuntimeError(f"{exited[0][0]} exited with code {exited[0][1].returncode}{self._see_logs()}")
        if time.monotonic() > deadline:
            self.stop()
            raise TimeoutError(f"not healthy after {timeout:.0f}s: {sorted(self.roles.get(a, a) for a in pending)}{self._see_logs()}")

    def _see_logs(self) -> str:
        return f"; see the logs in {self.logs}" if self.logs is not None else ""

    def alive(self) -> bool:
        return all(c.poll() is None for c in self.children)

    def stop(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            try:
                child.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                child.kill()
