"""Real gRPC servers on loopback (port 0) in a background event loop, for end-to-end tests."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import threading

import grpc

from coordinator.config import CoordinatorConfig
from coordinator.serve import serve as serve_coordinator
from draft_service.config import DraftConfig
from draft_service.servicer import serve as serve_draft
from protos import specdec_pb2_grpc as pb_grpc
from target_service.config import TargetConfig
from target_service.servicer import serve as serve_target
from tests import tiny


class Stack:
    """Owns one event loop thread; services are started into it and stopped with it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers = []
        self.channels = []

    def _start(self, serve, config, **kwargs):
        async def launch():
            ready = self.loop.create_future()
            task = self.loop.create_task(serve(config, ready=ready, signals=False, **kwargs))
            done, _ = await asyncio.wait({ready, task}, timeout=300, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()  # raises the service's startup error
            if ready not in done:
                raise TimeoutError(f"{serve.__module__} did not become ready")
            return ready.result()

        server = asyncio.run_coroutine_threadsafe(launch(), self.loop).result(timeout=320)
        self.servers.append(server)
        return f"127.0.0.1:{server.port}"

    def target(self, model: str, **overrides) -> str:
        return self._start(serve_target, dataclasses.replace(TargetConfig(port=0, metrics_port=-1, model=model, device="cpu"), **overrides))

    def draft(self, **overrides) -> str:
        return self._start(serve_draft, dataclasses.replace(DraftConfig(port=0, metrics_port=-1, device="cpu"), **overrides))

    def coordinator(self, target: str, draft: str, tokenizer, **overrides) -> str:
        config = dataclasses.replace(CoordinatorConfig(port=0, http_port=-1, target=target, draft=draft, startup_timeout_s=60), **overrides)
        return self._start(serve_coordinator, config, tokenizer=tokenizer)

    def tiny_speculative(self, folder: pathlib.Path, **coordinator_overrides):
        """tests.tiny's target and noisy draft saved under `folder`, served as a target, a model draft
        and a coordinator with the HTTP API on a free port, on the byte tokenizer.
        Returns (the coordinator's gRPC address, its HTTP base URL, the target model)."""
        target, draft = tiny.tiny_pair(seed=0)
        target_addr = self.target(tiny.save(target, folder / "target"))
        draft_addr = self.draft(drafter="model", model=tiny.save(draft, folder / "draft"))
        address = self.coordinator(target_addr, draft_addr, tiny.byte_tokenizer(), http_port=0, **coordinator_overrides)
        return address, f"http://127.0.0.1:{self.servers[-1].http.port}", target

    def tiny_ngram(self, model_folder: str | pathlib.Path, target_overrides: dict | None = None, **coordinator_overrides):
        """A saved tiny target (tests.tiny.save) served as a target and a coordinator drafting
        n-grams (the target by lookup), with the HTTP API on a free port, on the byte tokenizer.
        Returns (the coordinator's gRPC address, its HTTP base URL)."""
        target_addr = self.target(str(model_folder), **(target_overrides or {}))
        address = self.coordinator(target_addr, "ngram", tiny.byte_tokenizer(), http_port=0, **coordinator_overrides)
        return address, f"http://127.0.0.1:{self.servers[-1].http.port}"

    def client(self, address: str) -> pb_grpc.CoordinatorServiceStub:
        channel = grpc.insecure_channel(address)
        self.channels.append(channel)
        return pb_grpc.CoordinatorServiceStub(channel)

    def stop(self) -> None:
        for channel in self.channels:
            channel.close()

        async def stop_all():
            await asyncio.gather(*(server.stop(0) for server in self.servers), return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop_all(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
