"""CPU verification forwards through MKL's packed GEMM: checking 8 draft tokens costs about what 3 did.

Why: speculative decoding pays off when a forward over n new positions costs about what a forward
over one does. On a GPU that holds; on a CPU with fp32 weights MKL's plain GEMM does not: its
small-M kernels are neither bandwidth- nor compute-bound. SmolLM2-135M on 2 cores measured V(1) 45,
V(3) 51, V(4) 68, V(8) 81, V(12) 99 ms, so every draft token past the third made verification
markedly dearer. MKL's packed API (`cblas_sgemm_pack` then `cblas_sgemm_compute`, reached through
`torch.ops.mkl._mkl_linear`) stores each weight in the layout its kernel reads for one row count M,
and the same forwards cost about as much for 5 positions as for 9 (`benchmarks/packed_gemm.py`).

A packed weight only serves exactly M rows, so a forward over fewer rows (but at least
`min_rows`) is padded with zero rows whose outputs are dropped. That is sound because a row's
result does not depend on the other rows, and cheap because the packed kernel's time hardly moves
between min_rows and M rows. Below `min_rows` (decode steps, short verifies) and above M
(prefills) the stock kernel runs.

Costs: the packed copies sit beside the original weights, which the other row counts still use.
The target service's peak resident memory went from 0.95 to 1.45 GiB for SmolLM2-135M's 0.5 GiB
of fp32 weights: about the model's size again. Results differ from the stock kernel's in the last
bits (another summation order), as they already do between MKL's kernels for 1 row and for more;
`specdec bench` found every greedy output identical to transformers' `generate()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Iterator

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger(__name__)

# Defaults of the target service's --packed-gemm-rows / --packed-gemm-min-rows. 9 rows hold the
# coordinator's default draft length (8) plus the target's own position; a packed weight costs the
# same for 8 rows and for 9. Padding 4 rows up to 9 was no cheaper than the stock kernel over 4
# (2 cores, benchmarks/packed_gemm.py), so the stock kernel keeps 1-4.
DEFAULT_ROWS = 9
DEFAULT_MIN_ROWS = 5

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("specdec_packed_gemm", default=True)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """MKL's packed sgemm exists only for float32 on CPU builds linked with MKL."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block (this thread or task), packed layers compute with the stock kernel: the
    benchmark runs transformers' own generate() on the same model object and must measure it as
    users run it."""
    token = _ENABLED.set(False)
    try:
        yield
    finally:
        _ENABLED.reset(token)


class PackedLinear(torch.nn.Linear):
    """An nn.Linear that also keeps its weight packed for `rows` rows (shares weight and bias)."""

    def __init__(self, linear: torch.nn.Linear, rows: int, min_rows: int):
        torch.nn.Module.__init__(self)  # nn.Linear.__init__ would allocate a fresh weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.rows, self.min_rows = rows, min_rows
        # A plain attribute, not a buffer: it stays out of state_dict and is rebuilt, not moved.
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.in_features
        if not self.min_rows <= n <= self.rows or not _ENABLED.get():
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(n, self.in_features)
        if n < self.rows:
            flat = F.pad(flat, (0, 0, 0, self.rows - n))
        out = torch.ops.mkl._mkl_linear(flat, self.packed, self.weight, self.bias, self.rows)
        return out[:n].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, packed_rows={self.min_rows}..{self.rows}"


@dataclasses.dataclass(frozen=True)
class PackReport:
    layers: int
    resident_bytes: int | None  # growth of the process's anonymous resident memory while packing (Linux), None elsewhere


def _resident_bytes() -> int | None:
    # The packed tensors' own sizes mislead: torch allocates MKL's byte count as floats (4x), and
    # only what MKL writes becomes resident. Anonymous memory only: weights loaded from safetensors
    # are file-backed pages that packing reads in, which the serving process would read in anyway.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pack_linears(model: torch.nn.Module, rows: int, min_rows: int) -> PackReport:
    """Swaps every float32 nn.Linear of `model` for a PackedLinear in place; tied weights stay tied."""
    if not 1 <= min_rows <= rows:
        raise ValueError(f"packed rows must satisfy 1 <= min_rows <= rows, got min_rows={min_rows}, rows={rows}")
    before = _resident_bytes()
    swapped: dict[int, PackedLinear] = {}  # a module reachable from two parents is packed once
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32:
                if id(child) not in swapped:
                    swapped[id(child)] = PackedLinear(child, rows, min_rows)
                setattr(parent, name, swapped[id(child)])
    after = _resident_bytes()
    return PackReport(len(swapped), after - before if before is not None and after is not None else None)


def apply(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, rows: int, min_rows: int) -> PackReport | None:
    """Packs a loaded model's linear layers when asked (rows > 0) and the backend has the kernel."""
    if rows <= 0:
        return None
    if not available(device, dtype):
        log.info("packed GEMM skipped: it needs float32 on a CPU build of torch with MKL", device=str(device),
                 dtype=str(dtype).removeprefix("torch."))
        return None
    start = time.perf_counter()
    report = pack_linears(model, rows, min_rows)
    log.info("linear layers packed for verification", layers=report.layers, rows=f"{min_rows}-{rows}",
             resident_mib=None if report.resident_bytes is None else round(report.resident_bytes / 2**20),
             seconds=round(time.perf_counter() - start, 2))
    return report
