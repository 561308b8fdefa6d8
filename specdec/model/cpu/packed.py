"""The packed linear layers that forward through specdec's GEMM kernel, and the switch that turns
them off: the pieces the model's forwards (specdec/model/cpu/attention.py, specdec/model/cpu/decoder.py)
read. specdec/model/cpu/gemm.py puts them into a model (pack_linears, apply) and says why the kernel
exists; this module imports none of that, so the forwards never import gemm.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from specdec.model.cpu import compact, gemm_kernel
from specdec.model.cpu.compact import Compact

MAX_ROWS = 1 << 20  # the kernel's own bound (SG_MAX_ROWS in specdec/model/cpu/csrc/gemm.c)

# Off within gemm.disabled() (this thread or task): packed layers and the row-exact attention then
# compute as stock transformers does.
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("specdec_packed_gemm", default=True)


def enabled() -> bool:
    """Whether packed layers and the row-exact attention use the kernel here (not inside disabled())."""
    return _ENABLED.get()


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
    fp32 panels or in a compact format (specdec/model/cpu/compact.py).

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
