"""Services as real subprocesses (`specdec serve ...`), for tests that kill and restart them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec_tools.children import free_port  # noqa: F401 - the tests import it from here


class Service:
    """`specdec serve ROLE --port PORT ...` that can be killed and started again on the same port."""

    def __init__(
        self,
        role: str,
        *flags: str,
        port: int | None = None,
        netns: str | None = None,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
    ):
        self.role, self.flags, self.netns, self.host, self.extra_env = role, list(flags), netns, host, dict(env or {})
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, wait: float = 120.0) -> "Service":
        command = [sys.executable, "-m", "specdec_tools.cli", "serve", self.role, "--host", "0.0.0.0" if self.netns else self.host,
                   "--port", str(self.port), *self.flags]
        if self.netns:
            command = ["ip", "netns", "exec", self.netns, *command]
        env = {**os.environ, "GRPC_VERBOSITY": "ERROR", f"SPECDEC_{self.role.upper()}_LOG_FORMAT": "json", **self.extra_env}
        # SPECDEC_TEST_LOGS=DIR keeps each service's log (DIR/ROLE-PORT.log, appended across restarts)
        logs = os.environ.get("SPECDEC_TEST_LOGS")
        sink = open(os.path.join(logs, f"{self.role}-{self.port}.log"), "ab") if logs else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=sink)
        finally:
            if logs:
                sink.close()
        if wait:
            self.wait_healthy(wait)
        return self

    def wait_healthy(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.process.returncode}")
            if healthy(self.address):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.role} not healthy after {wait}s")

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()


def healthy(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING
