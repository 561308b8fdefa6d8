"""Compact weight formats for the GEMM kernel: what a layer's weight is held as, and how it gets there.

Why: on a CPU a decode step reads every weight once, so its time is the weights' bytes over the
memory's bandwidth. fp32 weights cost 4 bytes each; the kernel (specdec/model/cpu/csrc/gemm.c) can
read them as bf16/f16 (2 bytes), int8 blocks (1.125: one fp32 scale per 32 weights) or 4-bit blocks
(0.75: a scale and a minimum per 32), expanding them in registers. The choice is `--weights`:

  fp32   the weights as loaded (the reference every other format is measured against)
  bf16   rounded to bfloat16 (round to nearest even), f16: to float16
  int8   symmetric blocks of 32 along the input dimension: w = q * d, q in -127..127 (as GGUF's Q8_0)
  q4     asymmetric blocks of 32: w = q * d + m, q in 0..15 (as GGUF's Q4_1), quantized here from fp32
  gguf   the blocks of the GGUF file the model was loaded from, used as they are (Q4_0, Q4_1, Q8_0,
         F16, BF16; F32 tensors stay fp32): no second quantization, the weights llama.cpp runs
  int8-a8, q4-a8, gguf-a8
         the same weights, multiplied with integer dot products against the activations rounded to
         int8 per block of 32 (one scale each), as llama.cpp computes its 4- and 8-bit layers: the
         CPU's 8-bit multiply-add instructions read the codes without expanding them to floats, so
         a decode step comes close to the memory's speed. Rounding the activations makes it another
         model than the float-activation formats; bf16/f16/F32 layers keep float activations.

The served model is the model in the chosen format: speculation is exact against that model (the
target with speculation off, same format), and `specdec bench` reports how often each format's greedy
tokens agree with fp32's.

A quantized weight is held as codes plus per-block scales in the kernel's panel layout (16 output
features side by side for each input index, see gemm.c), built here with torch: quantizing happens
once at load, where a few vectorised tensor operations per layer cost less than the model's loading.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterator

import numpy as np
import torch

from specdec.model.formats import FORMATS

# The kernel's format numbers (enums in gemm.c). int8a8 / q4a8: the same codes laid out for integer dot
# products against activations rounded to 8 bits per block of 32 (the `-a8` --weights values).
KERNEL_FORMAT = {"bf16": 1, "f16": 2, "int8": 3, "q4": 4, "int8a8": 5, "q4a8": 6, "q4a8h": 7}
# q4a8h: q4a8 with each block's scales and minimums as halves right after its codes (gemm.c SG_Q4A8H),
# for weights whose scales are halves already (GGUF's Q4_1): the same values in fewer bytes, one stream.
Q4_CODES = 256  # code bytes of a 4-bit block of one panel in the integer-dot layout: 32 k x 16 features, two a byte
HALF_BLOCK = Q4_CODES + 2 * 2 * 16  # bytes of a q4a8h block of one panel: codes, 16 half scales, 16 half minimums
A8 = "-a8"  # suffix of the --weights values whose activations are rounded to 8 bits
BLOCK = 32  # weights per scale along the input dimension
LANES = 16  # output features per panel
ALIGNMENT = 64  # bytes: the kernel reads panels and scales with aligned 64-byte loads


@dataclasses.dataclass(frozen=True)
class Compact:
    """One layer's weight in a kernel format: codes in panels, per-block scales (and minimums for q4)."""

    kind: str  # bf16 | f16 | int8 | q4 | int8a8 | q4a8 | q4a8h: the kernel format
    source: str  # what it came from: "bf16", "q4", ... or a GGUF type such as "Q4_1"
    out_features: int
    in_features: int
    panels: torch.Tensor  # uint8 view of the panel bytes, 64-byte aligned
    scales: torch.Tensor | None  # float32 [P, KB, 16], 64-byte aligned (q4a8h: None, they are in the panels)
    mins: torch.Tensor | None

    @property
    def code(self) -> int:
        return KERNEL_FORMAT[self.kind]

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads for this weight: what decoding's memory traffic is made of."""
        return sum(t.numel() * t.element_size() for t in (self.panels, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The [out, in] float32 weight this format computes with (tests, agreement checks)."""
        n, k = self.out_features, self.in_features
        if self.kind in ("bf16", "f16"):
            w = _rows(self.panels.view(torch.bfloat16 if self.kind == "bf16" else torch.float16), k).float()
        else:
            kb = -(-k // BLOCK)
            scales, mins = _half_scales(self) if self.kind == "q4a8h" else (self.scales, self.mins)
            w = _codes(self).float() * _rows(scales, kb).repeat_interleave(BLOCK, dim=1)[:, :k]
            if mins is not None:
                w = w + _rows(mins, kb).repeat_interleave(BLOCK, dim=1)[:, :k]
        return w[:n].contiguous()


def _half_scales(c: Compact) -> tuple[torch.Tensor, torch.Tensor]:
    """A q4a8h weight's [P, KB, 16] scales and minimums, as floats."""
    blocks = c.panels.reshape(-1, -(-c.in_features // BLOCK), HALF_BLOCK)
    minimums = Q4_CODES + 2 * LANES  # where the half scales end
    return (blocks[..., Q4_CODES:minimums].contiguous().view(torch.float16).float(),
            blocks[..., minimums:].contiguous().view(torch.float16).float())


def _rows(t: torch.Tensor, per_row: int) -> torch.Tensor:
    """Panel-laid data ([P, per_row, 16]) back to one row per output feature: [P * 16, per_row]."""
    return t.reshape(-1, per_row, LANES).permute(0, 2, 1).reshape(-1, per_row)


def _codes(c: Compact) -> torch.Tensor:
    """The [N padded to 16, K] codes of an int8 or 4-bit weight (int8: signed q; 4-bit: 0..15), either layout."""
    k = c.in_features
    if c.kind in ("int8a8", "q4a8", "q4a8h"):
        return _a8_codes(c)
    if c.kind == "int8":
        return _rows(c.panels.view(torch.int8), k)
    pairs = _rows(c.panels, (k + 1) // 2)
    return torch.stack([pairs & 15, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)[:, :k]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous `t` whose data starts on a 64-byte boundary."""
    t = t.contiguous()
    raw = torch.empty(t.numel() * t.element_size() + ALIGNMENT, dtype=torch.uint8)
    offset = -raw.data_ptr() % ALIGNMENT
    out = raw[offset: offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _panels(rows: torch.Tensor) -> torch.Tensor:
    """[N, C] per-output-feature data -> [ceil(N/16), C, 16]: the kernel's panel layout (zero-padded)."""
    n = rows.shape[0]
    padded = torch.zeros((-(-n // LANES) * LANES, *rows.shape[1:]), dtype=rows.dtype)
    padded[:n] = rows
    return padded.reshape(-1, LANES, *rows.shape[1:]).transpose(1, 2).contiguous()


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, KB, 32], zero-padded along K."""
    n, k = w.shape
    kb = -(-k // BLOCK)
    padded = torch.zeros(n, kb * BLOCK, dtype=w.dtype)
    padded[:, :k] = w
    return padded.reshape(n, kb, BLOCK)


def from_codes(kind: str, source: str, codes: torch.Tensor, scales: torch.Tensor | None = None,
               mins: torch.Tensor | None = None) -> Compact:
    """Lays out codes ([N, K]: uint8 0..15 for q4, int8 for int8, bf16/f16 values) and [N, KB] scales/minimums."""
    n, k = codes.shape
    if kind in ("bf16", "f16"):
        panels = _panels(codes.view(torch.int16))
    elif kind == "int8":
        panels = _panels(codes.to(torch.int8))
    elif kind == "q4":
        c = codes.to(torch.uint8)
        if k % 2:
            c = torch.cat([c, torch.zeros(n, 1, dtype=torch.uint8)], dim=1)
        panels = _panels(c[:, 0::2] | (c[:, 1::2] << 4))
    elif kind in ("int8a8", "q4a8"):
        panels = _a8_panels(kind, codes)
    elif kind == "q4a8h":
        blocks = _a8_panels("q4a8", codes)
        p, kb = blocks.shape[:2]
        halves = [_panels(t.to(torch.float16)).view(torch.uint8) for t in (scales, mins)]  # [P, KB, 32] bytes each
        panels = torch.cat([blocks.reshape(p, kb, Q4_CODES), *halves], dim=-1)
        return Compact(kind, source, n, k, _aligned(panels).reshape(-1), None, None)
    else:
        raise ValueError(f"no kernel format {kind!r}")
    return Compact(kind, source, n, k, _aligned(panels).view(torch.uint8).reshape(-1),
                   None if scales is None else _aligned(_panels(scales.float())),
                   None if mins is None else _aligned(_panels(mins.float())))


def _a8_panels(kind: str, codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> the integer-dot layout of gemm.c (SG_Q8A8 / SG_Q4A8): per panel and block of 32,
    chunks of 64 bytes holding 4 consecutive k (q4: 8, in two nibbles) of each of the 16 features."""
    n, k = codes.shape
    kb = -(-k // BLOCK)
    np_ = -(-n // LANES) * LANES
    if kind == "int8a8":
        u = torch.full((np_, kb * BLOCK), 128, dtype=torch.uint8)  # q + 128; padding is q = 0
        u[:n, :k] = (codes.to(torch.int16) + 128).to(torch.uint8)
        # [P, 16, KB, 8, 4] -> [P, KB, 8, 16, 4]
        return u.reshape(-1, LANES, kb, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    c = torch.zeros((np_, kb * BLOCK), dtype=torch.uint8)
    c[:n, :k] = codes.to(torch.uint8)
    c = c.reshape(-1, LANES, kb, 4, 2, 4)  # chunk, nibble (k 8c+t low, 8c+4+t high), t
    return (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()


def _a8_codes(c: Compact) -> torch.Tensor:
    """The [N padded to 16, K] codes of an integer-dot layout (int8: signed q; q4: 0..15)."""
    k, kb = c.in_features, -(-c.in_features // BLOCK)
    if c.kind == "int8a8":
        u = c.panels.reshape(-1, kb, 8, LANES, 4).permute(0, 3, 1, 2, 4).reshape(-1, kb * BLOCK)
        return (u.to(torch.int16) - 128)[:, :k]
    panels = c.panels.reshape(-1, kb, HALF_BLOCK)[..., :Q4_CODES] if c.kind == "q4a8h" else c.panels
    v = panels.reshape(-1, kb, 4, LANES, 4).permute(0, 3, 1, 2, 4)  # [P, 16, KB, chunk, t]
    return torch.stack([v & 15, v >> 4], dim=-2).reshape(-1, kb * BLOCK)[:, :k]


def to_a8(c: Compact) -> Compact:
    """The same int8 or 4-bit codes and scales in the integer-dot layout (other kinds are returned as they are)."""
    if c.kind not in ("int8", "q4"):
        return c
    n, kb = c.out_features, -(-c.in_features // BLOCK)

    def per_block(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else _rows(t, kb)[:n]

    scales, mins = per_block(c.scales), per_block(c.mins)
    kind = c.kind + "a8"
    if kind == "q4a8" and all(_halves_exact(t) for t in (scales, mins)):
        kind = "q4a8h"  # the same values in the smaller layout
    return from_codes(kind, c.source, _codes(c)[:n], scales, mins)


def _halves_exact(t: torch.Tensor) -> bool:
    """Does every value of `t` survive a round trip through float16 unchanged?"""
    return t is not None and bool((t.to(torch.float16).float() == t).all())


def _panel_count(c: Compact) -> int:
    return -(-c.out_features // LANES)


def joinable(parts: list[Compact]) -> bool:
    """Can `concatenate` join these, keeping every part's views 64-byte aligned for `split`?"""
    if len({(c.kind, c.in_features, c.scales is None, c.mins is None) for c in parts}) != 1:
        return False
    return all(c.out_features % LANES == 0 and c.panels.numel() % ALIGNMENT == 0 for c in parts[:-1])


def concatenate(parts: list[Compact]) -> Compact:
    """One weight holding `parts` one after another along the output dimension (their panels and
    scales concatenated): the kernel computes them in one call (specdec.model.cpu.gemm.LinearGroup)."""
    if not joinable(parts):
        raise ValueError("only parts of one kind and input size, whole panels and aligned sizes can be joined")

    def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if ts[0] is None else _aligned(torch.cat(ts))

    first = parts[0]
    return Compact(first.kind, "+".join(dict.fromkeys(c.source for c in parts)), sum(c.out_features for c in parts),
                   first.in_features, cat([c.panels for c in parts]), cat([c.scales for c in parts]), cat([c.mins for c in parts]))


def split(joined: Compact, parts: list[Compact]) -> list[Compact]:
    """`parts` again, each now holding views of `joined`'s memory (one copy of the weights)."""
    out, panel, byte = [], 0, 0
    for c in parts:
        count = _panel_count(c)
        views = dataclasses.replace(
            c, panels=joined.panels[byte: byte + c.panels.numel()],
            scales=None if c.scales is None else joined.scales[panel: panel + count],
            mins=None if c.mins is None else joined.mins[panel: panel + count])
        out.append(views)
        panel, byte = panel + count, byte + c.panels.numel()
    return out


def quantize(weight: torch.Tensor, kind: str) -> Compact:
    """fp32 [N, K] -> a kernel format, rounding to nearest (bf16, f16) or per block of 32 (int8, q4)."""
    w = weight.detach().float()
    if kind == "bf16":
        return from_codes(kind, kind, w.to(torch.bfloat16))
    if kind == "f16":
        half = w.to(torch.float16)
        if not torch.isfinite(half).all():
            raise ValueError("weights beyond float16's range (65504): use --weights bf16")
        return from_codes(kind, kind, half)
    n, k = w.shape
    blocks = _blocks(w)
    if kind == "int8":
        d = blocks.abs().amax(dim=-1) / 127
        q = torch.where(d[..., None] > 0, torch.round(blocks / d[..., None].clamp_min(1e-30)), 0).clamp(-127, 127)
        return from_codes(kind, kind, q.reshape(n, -1)[:, :k].to(torch.int8), d)
    if kind == "q4":
        lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)
        d = (hi - lo) / 15
        # Scales and minimums as halves, as GGUF's Q4_1 keeps them: the -a8 kernel then reads them
        # from the panel's own stream (q4a8h), 0.625 bytes a weight instead of 0.75.
        if torch.isfinite(d.half()).all() and torch.isfinite(lo.half()).all():
            d, lo = d.half().float(), lo.half().float()
        q = torch.where(d[..., None] > 0, torch.round((blocks - lo[..., None]) / d[..., None].clamp_min(1e-30)), 0).clamp(0, 15)
        return from_codes(kind, kind, q.reshape(n, -1)[:, :k].to(torch.uint8), d, lo)
    raise ValueError(f"weights must be one of {', '.join(FORMATS)}, not {kind!r}")


# --- GGUF blocks -------------------------------------------------------------------------------

GGUF_READABLE = ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32")


def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def gguf_compact(type_name: str, data: np.ndarray, n: int, k: int) -> Compact | None:
    """A GGUF tensor's bytes ([N, row bytes] uint8, or [N, K] values for float types) as a kernel
    format, the file's own codes and scales unchanged; None for F32 (it stays on the fp32 path)."""
    if type_name == "F32":
        return None
    if type_name in ("F16", "BF16"):
        dtype = torch.float16 if type_name == "F16" else torch.bfloat16
        values = torch.from_numpy(np.ascontiguousarray(data).view(np.uint16).astype(np.int16)).view(dtype).reshape(n, k)
        return from_codes(type_name.lower(), type_name, values)
    blocks = np.ascontiguousarray(data).reshape(n, -1)
    kb = k // BLOCK
    if type_name == "Q8_0":  # 34 bytes: f16 d, 32 x int8
        b = blocks.reshape(n, kb, 34)
        d = _f16(b[..., :2]).reshape(n, kb)
        q = torch.from_numpy(b[..., 2:].copy().view(np.int8)).reshape(n, k)
        return from_codes("int8", type_name, q, d)
    if type_name in ("Q4_0", "Q4_1"):  # 18 bytes: f16 d, 16 nibble bytes; Q4_1: 20 bytes: f16 d, f16 m, 16
        head = 2 if type_name == "Q4_0" else 4
        b = blocks.reshape(n, kb, head + 16)
        d = _f16(b[..., :2]).reshape(n, kb)
        m = -8 * d if type_name == "Q4_0" else _f16(b[..., 2:4]).reshape(n, kb)  # Q4_0: (q - 8) * d
        qs = torch.from_numpy(b[..., head:].copy())
        q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)  # byte j: weight j (low), j + 16 (high)
        return from_codes("q4", type_name, q, d, m)
    raise ValueError(f"GGUF type {type_name} is not one the kernel reads ({', '.join(GGUF_READABLE)})")


def gguf_source(model_folder: str | pathlib.Path) -> pathlib.Path | None:
    """The GGUF file a converted model folder came from (specdec.model.loading writes specdec_source.json)."""
    marker = pathlib.Path(model_folder) / "specdec_source.json"
    try:
        path = pathlib.Path(json.loads(marker.read_text())["gguf"])
    except (OSError, ValueError, KeyError):
        return None
    return path if path.is_file() else None


class GGUFWeights:
    """The quantized tensors of a GGUF file, found by the Hugging Face module names transformers gave them."""

    def __init__(self, path: pathlib.Path, num_layers: int):
        import gguf

        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        field = self.reader.fields["general.architecture"]
        arch_name = bytes(field.parts[field.data[0]]).decode()
        arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
        if arch is None:
            raise ValueError(f"{path}: architecture {arch_name!r} unknown to the gguf package")
        self.names = gguf.get_tensor_name_map(arch, num_layers)
        self.tensors = {t.name: t for t in self.reader.tensors}

    def find(self, module_name: str):
        """The GGUF tensor of an HF linear layer, or None. A tied output layer is the token embedding."""
        name = self.names.get_name(f"{module_name}.weight", try_suffixes=(".weight",))
        if name is None:
            return None
        if name not in self.tensors and name == "output.weight":
            name = "token_embd.weight"
        return self.tensors.get(name)

    def compact_for(self, module_name: str, weight: torch.Tensor) -> tuple[Compact | None, str]:
        """The layer's GGUF blocks, rows in the order of the loaded weight, checked against it; and the
        GGUF type. Converters reorder rows (transformers un-permutes llama's q/k heads): the rows are
        matched by their dequantized values, which also proves the blocks are the weights the model
        was loaded with."""
        tensor = self.find(module_name)
        if tensor is None:
            raise ValueError(f"{self.path}: no tensor for layer {module_name}")
        type_name = tensor.tensor_type.name
        if type_name not in GGUF_READABLE:
            raise ValueError(f"{self.path}: layer {module_name} is {type_name}; --weights gguf reads "
                             f"{', '.join(GGUF_READABLE)}: choose --weights q4 or int8 for this model")
        n, k = weight.shape
        compact = gguf_compact(type_name, np.asarray(tensor.data), n, k)
        if compact is None:
            return None, type_name
        theirs = compact.dequantize()
        ours = weight.detach().float()
        if torch.equal(theirs, ours):
            return compact, type_name
        order = _row_order(theirs, ours)
        if order is None:
            raise ValueError(f"{self.path}: the blocks of {tensor.name} do not hold the weights of layer {module_name} "
                             "as loaded (another file, or a conversion this check does not know)")
        panels, scales, mins = _reorder(compact, order)
        return dataclasses.replace(compact, panels=panels, scales=scales, mins=mins), type_name


def _row_order(theirs: torch.Tensor, ours: torch.Tensor) -> list[int] | None:
    """order[i]: the row of `theirs` equal to row i of `ours`, or None if some row has no equal."""
    index: dict[bytes, int] = {}
    for i, row in enumerate(theirs.numpy()):
        index.setdefault(row.tobytes(), i)
    order = [index.get(row.tobytes()) for row in ours.numpy()]
    return None if any(o is None for o in order) else order  # type: ignore[return-value]


def _reorder(c: Compact, order: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The panels, scales and minimums of `c` with output rows taken in `order`."""
    n, k = c.out_features, c.in_features
    idx = torch.tensor(order)

    def rows_of(t: torch.Tensor, per_row: int, dtype: torch.dtype) -> torch.Tensor:
        return _aligned(_panels(_rows(t.view(dtype), per_row)[:n][idx]))

    width = {"bf16": (k, torch.int16), "f16": (k, torch.int16), "int8": (k, torch.int8), "q4": ((k + 1) // 2, torch.uint8)}[c.kind]
    panels = rows_of(c.panels, *width).view(torch.uint8).reshape(-1)
    kb = -(-k // BLOCK)
    scales = None if c.scales is None else rows_of(c.scales.reshape(-1), kb, torch.float32)
    mins = None if c.mins is None else rows_of(c.mins.reshape(-1), kb, torch.float32)
    return panels, scales, mins


def linear_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Linear]]:
    """(qualified name, module) of every distinct nn.Linear, first name wins for shared modules."""
    seen: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, torch.nn.Linear) and id(module) not in seen:
            seen.add(id(module))
            yield name, module
