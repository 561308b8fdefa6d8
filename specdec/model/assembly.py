"""One loader for a model the services and the tools serve: `load_lm` (issue 58 item 1).

Serving a model is three steps in one order: load it (loading.py: alias, hub id, folder or GGUF,
on a device in a dtype), give its linear layers the weights format asked for (gemm.apply: specdec's
CPU kernel, the row-exact attention, and for compact weights the lean layer and the one-call C
stack), then choose the forward once (static.exact_lm: fixed-shape passes on a GPU with exact
numerics, else transformers' forward). The target service, the draft service and the tools all
call this, so a model is served the same way wherever it runs, and the choice of forward is made
here rather than probed for later. Packing before choosing matters on neither backend (the GPU
packs nothing; a CausalLM reads only shapes when built), and the target has always packed first.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.model.cpu import gemm
from specdec.model.interface import LanguageModel
from specdec.model.loading import LoadedModel, load_model
from specdec.model.gpu.static import exact_lm


@dataclasses.dataclass(frozen=True)
class LMOptions:
    """How to serve a model: the services' flags of the same names (target_service/config.py,
    draft_service/config.py). The defaults are the tools': every row count through the kernel, fp32
    weights, and the exact numerics the services default to."""

    model: str  # alias, hub id, folder or .gguf file
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "fp32"  # gemm.apply's format; "auto": the fastest exact one here (gemm.resolve_weights)
    packed_gemm_rows: int = gemm.DEFAULT_ROWS  # 0: the kernel stays off (and weights must be fp32)
    packed_gemm_min_rows: int = gemm.DEFAULT_MIN_ROWS
    numerics: str = "exact"  # "exact": fixed-shape passes on a GPU (static.py); "fast": transformers' forward
    pass_rows: int = 64
    static_slots: int = 32
    static_context: int = 0


@dataclasses.dataclass(frozen=True)
class LoadedLM:
    """A served model: the LanguageModel the engines run, the transformers model under it, and
    what packing it did (None: the kernel is off, or not available here)."""

    lm: LanguageModel
    loaded: LoadedModel
    packed: gemm.PackReport | None

    @property
    def weights(self) -> str:
        """The weights format the forward reads (GetInfo's `weights`)."""
        return self.packed.weights if self.packed else _dtype_name(self.loaded.dtype)

    @property
    def numerics(self) -> str:
        """"exact" where a row's logits cannot depend on its pass's other rows: fixed-shape passes
        (a GPU), or specdec's CPU kernel with its row-exact attention (a CPU with the kernel on);
        else "fast": transformers' forward over stock kernels (ModelInfo.numerics says what it means)."""
        if self.lm.fixed_shape or (self.packed is not None and self.loaded.device.type == "cpu"):
            return "exact"
        return "fast"

    @property
    def weight_bytes(self) -> int:
        """Bytes of linear-layer weights a forward reads (GetInfo's `weight_bytes`)."""
        return self.packed.weight_bytes if self.packed else gemm.linear_bytes(self.loaded.model)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_lm(options: LMOptions) -> LoadedLM:
    """Loads, packs and wraps the model `options` names (blocking: reads the weights)."""
    loaded = load_model(options.model, options.device, options.dtype)
    packed = gemm.apply(loaded.model, loaded.device, loaded.dtype, options.packed_gemm_rows, options.packed_gemm_min_rows,
                        options.weights, loaded.path)
    lm = exact_lm(loaded.model, loaded.device, options.numerics, options.pass_rows, options.static_slots,
                  options.static_context)
    return LoadedLM(lm, loaded, packed)
