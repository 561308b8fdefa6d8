"""Regenerates the Python gRPC stubs in protos/ from protos/specdec.proto.

The stubs are committed so that a plain `pip install` needs no code generation step, and
tests/test_protos.py regenerates them into a temporary folder and compares byte for byte, so the
committed stubs can never drift from the contract. Run: `python -m specdec_tools.protogen`.
"""

from __future__ import annotations

import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = "protos/specdec.proto"
OUTPUTS = ("specdec_pb2.py", "specdec_pb2.pyi", "specdec_pb2_grpc.py")


def generate(out_root: pathlib.Path, repo_root: pathlib.Path = REPO_ROOT) -> list[pathlib.Path]:
    """Writes the stubs under out_root/protos/ and returns their paths.

    `-I repo_root` with the proto named as `protos/specdec.proto` makes the generated code import
    itself as `from protos import specdec_pb2`, which matches the installed package layout.
    """
    from grpc_tools import protoc  # imported lazily: only code generation needs grpcio-tools
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    (out_root / "protos").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{repo_root}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(repo_root / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out_root / "protos" / name for name in OUTPUTS]


def main() -> int:
    paths = generate(REPO_ROOT)
    for path in paths:
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
