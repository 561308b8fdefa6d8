"""Exec probe for a draft or target service that requires mutual TLS.

    python /etc/specdec/probe/health.py PORT NAME

Asks grpc.health.v1 on 127.0.0.1:PORT, presenting the coordinator's client certificate and
checking the server's certificate for NAME (a SAN of tls.crt: draft or target). Exit 0 only when
the service reports SERVING (its model is loaded and warmed, and it is not shutting down).
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TLS_DIR = os.environ.get("SPECDEC_PROBE_TLS_DIR", "/etc/specdec/tls")


def read(name: str) -> bytes:
    with open(os.path.join(TLS_DIR, name), "rb") as fh:
        return fh.read()


def main(port: str, name: str) -> int:
    credentials = grpc.ssl_channel_credentials(read("ca.crt"), read("client.key"), read("client.crt"))
    options = [("grpc.ssl_target_name_override", name)]
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
        except grpc.RpcError as exc:
            print(f"health check failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
