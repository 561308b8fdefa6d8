"""What one full garbage collection costs in a process holding the loaded target, before and after
specdec.serving.server.settle_heap (what a `specdec serve` process does once serving).

    .venv/bin/python benchmarks/gc_pause.py [--weights gguf-a8]
"""

from __future__ import annotations

import argparse
import gc
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="gguf-a8")
    args = parser.parse_args()

    from specdec.model.assembly import LMOptions, load_lm
    from specdec.model.loading import DEFAULT_TARGET
    from specdec.serving.server import settle_heap

    served = load_lm(LMOptions(model=DEFAULT_TARGET, device="cpu", weights=args.weights))  # noqa: F841 - held, as a service holds it
    gc.collect()

    def full_ms() -> float:
        start = time.perf_counter()
        gc.collect()
        return (time.perf_counter() - start) * 1e3

    before = [full_ms() for _ in range(3)]
    tracked = len(gc.get_objects())
    frozen = settle_heap()
    after = [full_ms() for _ in range(3)]
    print(f"{tracked} tracked objects: a full collection {min(before):.1f}-{max(before):.1f} ms; "
          f"after settle_heap ({frozen} frozen) {min(after):.2f}-{max(after):.2f} ms")


if __name__ == "__main__":
    main()
