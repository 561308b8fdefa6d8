import os

from specdec.serving.openmp import bounded_spin

# Before torch loads libgomp: the spin `specdec` sets for its own processes, so that in-process
# engines and the services the tests start behave as users' do.
bounded_spin()

import pytest  # noqa: E402
import torch  # noqa: E402

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


# -- what did not run, and why ------------------------------------------------------------------------
# Skipped tests are named in the short summary (-ra, pyproject.toml's addopts) with their reasons
# (a missing tool, the gemma packages); the ones `-m` leaves out (`make test`: the `slow` tests not
# marked `ci`) are named here, so that a run says everything it did not do.
_DESELECTED: list[pytest.Item] = []


# Under pytest-xdist (make test) the workers collect and deselect; each hands its list to the
# controller, which prints it once.
_FROM_WORKERS: dict[str, str] = {}


def _line(item: pytest.Item) -> str:
    marks = sorted({mark.name for mark in item.iter_markers()} & {"slow", "ci"})
    return f"DESELECTED {item.nodeid}" + (f" (marked {', '.join(marks)})" if marks else "")


def pytest_deselected(items):
    _DESELECTED.extend(items)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker
        session.config.workeroutput["deselected"] = [(item.nodeid, _line(item)) for item in _DESELECTED]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _FROM_WORKERS.update(getattr(node, "workeroutput", {}).get("deselected", []))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = [_line(item) for item in _DESELECTED] or [line for _, line in sorted(_FROM_WORKERS.items())]
    if not lines:
        return
    chosen = " ".join(f"{flag} {value!r}" for flag, value in (("-m", config.option.markexpr), ("-k", config.option.keyword)) if value)
    terminalreporter.section(f"not run: {len(lines)} deselected by {chosen} (`make test-all` runs every test)", sep="-")
    for line in lines:
        terminalreporter.line(line)
