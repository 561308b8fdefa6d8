"""The target's hidden states on the wire, and the per-sequence log of them a feature draft needs.

Why float16: a SmolLM2 feature is 576 values; at 2 bytes each one step's rows (the accepted tokens
and the bonus) cost ~1-5 KB, next to the ~100 bytes of a greedy Verify. bfloat16 would keep the
range of a GPU target's activations too, but numpy (and every client language) reads float16
natively, and post-norm features are small numbers that float16 holds to ~3 significant digits.
"""

from __future__ import annotations

import dataclasses

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
