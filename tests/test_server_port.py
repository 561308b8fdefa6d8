"""A service on a port another server holds fails at start with the port named (specdec/serving/server.py):
gRPC's default SO_REUSEPORT would let both bind it and split its connections silently."""

from __future__ import annotations

import asyncio

import pytest

from specdec.serving.server import Server


def test_a_second_server_on_a_taken_port_fails_naming_it():
    async def main():
        first = Server("127.0.0.1", 0, [])
        await first.start()
        try:
            with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{first.port}"):
                Server("127.0.0.1", first.port, [])
        finally:
            await first.server.stop(0)

    asyncio.run(main())
