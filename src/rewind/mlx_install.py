"""Which MLX backend build is installed, read from the package metadata without importing MLX
(so it can explain an MLX that does not import).

On Linux MLX's Python bindings (`mlx`) carry no backend: `mlx-cpu` or `mlx-cuda-13` (the
`cpu` and `cuda` extras) each unpack their own mlx/lib/libmlx.so. With both installed, the file on
disk is whichever pip unpacked last, and uninstalling one deletes the other's file: MLX then runs
on the CPU with the CUDA build "installed", or does not import at all. The file's size and hash
against each package's RECORD say whose it is.

    python -m rewind.mlx_install      # prints the report; exit status 1 when something is wrong
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as metadata
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The packages that carry a libmlx, and the backend each one is.
BACKEND_PACKAGES = {"mlx-cpu": "cpu", "mlx-cuda-12": "cuda", "mlx-cuda-13": "cuda",
                    "mlx-metal": "metal"}
LIBRARY_NAMES = ("mlx/lib/libmlx.so", "mlx/lib/libmlx.dylib")


@dataclass(frozen=True)
class BackendPackage:
    name: str
    version: str
    backend: str
    library: Path | None  # where its RECORD puts libmlx
    size: int | None
    sha256: str | None  # urlsafe base64, as RECORD writes it


@dataclass(frozen=True)
class MlxInstall:
    packages: tuple[BackendPackage, ...]
    library_owner: BackendPackage | None  # the package whose libmlx is the file on disk
    problem: str | None  # what is wrong and the command that fixes it; None when all is well

    @property
    def backend(self) -> str | None:
        return self.library_owner.backend if self.library_owner else None

    def describe(self) -> str:
        if self.library_owner is None:
            return "no MLX backend"
        owner = self.library_owner
        return f"MLX backend: {owner.backend} ({owner.name} {owner.version})"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-")


def _library_entry(dist: metadata.Distribution) -> tuple[str, int | None, str | None] | None:
    """libmlx's row of the package's RECORD: (path, size, sha256). Read from RECORD itself, not
    `dist.files`: from Python 3.12 that leaves out files missing on disk, and a library another
    package's uninstall deleted is the case this module is for."""
    for row in csv.reader((dist.read_text("RECORD") or "").splitlines()):
        if row and row[0] in LIBRARY_NAMES:
            digest = row[1] if len(row) > 1 else ""
            size = row[2] if len(row) > 2 else ""
            return (row[0], int(size) if size.isdigit() else None,
                    digest.split("=", 1)[1] if digest.startswith("sha256=") else None)
    return None


def _backend_packages(paths: Iterable[str] | None) -> list[BackendPackage]:
    found: dict[str, BackendPackage] = {}
    for dist in metadata.distributions(**({"path": list(paths)} if paths is not None else {})):
        name = _canonical(dist.metadata["Name"] or "")
        if name not in BACKEND_PACKAGES or name in found:  # the first on the path wins, as imports do
            continue
        entry = _library_entry(dist)
        found[name] = BackendPackage(
            name=name, version=dist.version, backend=BACKEND_PACKAGES[name],
            library=Path(str(dist.locate_file(entry[0]))) if entry is not None else None,
            size=entry[1] if entry is not None else None,
            sha256=entry[2] if entry is not None else None)
    return sorted(found.values(), key=lambda p: p.name)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def _owner(packages: list[BackendPackage]) -> BackendPackage | None:
    """The package whose RECORD matches the libmlx on disk: by size, then by hash where more
    than one backend is installed (hashing a CUDA build's library takes a few tenths of a
    second: not on every start of a healthy install)."""
    candidates = [p for p in packages if p.library is not None and p.library.is_file()
                  and p.library.stat().st_size == p.size]
    if len(packages) == 1:
        return candidates[0] if candidates else None
    for package in candidates:
        if package.sha256 is None or _sha256(package.library) == package.sha256:  # type: ignore[arg-type]
            return package
    return None


def _reinstall(package: BackendPackage, others: list[BackendPackage]) -> str:
    drop = " ".join(p.name for p in others)
    return (f"pip uninstall -y {drop} && pip install --force-reinstall --no-deps "
            f"'{package.name}=={package.version}'")


def inspect(paths: Iterable[str] | None = None, platform: str = sys.platform) -> MlxInstall:
    """The installed backend packages (on `paths`, default sys.path), whose libmlx is on disk,
    and what is wrong, if anything."""
    packages = _backend_packages(paths)
    owner = _owner(packages)
    problem = None
    if not packages:
        if platform.startswith("linux"):
            problem = ("MLX has no backend installed (on Linux the `mlx` package is only its Python "
                       "bindings): pip install 'rewind-engine[cpu]', or 'rewind-engine[cuda]' on "
                       "an NVIDIA GPU")
    elif owner is None and any(p.library is not None for p in packages):
        wanted = next((p for p in packages if p.backend == "cuda"), packages[0])
        problem = (f"MLX's library mlx/lib/libmlx.so is missing or belongs to no installed "
                   f"backend package (two backends were installed and one removed?): "
                   f"{_reinstall(wanted, [p for p in packages if p is not wanted])}")
    elif len(packages) > 1:
        others = [p for p in packages if p is not owner]
        gpu = next((p for p in others if p.backend in ("cuda", "metal")), None)
        names = " and ".join(p.name for p in packages)
        if gpu is not None:
            problem = (f"{names} are both installed and write the same mlx/lib/libmlx.so; "
                       f"{owner.name}'s is the one on disk, so MLX runs on the {owner.backend}, "
                       f"not the {gpu.backend} GPU. Keep one: {_reinstall(gpu, [owner])}")
        else:
            problem = (f"{names} are both installed and write the same mlx/lib/libmlx.so "
                       f"({owner.name}'s is on disk): uninstall the others "
                       f"(pip uninstall -y {' '.join(p.name for p in others)})")
    return MlxInstall(packages=tuple(packages), library_owner=owner, problem=problem)


def main() -> int:
    install = inspect()
    print(install.describe())
    for package in install.packages:
        mark = " (on disk)" if package is install.library_owner else ""
        print(f"  {package.name} {package.version}: {package.backend}{mark}")
    if install.problem:
        print(f"problem: {install.problem}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
