"""A TCP relay that delays what it forwards: the round-trip time of a link between two hosts.

This kernel has no `netem` (tc's delay), and no maintained relay on the registries delays a stream
without a server of its own to run (toxiproxy is a Go binary), so this is ours: each byte read on
one side is written to the other `delay_s` (one way, half the round trip) after it was read, in
order, with TCP_NODELAY on both sockets so the relay adds no batching of its own. The delay is an
attribute: a benchmark changes it between measurements without breaking the services' connections.

    .venv/bin/python benchmarks/delay_relay.py LISTEN_HOST:PORT TO_HOST:PORT --rtt-ms 0.5
"""

from __future__ import annotations

import argparse
import queue
import socket
import threading
import time


class DelayRelay:
    """Listens on `listen` and forwards each connection to `to`, each direction delayed by half
    the round trip. Threads with blocking sockets, not asyncio: an event loop's timers wait in
    whole milliseconds (epoll), which would turn a 0.2 ms round trip into 2 ms; a thread's
    time.sleep is good to a few tens of microseconds."""

    def __init__(self, listen: tuple[str, int], to: tuple[str, int], rtt_s: float = 0.0):
        self.to = to
        self.delay_s = rtt_s / 2
        self.bytes = 0
        self._server = socket.create_server(listen, reuse_port=False)
        self.listen = self._server.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def set_rtt(self, rtt_s: float) -> None:
        self.delay_s = rtt_s / 2

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._server.accept()
            except OSError:
                return
            try:
                far = socket.create_connection(self.to, timeout=10)
                far.settimeout(None)
            except OSError:
                near.close()
                continue
            for sock in (near, far):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for a, b in ((near, far), (far, near)):
                pending: queue.Queue = queue.Queue()
                threading.Thread(target=self._read, args=(a, pending), daemon=True).start()
                threading.Thread(target=self._deliver, args=(b, pending), daemon=True).start()

    def _read(self, sock: socket.socket, pending: queue.Queue) -> None:
        try:
            while data := sock.recv(1 << 16):
                self.bytes += len(data)
                pending.put((time.perf_counter() + self.delay_s, data))
        except OSError:
            pass
        pending.put((0.0, b""))

    @staticmethod
    def _deliver(sock: socket.socket, pending: queue.Queue) -> None:
        try:
            while True:
                due, data = pending.get()
                if not data:
                    break
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                sock.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("listen", help="HOST:PORT to listen on")
    parser.add_argument("to", help="HOST:PORT to forward to")
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    args = parser.parse_args()
    relay = DelayRelay(_address(args.listen), _address(args.to), args.rtt_ms / 1000)
    print(f"relaying {relay.listen} -> {relay.to} at {args.rtt_ms} ms round trip", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
