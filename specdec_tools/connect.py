"""How the tools reach a coordinator: its address, the API token and TLS, from one set of flags.

`specdec generate` and `specdec loadtest --address` share this: the same flags, the same channel
credentials for the health wait and the calls, the same one-line errors.

    connect.add_arguments(parser)                  # --api-token, --tls, --tls-ca, --tls-cert, ...
    conn = connect.Connection.from_args(args)      # ValueError: a bad combination or unreadable file
    with conn.channel() as channel:                # TLS when configured, plaintext otherwise
        stub.GenerateStream(request, metadata=conn.metadata)   # `authorization: Bearer TOKEN`
    connect.wait_healthy(conn, 60)                 # ConnectError with the reason and a hint
    connect.describe(exc, conn)                    # an RpcError as one line, with a hint

The token travels as gRPC metadata on every call (the coordinator checks it on CoordinatorService;
health stays open). It is sent in plaintext too when TLS is off: use TLS past loopback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import time

ENV_TOKEN = "SPECDEC_API_TOKEN"

# What a failure to set up the connection looks like in gRPC core's details, and what to do about it.
_TRANSPORT_HINTS = (
    ("WRONG_VERSION_NUMBER", "the server does not speak TLS: drop --tls and the --tls-* flags"),
    ("CERTIFICATE_VERIFY_FAILED", "the server's certificate is not signed by a CA this client trusts: pass that CA with --tls-ca"),
    ("Hostname Verification", "the server's certificate does not name the host in --address: pass a name it holds with --tls-server-name"),
    ("Tls handshake failed", "the TLS handshake failed: check --tls-ca, --tls-cert and --tls-key"),
)
_CLOSED = "Socket closed"  # the server hung up during set-up: TLS against plaintext, or a missing client certificate


class ConnectError(Exception):
    """No usable coordinator: the message is one line, fit to print as is."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection", "How to reach the coordinator: its API token and TLS.")
    group.add_argument("--api-token", default=os.environ.get(ENV_TOKEN, ""), metavar="TOKEN",
                       help=f"Bearer token the coordinator requires (its --api-token), sent as `authorization` metadata on every call; "
                            f"default: ${ENV_TOKEN} (better than the flag, which `ps` shows).")
    group.add_argument("--tls", action="store_true", help="Use TLS, trusting the system's CAs (implied by the other --tls-* flags).")
    group.add_argument("--tls-ca", default="", metavar="PEM", help="CA certificate(s) to trust for the coordinator's certificate; turns TLS on.")
    group.add_argument("--tls-cert", default="", metavar="PEM", help="Client certificate, for a coordinator that requires one (its --tls-ca: mutual TLS).")
    group.add_argument("--tls-key", default="", metavar="PEM", help="Private key of --tls-cert.")
    group.add_argument("--tls-server-name", default="", metavar="NAME",
                       help="Name to expect in the coordinator's certificate instead of the host in --address (also sent as the authority).")


def _read(path: str, flag: str) -> bytes:
    try:
        return pathlib.Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path!r}: {exc.strerror}") from exc


@dataclasses.dataclass(frozen=True)
class Connection:
    """A coordinator's address and how to talk to it. `tls` False: plaintext (the other TLS fields empty)."""

    address: str
    token: str = ""
    tls: bool = False
    ca: bytes | None = None  # None with tls: the system's trusted CAs
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str = ""

    @classmethod
    def from_args(cls, args: argparse.Namespace, address: str | None = None) -> Connection:
        """From add_arguments' flags (and `address`, default args.address); ValueError names the flag at fault."""
        token = (args.api_token or "").strip()  # a token file's trailing newline is no part of it
        if any(not (32 < ord(c) < 127) for c in token):
            raise ValueError("--api-token: only printable ASCII without spaces can travel in an `authorization` header")
        if bool(args.tls_cert) != bool(args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = bool(args.tls or args.tls_ca or args.tls_cert or args.tls_server_name)
        return cls(
            address=args.address if address is None else address,
            token=token,
            tls=tls,
            ca=_read(args.tls_ca, "--tls-ca") if args.tls_ca else None,
            cert=_read(args.tls_cert, "--tls-cert") if args.tls_cert else None,
            key=_read(args.tls_key, "--tls-key") if args.tls_key else None,
            server_name=args.tls_server_name,
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Every call's metadata: the bearer token, when there is one."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self):
        """grpc.ChannelCredentials for TLS, None for plaintext."""
        import grpc

        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)

    def options(self, options=()) -> list[tuple[str, object]]:
        out = list(options)
        if self.server_name:
            out += [("grpc.ssl_target_name_override", self.server_name), ("grpc.default_authority", self.server_name)]
        return out

    def channel(self, options=()):
        """A blocking grpc.Channel to the coordinator."""
        import grpc

        credentials = self.credentials()
        if credentials is None:
            return grpc.insecure_channel(self.address, options=self.options(options))
        return grpc.secure_channel(self.address, credentials, options=self.options(options))

    def aio_channel(self, options=()):
        """A grpc.aio.Channel to the coordinator (call inside a running event loop)."""
        import grpc

        credentials = self.credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(self.address, options=self.options(options))
        return grpc.aio.secure_channel(self.address, credentials, options=self.options(options))


def hint(code_name: str, details: str, conn: Connection) -> str:
    """What to do about a failed call, or '' when there is nothing to say."""
    if code_name == "UNAUTHENTICATED":
        return f"the coordinator requires an API token: pass --api-token or set ${ENV_TOKEN}"
    if code_name == "PERMISSION_DENIED":
        return f"the coordinator rejected the API token: check --api-token / ${ENV_TOKEN}"
    for marker, text in _TRANSPORT_HINTS:
        if marker in details:
            return text
    if "Connection refused" in details:
        return "nothing listens there: start a coordinator (`specdec up`) or check --address"
    if _CLOSED in details:
        if conn.cert:
            return "the server closed the connection during the TLS handshake: it may not accept --tls-cert (not signed by the CA it trusts?)"
        if conn.tls:
            return "the server closed the connection during the TLS handshake: it may require a client certificate (--tls-cert/--tls-key)"
        return "the server closed the connection: if it serves TLS, pass --tls-ca (and --tls-cert/--tls-key if it requires client certificates)"
    return ""


def describe(exc, conn: Connection) -> str:
    """A grpc.RpcError as one line: `CODE: details (hint)`."""
    code = exc.code()
    name = code.name if code is not None else "UNKNOWN"
    details = " ".join((exc.details() or "").split())
    advice = hint(name, details, conn)
    return f"{name}: {details}" + (f" ({advice})" if advice else "")


def _transport_failure(details: str) -> bool:
    """A failure to set up the connection that waiting will not fix (a TLS mismatch)."""
    return any(marker in details for marker, _ in _TRANSPORT_HINTS) or _CLOSED in details


def health(conn: Connection, timeout: float = 1.0) -> tuple[bool, str]:
    """(SERVING?, why not: a one-line description, '' when serving), over a fresh channel with the
    connection's credentials (a fresh one each time: a failed channel would back off for seconds)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with conn.channel() as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout,
                                                                  metadata=conn.metadata)
        except grpc.RpcError as exc:
            return False, describe(exc, conn)
    if response.status == health_pb2.HealthCheckResponse.SERVING:
        return True, ""
    return False, f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)} (still loading?)"


def wait_healthy(conn: Connection, wait: float, poll: float = 0.5, give_up_after: int = 3) -> None:
    """Returns once the coordinator reports SERVING; ConnectError after `wait` seconds, or as soon as
    `give_up_after` attempts in a row failed to set up the connection (TLS that cannot work)."""
    deadline = time.monotonic() + wait
    transport_failures = 0
    while True:
        ok, why = health(conn)
        if ok:
            return
        transport_failures = transport_failures + 1 if _transport_failure(why) else 0
        if transport_failures >= give_up_after:
            raise ConnectError(f"cannot connect to the coordinator at {conn.address}: {why}")
        if time.monotonic() > deadline:
            raise ConnectError(f"no healthy coordinator at {conn.address} after {wait:.0f}s: {why}")
        time.sleep(poll)
