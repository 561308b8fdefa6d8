import os

# gRPC core logs every GOAWAY at INFO when test servers stop; keep the test output readable.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
