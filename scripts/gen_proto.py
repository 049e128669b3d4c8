#!/usr/bin/env python3
"""The one entry point that generates the Python code of the wire contract.

    python scripts/gen_proto.py          # regenerate memstore/v1/*_pb2*.py(i)
    python scripts/gen_proto.py --check  # exit 1 if the committed files differ from a fresh generation

Protos live under proto/memstore/v1/; their package ``memstore.v1`` maps onto the Python package
``memstore.v1`` so the generated imports (``from memstore.v1 import store_pb2``) resolve as-is.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_PACKAGE = Path("memstore") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # imported here: only developers need grpcio-tools

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    (out_root / OUT_PACKAGE).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p.relative_to(out_root) for p in (out_root / OUT_PACKAGE).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        if args.check:
            committed = {p.relative_to(ROOT) for p in (ROOT / OUT_PACKAGE).iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
            stale = [str(p) for p in fresh if not (ROOT / p).exists() or not filecmp.cmp(Path(tmp) / p, ROOT / p, shallow=False)]
            extra = sorted(str(p) for p in committed - set(fresh))
            if stale or extra:
                print("generated protobuf code is stale; run: python scripts/gen_proto.py", file=sys.stderr)
                for p in stale + extra:
                    print(f"  {p}", file=sys.stderr)
                return 1
            print(f"generated protobuf code is current ({len(fresh)} files)")
            return 0
        for p in fresh:
            shutil.copyfile(Path(tmp) / p, ROOT / p)
        print(f"wrote {len(fresh)} files under {OUT_PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
