"""The target's hidden states on the wire, and the per-sequence log of them a feature draft needs.

Why float16: a SmolLM2 feature is 576 values; at 2 bytes each one step's rows (the accepted tokens
and the bonus) cost ~1-5 KB, next to the ~100 bytes of a greedy Verify. bfloat16 would keep the
range of a GPU target's activations too, but numpy (and every client language) reads float16
natively, and post-norm features are small numbers that float16 holds to ~3 significant digits.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from specdec.errors import InvalidArgument

WIRE_DTYPE = np.dtype("<f2")


@dataclasses.dataclass(frozen=True)
class FeatureRows:
    """Hidden states [rows, dim] of consecutive positions starting at `start`."""

    start: int
    values: torch.Tensor  # [rows, dim], any float dtype

    @property
    def rows(self) -> int:
        return int(self.values.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.rows

    def as_float16(self) -> torch.Tensor:
        """The values as they travel: clamped to float16's range first, so a large activation
        becomes 65504, not inf, which the receiver would refuse."""
        return self.values.detach().float().clamp(-65504.0, 65504.0).to(torch.float16).cpu()

    def to_bytes(self) -> bytes:
        return self.as_float16().numpy().astype(WIRE_DTYPE, copy=False).tobytes()

    @classmethod
    def from_wire(cls, start: int, rows: int, dim: int, data: bytes, field: str = "features") -> FeatureRows:
        """Checks the sizes against the bytes, so a truncated or mislabelled message is refused by name."""
        if start < 0 or rows < 0 or dim < 0:
            raise InvalidArgument(field, f"start, rows and dim must be >= 0, got {start}, {rows}, {dim}")
        if len(data) != rows * dim * WIRE_DTYPE.itemsize:
            raise InvalidArgument(field, f"holds {len(data)} bytes, but {rows} rows x {dim} float16 need {rows * dim * 2}")
        array = np.frombuffer(data, dtype=WIRE_DTYPE).reshape(rows, dim)
        values = torch.from_numpy(array.astype(np.float32))
        if not torch.isfinite(values).all():
            raise InvalidArgument(field, "holds a value that is not finite")
        return cls(start, values)


class FeatureLog:
    """The features of a sequence's canonical positions, as the coordinator collects them from Verify.

    It keeps them all (about 1 KB per token for SmolLM2): a draft that restarts, or evicts the
    sequence, needs them from position 0 again, and only the coordinator has them then.
    """

    def __init__(self):
        self._values: torch.Tensor | None = None  # [capacity, dim] float16
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def put(self, rows: FeatureRows) -> None:
        """Positions from rows.start on are replaced (a target that re-filled a sequence sends them again)."""
        if rows.start > self.length:
            raise ValueError(f"features start at {rows.start}, past the {self.length} positions held: a gap")
        values = rows.as_float16()  # as on the wire
        need = rows.end
        if self._values is None or self._values.shape[0] < need or self._values.shape[1] != values.shape[1]:
            capacity = max(need, 2 * (0 if self._values is None else self._values.shape[0]), 64)
            grown = torch.empty(capacity, values.shape[1], dtype=torch.float16)
            if self._values is not None and self._values.shape[1] == values.shape[1]:
                grown[:rows.start] = self._values[:rows.start]
            self._values = grown
        self._values[rows.start:need] = values
        self.length = need

    def since(self, start: int) -> FeatureRows | None:
        """Rows [start, len) to send a draft that holds the first `start`; None when there are none."""
        if self._values is None or start >= self.length:
            return None
        return FeatureRows(start, self._values[start:self.length])


def resolve_feature_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """`--feature-layers`: "" or "last" (the final hidden states, the default), "low,mid,high"
    (EAGLE-3's choice: the outputs of layers 1, L/2 - 1 and L - 4 of L), or decoder-layer indices
    "i,j,k" in [0, L). Returns () for the final hidden states, else the distinct layers in order."""
    spec = spec.strip()
    if spec in ("", "last"):
        return ()
    named = {"low": 1, "mid": num_layers // 2 - 1, "high": num_layers - 4}
    layers: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        layer = min(max(named[part], 0), num_layers - 1) if part in named else int(part)
        if not 0 <= layer < num_layers:
            raise ValueError(f"feature layer {part!r} is not a decoder layer of the target's {num_layers}")
        if layer not in layers:
            layers.append(layer)
    return tuple(layers)


@contextlib.contextmanager
def layer_outputs(decoder: torch.nn.Module, layers: tuple[int, ...]) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Within the block, each forward of `decoder` (a LlamaModel) appends the output hidden states
    [B, T, H] of each named decoder layer (the residual stream after it, before any norm) to
    outputs[layer]. The hooks exist only inside the block: a hooked layer keeps the one-call
    decoder stack (specdec/model/cpu/stack.py) from running, so no forward without it pays for them."""
    outputs: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    handles = []

    def hook(layer):
        def record(module, args, output):
            outputs[layer].append((output[0] if isinstance(output, tuple) else output).detach())
        return record

    try:
        for layer in layers:
            handles.append(decoder.layers[layer].register_forward_hook(hook(layer)))
        yield outputs
    finally:
        for handle in handles:
            handle.remove()
