"""The package builds from a copy of client/python alone (links resolved: its LICENSE and proto/
are links into the repository): `python -m build` makes an sdist carrying the .proto files and the
generated stubs and a wheel built from that sdist, which installs into a clean venv and imports;
and `pip install ./client/python` from the repository leaves `git status` as it was. Needs PyPI
(the builds' isolated environments); skipped without it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import pytest

import kvsparse

PACKAGE = Path(__file__).resolve().parents[1]
REPO = PACKAGE.parents[1]


def _pypi() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/build/", timeout=5).close()
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _pypi(), reason="needs PyPI for the builds' isolated environments")


def _run(*args: str, cwd: Path | None = None) -> str:
    r = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(args)}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r.stdout


def test_a_copy_of_the_package_directory_builds_and_installs(tmp_path: Path) -> None:
    copy = tmp_path / "python"
    generated = {PACKAGE / "build", PACKAGE / "kvsparse.egg-info", PACKAGE / "kvsparse" / "v1", PACKAGE / "tests"}

    def ignore(folder: str, names: list[str]) -> list[str]:  # what a fresh clone does not have
        return [n for n in names if Path(folder) / n in generated or n == "__pycache__"]

    shutil.copytree(PACKAGE, copy, symlinks=False, ignore=ignore)  # links resolved, as `cp -rL`
    assert not (copy / "kvsparse" / "v1").exists()  # no generated stubs: they come from proto/
    tools = tmp_path / "tools"
    _run(sys.executable, "-m", "venv", str(tools))
    _run(str(tools / "bin" / "pip"), "install", "-q", "build")
    _run(str(tools / "bin" / "python"), "-m", "build", str(copy), "-o", str(tmp_path / "dist"))
    sdist = next((tmp_path / "dist").glob("kvsparse-*.tar.gz"))
    wheel = next((tmp_path / "dist").glob("kvsparse-*.whl"))
    names = tarfile.open(sdist).getnames()
    assert any(n.endswith("proto/kvsparse/v1/attention.proto") for n in names), names
    assert any(n.endswith("kvsparse/v1/attention_pb2.py") for n in names), names
    # Every module of the package's subpackages (grpc, torch, vllm, tools) is in the wheel.
    sources = {p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "kvsparse").rglob("*.py")
               if "v1" not in p.parts and "__pycache__" not in p.parts}
    missing = sources - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, sorted(missing)
    clean = tmp_path / "clean"
    _run(sys.executable, "-m", "venv", str(clean))
    _run(str(clean / "bin" / "pip"), "install", "-q", str(wheel))
    out = _run(str(clean / "bin" / "python"), "-c",
               "import kvsparse, kvsparse.v1.attention_pb2 as a; print(kvsparse.Client.__name__, a.DESCRIPTOR.package)")
    assert out.split() == ["Client", "kvsparse.v1"]


def test_installing_from_the_repository_leaves_git_status_as_it_was(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    before = _run("git", "status", "--porcelain", cwd=REPO)
    _run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"), str(PACKAGE))
    assert _run("git", "status", "--porcelain", cwd=REPO) == before


# Against the real server: create, append, health and a dense decode equal to numpy's attention.
_SMOKE = """
import sys
import numpy as np
import google.protobuf, grpc
import kvsparse
with kvsparse.Client(sys.argv[1], timeout=60) as c:
    assert c.store.health() == "SERVING"
    c.store.create_sequence("floors", kvsparse.ModelShape(1, 4, 2, 64, "fp32"))
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 300, 2, 64)).astype(np.float32)
    v = rng.standard_normal((1, 300, 2, 64)).astype(np.float32)
    c.store.append("floors", k, v)
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    out = c.attention.decode(0, ["floors"], q, kvsparse.Dense()).output
    s = np.einsum("hd,thd->ht", q[0], np.repeat(k[0], 2, axis=1)) / 8.0
    p = np.exp(s - s.max(axis=1, keepdims=True))
    ref = np.einsum("ht,thd->hd", p / p.sum(axis=1, keepdims=True), np.repeat(v[0], 2, axis=1))
    assert np.allclose(out[0], ref, atol=1e-4), np.abs(out[0] - ref).max()
    c.store.drop_sequence("floors")
print(google.protobuf.__version__, grpc.__version__)
"""


def _floors() -> dict[str, str]:
    """The package's least grpcio, grpcio-health-checking and protobuf (pyproject.toml)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    deps = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for d in deps:
        name, _, rest = d.partition(">=")
        if name in ("grpcio", "grpcio-health-checking", "protobuf"):
            floors[name] = rest.split(",")[0]
    assert set(floors) == {"grpcio", "grpcio-health-checking", "protobuf"}, deps
    return floors


@pytest.mark.parametrize("runtimes", ["floors", "newest"])
def test_the_client_works_at_its_dependency_floors_and_the_newest(
    runtimes: str, tmp_path: Path, server: "kvsparse.LocalServer"
) -> None:
    """The stubs' gencode (grpcio-tools pinned in pyproject.toml) runs on the oldest grpcio and
    protobuf the package accepts and on the newest PyPI serves: a real round trip on each."""
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(PACKAGE))
    wheel = next((tmp_path / "dist").glob("kvsparse-*.whl"))
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv))
    pins = [f"{n}=={v}" for n, v in _floors().items()] if runtimes == "floors" else []
    _run(str(venv / "bin" / "pip"), "install", "-q", str(wheel), *pins)
    out = _run(str(venv / "bin" / "python"), "-W", "error::UserWarning", "-c", _SMOKE, server.target).split()
    if runtimes == "floors":
        assert out == [_floors()["protobuf"], _floors()["grpcio"]], out
