"""CPU forwards through specdec's own GEMM kernel: verifying 8 draft tokens costs about what
decoding one does, and batches and prefills cost less than with the stock kernel.

Why: speculative decoding pays off when a forward over n new positions costs about what a forward
over one does. On a GPU that holds; on a CPU with fp32 weights the stock (MKL) kernels do not get
there: their small-M GEMMs are neither bandwidth- nor compute-bound, so a forward over a few
rows costs markedly more than one over a single row, on AMD and Intel cores alike. The kernel
in specdec/model/cpu/csrc/gemm.c (built by specdec/model/cpu/gemm_kernel.py) streams each weight once from a panel
layout and reads it at about the memory's speed, so one row and a few rows cost about the same.
Several rows go through each panel a few at a time (as many as the CPU's vector registers hold
accumulators for) while the panel sits in the core's caches, and stayed ahead of the stock kernel
at every row count measured (docs/benchmarks.md), so batched verification and prefills take it too.

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
import dataclasses
import time

import structlog
import torch
from transformers import PreTrainedModel

from specdec.model.cpu import attention, compact, decoder, gemm_kernel, stack
from specdec.model.cpu.compact import Compact
# The layers and the switch live below the forwards that read them (specdec/model/cpu/packed.py); they
# are named here too, where their callers have always found them (gemm.disabled(), gemm.PackedLinear).
from specdec.model.cpu.packed import MAX_ROWS, SIBLINGS, LinearGroup, PackedLinear, disabled, enabled, group_siblings  # noqa: F401

log = structlog.get_logger(__name__)

# Defaults of the services' --packed-gemm-rows / --packed-gemm-min-rows: every forward up to 4,096
# positions (decode steps, verifies, batches, prompts that long), the range measured faster than
# the stock kernel with margin; decode steps (1 row) gain the most of all.
DEFAULT_ROWS = 4096
DEFAULT_MIN_ROWS = 1


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel serves float32 on CPUs, where a C compiler could build it (specdec/model/cpu/gemm_kernel.py)."""
    return device.type == "cpu" and dtype == torch.float32 and gemm_kernel.load() is not None


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
        head = model.get_output_embeddings() if weights == "q4" and isinstance(model, PreTrainedModel) else None
        return {id(m): (compact.quantize(m.weight, "int8"), "int8") if m is head else (compact.quantize(m.weight, weights), weights)
                for _, m in linears}
    gguf_path = compact.gguf_source(source) if source else None
    if gguf_path is None:
        raise ValueError("--weights gguf uses the blocks of the GGUF file the model was loaded from; this model "
                         f"({source}) was not loaded from a GGUF file: choose fp32, bf16, f16, int8 or q4")
    layers = getattr(model.config, "num_hidden_layers", 0) if isinstance(model, PreTrainedModel) else 0
    blocks = compact.GGUFWeights(gguf_path, layers or 0)
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
    # step and a verify pass, and a greedy near-tie could flip (specdec/model/cpu/attention.py). fp32 then
    # agrees with transformers' generate() (SDPA) rather than equalling it bit for bit.
    attention.use(model)
    if weights != "fp32":
        # A model built around a transformers model (a feature draft's body, specdec/model/feature_draft.py)
        # gets the same attention and, through it, the lean layer forward: otherwise its compact weights
        # would sit under transformers' eager layer, whose Python costs more than the weights here.
        for child in model.children():
            attention.use(child)
        decoder.use(model)
        stack.use(model)  # one C call for the whole stack where every layer took the lean forward
    after = _resident_bytes()
    sources = collections.Counter(held[key][1] for key in swapped)
    return PackReport(len(swapped), after - before if before is not None and after is not None else None, weights,
                      sum(layer.weight_bytes for layer in swapped.values()), dict(sources))


AUTO = "auto"


def resolve_weights(weights: str, device: torch.device, dtype: torch.dtype, rows: int, source: str | None) -> str:
    """`auto` (the services' default): the fastest format that keeps a model's greedy tokens exact
    under speculation on this machine. For a model that came from a GGUF file that is its own GGUF
    blocks: against 8-bit activations (gguf-a8, llama.cpp's arithmetic) where the CPU has 8-bit
    dot-product instructions (AVX-512 VNNI or AVX-VNNI), else expanded to floats in registers (gguf:
    without VNNI the integer products take several instructions each). Any other model: fp32.
    Every format is exact against itself at any row count; only fp32 also matches transformers' generate() (up to attention's
    last bits), which is why it stays one flag away. A GPU, or the kernel off, serves fp32."""
    if weights != AUTO:
        return weights
    if rows <= 0 or not available(device, dtype) or not source or compact.gguf_source(source) is None:
        return "fp32"
    return "gguf-a8" if int8_dot_products() else "gguf"


def int8_dot_products() -> bool:
    return bool({"avx512_vnni", "avx_vnni"} & gemm_kernel.cpu_flags())


def apply(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, rows: int, min_rows: int,
          weights: str = "fp32", source: str | None = None) -> PackReport | None:
    """Packs a loaded model's linear layers when asked (rows > 0) and the backend has the kernel.

    A compact `weights` format is part of the model served, not a speed option: where the kernel
    cannot serve it (no C compiler, a GPU, rows 0) this raises instead of quietly serving fp32.
    `auto` picks one (resolve_weights)."""
    auto, weights = weights == AUTO, resolve_weights(weights, device, dtype, rows, source)
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
    try:
        report = pack_linears(model, rows, min_rows, weights, source)
    except ValueError as exc:  # a GGUF whose block types the kernel does not read (it fails before any swap)
        if not auto or weights == "fp32":
            raise
        log.info("weights auto: fp32, the GGUF's blocks are not all readable as gguf-a8", reason=str(exc))
        weights, report = "fp32", pack_linears(model, rows, min_rows, "fp32", source)

    log.info("linear layers packed", layers=report.layers, rows=f"{min_rows}-{rows}", weights=weights,
             stored_as=report.sources, weight_mib=round(report.weight_bytes / 2**20),
             resident_mib=None if report.resident_bytes is None else round(report.resident_bytes / 2**20),
             seconds=round(time.perf_counter() - start, 2))
    return report
