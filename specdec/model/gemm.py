"""CPU forwards through specdec's own GEMM kernel: verifying 8 draft tokens costs about what
decoding one does, and batches and prefills cost less than with the stock kernel.

Why: speculative decoding pays off when a forward over n new positions costs about what a forward
over one does. On a GPU that holds; on a CPU with fp32 weights the stock (MKL) kernels do not get
there: their small-M GEMMs are neither bandwidth- nor compute-bound, so a forward over a few
rows costs markedly more than one over a single row, on AMD and Intel cores alike. The kernel
in specdec/model/csrc/gemm.c (built by specdec/model/gemm_kernel.py) streams each weight once from a panel
layout and reads it at about the memory's speed, so one row and a few rows cost about the same.
Past 16 rows it takes the rows 16 at a time through each panel while the panel sits in the
core's caches, and stayed ahead of the stock kernel at every row count measured (docs/benchmarks.md),
so batched verification and prefills take it too.

Rows `min_rows`..`rows` take the kernel (`min_rows` can keep short forwards on the stock kernel;
`rows` caps it). A row's result does not depend on the other rows (one multiply-add chain
per output, in k order), so a position's logits are the same in a decode step, a verify pass, a
batch and a prefill.

Costs: the panels sit beside the original weights, which the tied embedding (and forwards past
`rows`) still use: about the model's size again in memory (SmolLM2-135M: +0.5 GiB). Results differ
from MKL's in the last bits (another summation order), as MKL's own kernels for one row and for
more already differ from each other; `specdec bench` checks every greedy output against
transformers' `generate()`.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import threading
import time
from collections.abc import Iterator

import structlog
import torch
import torch.nn.functional as F

from specdec.model import attention, compact, gemm_kernel
from specdec.model.compact import Compact

log = structlog.get_logger(__name__)

# Defaults of the services' --packed-gemm-rows / --packed-gemm-min-rows: every forward up to 4,096
# positions (decode steps, verifies, batches, prompts that long), the range measured faster than
# the stock kernel with margin; decode steps (1 row) gain the most of all.
DEFAULT_ROWS = 4096
DEFAULT_MIN_ROWS = 1
MAX_ROWS = 1 << 20  # the kernel's own bound (SG_MAX_ROWS in specdec/model/csrc/gemm.c)

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("specdec_packed_gemm", default=True)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel serves float32 on CPUs, where a C compiler could build it (specdec/model/gemm_kernel.py)."""
    return device.type == "cpu" and dtype == torch.float32 and gemm_kernel.load() is not None


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
    """An nn.Linear that also keeps its weight in the kernel's panels (shares weight and bias), as
    fp32 panels or in a compact format (specdec/model/compact.py).

    The panels are a copy taken when the layer is built: serving never changes weights after
    loading, and code that does (training, load_state_dict) must pack again or call `disabled()`.

    A compact layer computes with its compact weight at every row count: the served model is the
    model in that format, one model whether a forward is a decode step, a verify or a prefill.
    Inside `disabled()` it computes with the fp32 weight it was made from: the reference.
    """

    def __init__(self, linear: torch.nn.Linear, rows: int, min_rows: int, kernel: gemm_kernel.Kernel,
                 weight: Compact | None = None):
        torch.nn.Module.__init__(self)  # nn.Linear.__init__ would allocate a fresh weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.rows, self.min_rows = (MAX_ROWS, 1) if weight is not None else (rows, min_rows)
        self.kernel = kernel
        # Plain attributes, not buffers: they stay out of state_dict and are rebuilt, not moved.
        self.compact = weight
        self.packed = kernel.pack(linear.weight) if weight is None else None
        self.group: LinearGroup | None = None  # set by LinearGroup: siblings computed in one call
        self._bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self._bind()

    def _bind(self) -> None:
        # A decode step makes ~200 of these calls: the pointers are taken once (weights never change
        # while serving) so a call is one ctypes call and one allocation.
        c = self.compact
        self._pointers = None if c is None else (
            c.panels.data_ptr(), None if c.scales is None else c.scales.data_ptr(),
            None if c.mins is None else c.mins.data_ptr(), self.out_features,
            None if self._bias is None else self._bias.data_ptr())

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one forward through the kernel reads."""
        return self.compact.nbytes if self.compact is not None else self.in_features * self.out_features * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.in_features
        if (not self.min_rows <= n <= self.rows or not _ENABLED.get() or x.dtype != torch.float32 or x.requires_grad
                or x.shape[-1] != self.in_features):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(n, self.in_features)
        if self.compact is None:
            out = self.kernel.linear(flat, self.packed, self.out_features, self.bias)
        else:
            if not flat.is_contiguous():
                flat = flat.contiguous()
            if self.group is not None:
                out = self.group.output(self, x, flat)
            else:
                out = torch.empty(n, self.out_features)
                wp, sc, mn, width, bias = self._pointers
                if self.kernel._linear_c(self.compact.code, flat.data_ptr(), n, self.in_features, wp, sc, mn, width, bias,
                                         out.data_ptr()):
                    raise ValueError(f"the compact kernel failed on {n} rows (out of memory?)")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        held = f"weights={self.compact.source}" if self.compact is not None else f"packed_rows={self.min_rows}..{self.rows}"
        return f"{super().extra_repr()}, {held}"


class LinearGroup:
    """Sibling layers that read the same input (q/k/v projections, an MLP's gate and up) computed in
    one kernel call over their concatenated panels.

    Why: a decode step of a small model makes ~200 layer calls, and each pays a fixed cost (the
    Python call, the threads' fork and join, the first cache misses of a small weight) that is large
    next to a small layer's bytes. The first sibling called computes every sibling's output; the
    others, called next on the same input tensor, take theirs. Each output feature is computed by
    the same instructions as in its own layer's call, so the results are bit-identical.

    The outputs wait per thread (forwards of several sequences may run on several threads), keyed
    by the input tensor itself: the siblings of the architectures grouped here (see `group_siblings`)
    are called back to back on one unmodified tensor. A sibling called on another input, or twice,
    computes the whole group again: never a stale output.
    """

    def __init__(self, members: list[PackedLinear]):
        parts = [m.compact for m in members]
        self.weight = compact.concatenate(parts)
        self.members = members
        self.parts = gemm_kernel.Parts([(m.out_features, m._bias) for m in members])
        self._waiting = threading.local()
        # The members keep views of the joined panels (one copy in memory) for calls on their own.
        for index, (member, part) in enumerate(zip(members, compact.split(self.weight, parts))):
            member.compact, member.group, member.index = part, self, index
            member._bind()

    def compute(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every member's output for contiguous [M, in_features] rows, in member order."""
        return self.members[0].kernel.linear_parts(flat, self.weight, self.parts)

    def output(self, member: PackedLinear, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        waiting = getattr(self._waiting, "outputs", None)
        if waiting is not None and waiting[0] is x and member.index in waiting[1]:
            out = waiting[1].pop(member.index)
            if not waiting[1]:
                self._waiting.outputs = None
            return out
        ys = self.compute(flat)
        mine = ys[member.index]
        self._waiting.outputs = (x, {i: y for i, y in enumerate(ys) if i != member.index})
        return mine


# Sibling names that read one input in the architectures transformers ships (Llama, Mistral, Qwen2/3,
# Gemma 1-3, SmolLM, Granite, ...): attention's projections and the gated MLP's two input layers.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def group_siblings(model: torch.nn.Module) -> int:
    """Joins each parent's compact sibling layers (SIBLINGS) into a LinearGroup; returns how many groups.
    Siblings are joined when they are all compact in one kernel format, take the same input size,
    and all but the last have a whole number of panels (16 output features, compact.joinable)."""
    groups = 0
    for parent in model.modules():
        children = dict(parent.named_children())
        for names in SIBLINGS:
            members = [children.get(name) for name in names]
            if not all(isinstance(m, PackedLinear) and m.compact is not None and m.group is None for m in members):
                continue
            if not compact.joinable([m.compact for m in members]):
                continue
            LinearGroup(members)
            groups += 1
    return groups


@dataclasses.dataclass(frozen=True)
class PackReport:
    layers: int
    resident_bytes: int | None  # growth of the process's anonymous resident memory while packing (Linux), None elsewhere
    weights: str = "fp32"  # the --weights format
    weight_bytes: int = 0  # bytes of linear-layer weights a forward reads through the kernel
    sources: dict[str, int] = dataclasses.field(default_factory=dict)  # layers per stored type ("Q4_1": 210, ...)


def _resident_bytes() -> int | None:
    # Anonymous memory only: weights loaded from safetensors are file-backed pages that packing
    # reads in, which the serving process would read in anyway.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the linear layers' weights as the model holds them (a model the kernel does not serve)."""
    return sum(m.weight.numel() * m.weight.element_size() for _, m in compact.linear_modules(model))


def _compact_weights(model: torch.nn.Module, weights: str, source: str | None) -> dict[int, tuple[Compact | None, str]]:
    """Per linear layer (by id): its compact weight (None: fp32 panels) and the type it came from."""
    linears = [(name, m) for name, m in compact.linear_modules(model) if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32]
    if weights == "fp32":
        return {id(m): (None, "fp32") for _, m in linears}
    if weights.endswith(compact.A8):
        held = _compact_weights(model, weights.removesuffix(compact.A8), source)
        return {key: (None if c is None else compact.to_a8(c), kind) for key, (c, kind) in held.items()}
    if weights != "gguf":
        # q4 keeps the output layer in int8 blocks, as llama.cpp's 4-bit files keep theirs in 6-8 bits:
        # it decides every token, and 4 bits there cost the most agreement for the fewest bytes saved.
        head = model.get_output_embeddings() if weights == "q4" and hasattr(model, "get_output_embeddings") else None
        return {id(m): (compact.quantize(m.weight, "int8"), "int8") if m is head else (compact.quantize(m.weight, weights), weights)
                for _, m in linears}
    gguf_path = compact.gguf_source(source) if source else None
    if gguf_path is None:
        raise ValueError("--weights gguf uses the blocks of the GGUF file the model was loaded from; this model "
                         f"({source}) was not loaded from a GGUF file: choose fp32, bf16, f16, int8 or q4")
    blocks = compact.GGUFWeights(gguf_path, getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0)
    return {id(m): blocks.compact_for(name, m.weight) for name, m in linears}


def pack_linears(model: torch.nn.Module, rows: int, min_rows: int, weights: str = "fp32", source: str | None = None) -> PackReport:
    """Swaps every float32 nn.Linear of `model` for a PackedLinear in place; tied weights stay tied.

    `weights` (compact.FORMATS) chooses what the kernel reads; `source` is the folder the model was
    loaded from (for "gguf": the GGUF file it was converted from)."""
    if not 1 <= min_rows <= rows <= MAX_ROWS:
        raise ValueError(f"packed rows must satisfy 1 <= min_rows <= rows <= {MAX_ROWS}, got min_rows={min_rows}, rows={rows}")
    if weights not in compact.FORMATS:
        raise ValueError(f"weights must be one of {', '.join(compact.FORMATS)}, not {weights!r}")
    kernel = gemm_kernel.load()
    if kernel is None:
        raise RuntimeError("the small-M GEMM kernel could not be built here (see the log); call available() first")
    before = _resident_bytes()
    held = _compact_weights(model, weights, source)
    swapped: dict[int, PackedLinear] = {}  # a module reachable from two parents is packed once
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32:
                if id(child) not in swapped:
                    swapped[id(child)] = PackedLinear(child, rows, min_rows, kernel, held[id(child)][0])
                setattr(parent, name, swapped[id(child)])
    group_siblings(model)
    # Row-exact attention for every format, fp32 included: torch's CPU SDPA computes one query row
    # differently from several, so with it a position's logits differ in the last bits between a decode
    # step and a verify pass, and a greedy near-tie could flip (specdec/model/attention.py). fp32 then
    # agrees with transformers' generate() (SDPA) rather than equalling it bit for bit.
    attention.use(model)
    if weights != "fp32":
        from specdec.model import decoder  # it builds on this module

        decoder.use(model)
    after = _resident_bytes()
    sources = collections.Counter(held[key][1] for key in swapped)
    return PackReport(len(swapped), after - before if before is not None and after is not None else None, weights,
                      sum(layer.weight_bytes for layer in swapped.values()), dict(sources))


def apply(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, rows: int, min_rows: int,
          weights: str = "fp32", source: str | None = None) -> PackReport | None:
    """Packs a loaded model's linear layers when asked (rows > 0) and the backend has the kernel.

    A compact `weights` format is part of the model served, not a speed option: where the kernel
    cannot serve it (no C compiler, a GPU, rows 0) this raises instead of quietly serving fp32."""
    if weights not in compact.FORMATS:
        raise ValueError(f"weights must be one of {', '.join(compact.FORMATS)}, not {weights!r}")
    if rows <= 0 or not available(device, dtype):
        if weights != "fp32":
            raise ValueError(f"--weights {weights} needs specdec's CPU kernel: float32 on a CPU, a C compiler and "
                             f"--packed-gemm-rows > 0 (device {device}, dtype {str(dtype).removeprefix('torch.')}, rows {rows})")
        if rows > 0:
            log.info("packed GEMM skipped: it needs float32 on a CPU and a C compiler to build its kernel", device=str(device),
                     dtype=str(dtype).removeprefix("torch."))
        return None
    start = time.perf_counter()
    report = pack_linears(model, rows, min_rows, weights, source)

    log.info("linear layers packed", layers=report.layers, rows=f"{min_rows}-{rows}", weights=weights,
             stored_as=report.sources, weight_mib=round(report.weight_bytes / 2**20),
             resident_mib=None if report.resident_bytes is None else round(report.resident_bytes / 2**20),
             seconds=round(time.perf_counter() - start, 2))
    return report
