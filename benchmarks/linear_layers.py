"""The target's linear layers alone, as the one-call stack calls them: every layer's compact kernel
call (q/k/v, o, gate/up, down of each layer) for M rows in a loop, then the output layer; best of
five. A kernel change is measured by running this from the tree before and after, one after the
other (set PYTHONPATH to the tree: run from another folder the script imports the editable install):

    PYTHONPATH=. .venv/bin/python benchmarks/linear_layers.py 1      # M = 1: a decode step
"""

from __future__ import annotations

import ctypes
import sys
import time

import torch


def best_of(fn, repeats: int = 5, calls: int = 20) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main(rows: int) -> None:
    from specdec.model.assembly import LMOptions, load_lm
    from specdec.model.cpu.stack import installed
    from specdec.model.loading import DEFAULT_TARGET

    torch.set_grad_enabled(False)
    # the target as the target service serves it in gguf-a8; the calls below are its stack's own kernel calls
    loaded = load_lm(LMOptions(model=DEFAULT_TARGET, device="cpu", weights="gguf-a8")).loaded
    stack = installed(loaded.model.model)
    table, kernel = stack._build(), stack.kernel
    x = torch.randn(rows, 1536)
    out = torch.empty(rows * 4096)
    calls = []
    for entry in table:
        for w, k in ((entry.qkv, 576), (entry.o, 576), (entry.gateup, 576), (entry.down, 1536)):
            calls.append((w.fmt, x.data_ptr(), rows, k, w.wp, w.sc, w.mn, w.parts, ctypes.cast(w.N, ctypes.c_void_p),
                          out.data_ptr(), ctypes.cast(w.bias, ctypes.c_void_p)))
    layer_bytes = sum(m.weight_bytes for name, m in loaded.model.named_modules()
                      if hasattr(m, "weight_bytes") and "lm_head" not in name)
    head = loaded.model.lm_head
    head_out = torch.empty(rows, head.out_features)
    hp = head._pointers

    def layers() -> None:
        for args in calls:
            kernel._parts(*args)

    def output_layer() -> None:
        kernel._linear_c(head.compact.code, x.data_ptr(), rows, 576, hp[0], hp[1], hp[2], hp[3], hp[4], head_out.data_ptr())

    for name, fn, nbytes in (("layers", layers, layer_bytes), ("output layer (repeated: partly in cache)", output_layer,
                                                                 head.weight_bytes)):
        seconds = best_of(fn)
        print(f"M={rows} {name}: {seconds * 1e3:.3f} ms, {nbytes / seconds / 1e9:.1f} GB/s of {nbytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
