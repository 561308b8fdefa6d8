"""Builds, loads and calls specdec's CPU kernels on CPUs: the small-M GEMM (specdec/model/cpu/csrc/gemm.c: float32
and compact weights) and, in the same library, row-exact attention and RMS norm (csrc/attention.c).

The kernel is compiled on first use with the machine's C compiler (`$CC`, else `cc`) and
`-O3 -march=native -fopenmp`, into the specdec cache (`$SPECDEC_CACHE_DIR/kernels`, else
~/.cache/specdec/kernels). Compiling here rather than at install time is what lets it use the
CPU's widest vectors: an image built on one machine runs on nodes with other CPUs. The file name
carries a hash of the source, the flags, the compiler's version and the CPU's model and flags, so
a cache shared between machines never hands one CPU another's code. Without a compiler (or on a
non-Linux/non-GCC toolchain that refuses the flags) `load()` returns None and callers keep the
stock kernel; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import structlog
import torch

from specdec.model.cpu.compact import Compact

log = structlog.get_logger(__name__)

SOURCE = pathlib.Path(__file__).parent / "csrc" / "gemm.c"
ATTENTION_SOURCE = SOURCE.with_name("attention.c")  # built into the same library
STACK_SOURCE = SOURCE.with_name("stack.c")  # and the whole decoder stack, which calls both
SOURCES = (SOURCE, ATTENTION_SOURCE, STACK_SOURCE)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
ALIGNMENT = 64  # bytes: the kernel reads packed panels with aligned 64-byte vector loads


class Kernel:
    """The loaded shared library: `pack` once per weight, `linear` per call."""

    def __init__(self, lib: ctypes.CDLL, path: pathlib.Path):
        self.path = path
        p, i = ctypes.c_void_p, ctypes.c_int
        # ctypes.CDLL releases the GIL around each call: the event loop keeps running meanwhile.
        self._pack = lib.sg_pack
        self._pack.argtypes, self._pack.restype = [p, i, i, p], None
        self._linear = lib.sg_linear
        self._linear.argtypes, self._linear.restype = [p, i, i, p, i, p, p], ctypes.c_int
        self._linear_c = lib.sg_linear_c
        self._linear_c.argtypes, self._linear_c.restype = [i, p, i, i, p, p, p, i, p, p], ctypes.c_int
        self._parts = lib.sg_linear_parts
        self._parts.argtypes, self._parts.restype = [i, p, i, i, p, p, p, i, p, p, p], ctypes.c_int
        self.attention = lib.sg_attention  # specdec/model/cpu/attention.py calls it
        L = ctypes.c_long
        self.attention.argtypes = [p, L, L, L, p, L, L, L, p, L, L, L, p, L, L, L, i, i, i, i, i, i, ctypes.c_float, p]
        self.attention.restype = ctypes.c_int
        self.rmsnorm = lib.sg_rmsnorm  # specdec/model/cpu/decoder.py calls it
        self.rmsnorm.argtypes, self.rmsnorm.restype = [p, i, i, p, ctypes.c_float, p], None
        self.silu_mul = lib.sg_silu_mul  # the compact model's gated-MLP activation, in every path
        self.silu_mul.argtypes, self.silu_mul.restype = [p, p, ctypes.c_size_t, p], None
        self.stack = lib.sg_stack  # specdec/model/cpu/stack.py calls it
        self.stack.argtypes = [p, i, i, p, p, p, p, p, i, i, i, i, i, p, p]
        self.stack.restype = ctypes.c_int
        self.max_rows: int = lib.sg_max_rows()
        self._read = lib.sg_read
        self._read.argtypes, self._read.restype = [p, ctypes.c_size_t], ctypes.c_float

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] float32 weight -> its panels, [ceil(N/16) * K * 16] (a copy; the weight is unchanged)."""
        w = weight.detach().contiguous()
        n, k = w.shape
        # One extra vector of room so the panels can start on a 64-byte boundary whatever the allocator gives.
        size = -(-n // 16) * k * 16
        raw = torch.empty(size + ALIGNMENT // 4, dtype=torch.float32)
        offset = (-raw.data_ptr() % ALIGNMENT) // 4
        panels = raw[offset: offset + size]
        self._pack(w.data_ptr(), n, k, panels.data_ptr())
        return panels

    def linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [M, K] float32 with 1 <= M <= max_rows -> [M, out_features]. The caller keeps K and
        out_features those of the packed weight: the kernel reads the panels by them."""
        if x.dtype != torch.float32 or x.dim() != 2:
            raise ValueError(f"the small-M kernel takes a 2-D float32 x, got {x.dtype} of shape {tuple(x.shape)}")
        x = x.contiguous()
        m, k = x.shape
        y = torch.empty(m, out_features, dtype=torch.float32)
        if self._linear(x.data_ptr(), m, k, panels.data_ptr(), out_features,
                        None if bias is None else bias.detach().contiguous().data_ptr(), y.data_ptr()):
            raise ValueError(f"the small-M kernel takes 1 to {self.max_rows} rows, got {m}")
        return y


    def read(self, buffer: torch.Tensor) -> float:
        """Sums a float32 buffer (64-byte aligned, a multiple of 64 values): reads it once at the
        memory's speed, the kernel's own physical limit."""
        if buffer.dtype != torch.float32 or buffer.numel() % 64 or buffer.data_ptr() % ALIGNMENT:
            raise ValueError("read takes a 64-byte aligned float32 buffer of a multiple of 64 values")
        return self._read(buffer.data_ptr(), buffer.numel())

    def linear_compact(self, x: torch.Tensor, weight: Compact, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [M, in_features] float32 -> [M, out_features], the weight read in its compact format."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != weight.in_features:
            raise ValueError(f"the compact kernel takes a 2-D float32 x with {weight.in_features} columns, "
                             f"got {x.dtype} of shape {tuple(x.shape)}")
        x = x.contiguous()
        m, k = x.shape
        y = torch.empty(m, weight.out_features, dtype=torch.float32)
        scales = None if weight.scales is None else weight.scales.data_ptr()
        mins = None if weight.mins is None else weight.mins.data_ptr()
        if self._linear_c(weight.code, x.data_ptr(), m, k, weight.panels.data_ptr(), scales, mins, weight.out_features,
                          None if bias is None else bias.detach().contiguous().data_ptr(), y.data_ptr()):
            raise ValueError(f"the compact kernel takes 1 to {self.max_rows} rows, got {m} (or ran out of memory)")
        return y


    def linear_parts(self, x: torch.Tensor, weight: Compact, parts: "Parts") -> list[torch.Tensor]:
        """x: [M, in_features] -> one [M, n] output per part, from `weight`, the parts' compact weights
        concatenated along the output dimension (every part but the last a multiple of 16 features):
        several layers of one input in one pass. Each output equals its layer's own call."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != weight.in_features or not x.is_contiguous():
            raise ValueError(f"the compact kernel takes a contiguous 2-D float32 x with {weight.in_features} columns, "
                             f"got {x.dtype} of shape {tuple(x.shape)}")
        m = x.shape[0]
        out = torch.empty(m * parts.total)
        scales = None if weight.scales is None else weight.scales.data_ptr()
        mins = None if weight.mins is None else weight.mins.data_ptr()
        if self._parts(weight.code, x.data_ptr(), m, weight.in_features, weight.panels.data_ptr(), scales, mins,
                       parts.count, parts.sizes, out.data_ptr(), parts.biases):
            raise ValueError(f"the compact kernel takes 1 to {self.max_rows} rows and parts of whole panels, got {m} rows, "
                             f"parts {list(parts.sizes)} (or ran out of memory)")
        return [out[m * start: m * (start + n)].view(m, n) for start, n in parts.spans]


class Parts:
    """The fixed arguments of `Kernel.linear_parts` for one group of layers, built once."""

    def __init__(self, outputs: list[tuple[int, torch.Tensor | None]]):
        self.count = len(outputs)
        self.total = sum(n for n, _ in outputs)
        self.sizes = (ctypes.c_int * self.count)(*(n for n, _ in outputs))
        self._biases = [None if b is None else b.detach().contiguous() for _, b in outputs]  # kept alive
        self.biases = (ctypes.c_void_p * self.count)(*(None if b is None else b.data_ptr() for b in self._biases))
        starts = [sum(n for n, _ in outputs[:i]) for i in range(self.count)]
        self.spans = [(start, n) for start, (n, _) in zip(starts, outputs)]


def cpu_flags() -> set[str]:
    """The feature flags /proc/cpuinfo lists for this CPU (empty where there is none)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


def _cpu_signature() -> str:
    # -march=native compiles for this CPU: the model name and feature flags say which one it is.
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
        keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
        return "\n".join(keep)
    except OSError:
        return platform.processor() or platform.machine()


def _cache_dir() -> pathlib.Path:
    from specdec.model.loading import default_cache_dir

    return default_cache_dir() / "kernels"


def _build(compiler: str, target: pathlib.Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile into a temporary name and rename: concurrent first starts (three services on one
    # machine, a test run's many processes) never load a half-written library.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = pathlib.Path(tmp.name)
    try:
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(partial)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


@functools.cache
def load() -> Kernel | None:
    """The kernel for this machine, compiled on first use; None where it cannot be built."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.warning("small-M GEMM kernel unavailable: no C compiler", compiler=compiler)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        digest = hashlib.sha256("\0".join([*(path.read_text() for path in SOURCES), " ".join(FLAGS), version,
                                           _cpu_signature()]).encode())
        target = _cache_dir() / f"gemm-{digest.hexdigest()[:16]}.so"
        if not target.is_file():
            _build(compiler, target)
            log.info("small-M GEMM kernel compiled", path=str(target))
        return Kernel(ctypes.CDLL(str(target)), target)
    except subprocess.CalledProcessError as exc:
        log.warning("small-M GEMM kernel unavailable: it did not compile", compiler=compiler,
                    error=(exc.stderr or "").strip()[-500:])
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("small-M GEMM kernel unavailable", compiler=compiler, error=str(exc))
    return None
