"""Generates the gRPC stubs of kvsparse.v1 from the repository's proto/ before the package is
built (grpcio-tools, at build time; the generated modules are never edited or committed)."""

import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
# The repository's proto/ through the link client/python/proto (a copy of this directory made
# with links resolved, and the sdist, carry the .proto files themselves).
PROTO_ROOT = HERE / "proto"
PROTOS = ["kvsparse/v1/tensor.proto", "kvsparse/v1/kvstore.proto", "kvsparse/v1/attention.proto"]


def generate_stubs() -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml)
    import grpc_tools

    out = HERE
    (out / "kvsparse" / "v1").mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTOS} in {PROTO_ROOT}")
    init = out / "kvsparse" / "v1" / "__init__.py"
    init.write_text('"""Generated gRPC stubs of the kvsparse.v1 protocol (do not edit)."""\n')


def ensure_stubs() -> None:
    """Regenerates the stubs from proto/ (in a checkout); an sdist carries them instead."""
    if PROTO_ROOT.is_dir():
        generate_stubs()
    elif not (HERE / "kvsparse" / "v1" / "attention_pb2.py").exists():
        raise RuntimeError(f"no {PROTO_ROOT} to generate the kvsparse.v1 stubs from")


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        ensure_stubs()
        super().run()


# setuptools checks the package directories (kvsparse.v1) before build_py runs.
ensure_stubs()
setup(cmdclass={"build_py": BuildPyWithStubs})
