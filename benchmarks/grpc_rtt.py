"""The floor of one gRPC exchange in Python: an echo server and client on grpc.aio in one process,
over TCP loopback and over a unix socket, as a unary call and as a message on an open bidirectional
stream (how the coordinator talks to the services every step: coordinator/clients.py Sessions).

    .venv/bin/python benchmarks/grpc_rtt.py

What a service's step costs beyond this floor is its own path (the hop to the compute thread, the
batcher, protobuf conversion), not the transport.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
from grpc import aio

EXCHANGES = 2000


def _echo_handler() -> grpc.GenericRpcHandler:
    async def unary(request, context):
        return request

    async def stream(requests, context):
        async for request in requests:
            yield request

    return grpc.method_handlers_generic_handler("echo.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
    })


async def _measure(address: str) -> tuple[float, float]:
    server = aio.server()
    server.add_generic_rpc_handlers((_echo_handler(),))
    server.add_insecure_port(address)
    await server.start()
    channel = aio.insecure_channel(address)
    unary, stream = channel.unary_unary("/echo.Echo/Unary"), channel.stream_stream("/echo.Echo/Stream")
    payload = b"x" * 64  # about a step's Verify: a few token ids
    times = []
    for i in range(EXCHANGES + 200):
        start = time.perf_counter()
        await unary(payload)
        if i >= 200:  # the first ones warm the connection up
            times.append(time.perf_counter() - start)
    call, exchanges = stream(), []
    for i in range(EXCHANGES + 200):
        start = time.perf_counter()
        await call.write(payload)
        await call.read()
        if i >= 200:
            exchanges.append(time.perf_counter() - start)
    call.cancel()
    await channel.close()
    await server.stop(0)
    return statistics.median(times), statistics.median(exchanges)


async def main() -> None:
    for name, address in (("tcp loopback", "127.0.0.1:50999"), ("unix socket", "unix:/tmp/specdec-grpc-rtt.sock")):
        unary, exchange = await _measure(address)
        print(f"{name}: unary call {unary * 1e6:.0f} us, exchange on an open stream {exchange * 1e6:.0f} us "
              f"(medians of {EXCHANGES})")


if __name__ == "__main__":
    asyncio.run(main())
