import os

import pytest
import torch

# gRPC core logs every GOAWAY at INFO when test servers stop; keep the test output readable.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny forwards on two busy shared cores: a second OpenMP thread only spins (~100x slower).
    Modules of tiny-model loops use it with `pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
