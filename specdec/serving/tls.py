"""TLS between the services: certificates from files (Kubernetes mounts them from Secrets).

A server given a CA requires and verifies client certificates (mutual TLS), so only holders of a
certificate from that CA (the coordinator) can drive the draft and the target.
`scripts/make_dev_certs.sh` makes a local CA and certificates for development.
"""

from __future__ import annotations

import pathlib

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path!r}: {exc.strerror}") from exc


def server_credentials(cert: str, key: str, ca: str) -> grpc.ServerCredentials | None:
    """None (plaintext) when no certificate is configured."""
    if not cert and not key:
        if ca:
            raise ValueError("tls_ca needs tls_cert and tls_key: a server cannot verify clients without its own certificate")
        return None
    if not (cert and key):
        raise ValueError("tls_cert and tls_key go together")
    return grpc.ssl_server_credentials(
        [(_read(key, "tls_key"), _read(cert, "tls_cert"))],
        root_certificates=_read(ca, "tls_ca") if ca else None,
        require_client_auth=bool(ca),
    )


def channel_credentials(ca: str, cert: str, key: str) -> grpc.ChannelCredentials | None:
    """None (plaintext) when no CA is configured; a client certificate is sent when given."""
    if not ca:
        if cert or key:
            raise ValueError("a client certificate needs the CA that signed the server's (backend_tls_ca)")
        return None
    if bool(cert) != bool(key):
        raise ValueError("backend_tls_cert and backend_tls_key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "backend_tls_ca"),
        private_key=_read(key, "backend_tls_key") if key else None,
        certificate_chain=_read(cert, "backend_tls_cert") if cert else None,
    )
