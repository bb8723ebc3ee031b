"""Which MLX backend build is installed: read from package metadata laid out as pip writes it
(dist-info folders with RECORD files), for this environment and for the broken layouts two
backends leave."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from rewind import mlx_install

LIBRARY = "mlx/lib/libmlx.so"


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def install_package(site: Path, name: str, version: str, library: bytes | None) -> None:
    """A dist-info folder as pip leaves it; with `library`, its RECORD lists libmlx and the file
    is written (overwriting what another package wrote there, as pip does)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    records = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    if library is not None:
        records.append(f"{LIBRARY},sha256={_record_hash(library)},{len(library)}")
        (site / LIBRARY).parent.mkdir(parents=True, exist_ok=True)
        (site / LIBRARY).write_bytes(library)
    (info / "RECORD").write_text("\n".join(records) + "\n")


CPU_BUILD = b"cpu build of libmlx" * 10
CUDA_BUILD = b"cuda build of libmlx, larger" * 20


def test_this_environment_has_one_backend_whose_library_is_on_disk() -> None:
    install = mlx_install.inspect()
    assert install.problem is None, install.problem
    assert install.library_owner is not None
    assert len(install.packages) == 1
    import mlx.core as mx

    loaded = "cuda" if mx.cuda.is_available() else "metal" if mx.metal.is_available() else "cpu"
    assert install.backend == loaded
    assert install.backend in install.describe()


def test_one_backend_is_healthy(tmp_path: Path) -> None:
    install_package(tmp_path, "mlx-cuda-13", "0.32.4", CUDA_BUILD)
    install = mlx_install.inspect([str(tmp_path)], platform="linux")
    assert install.problem is None
    assert install.backend == "cuda"
    assert install.describe() == "MLX backend: cuda (mlx-cuda-13 0.32.4)"


def test_no_backend_on_linux_names_the_extras(tmp_path: Path) -> None:
    install = mlx_install.inspect([str(tmp_path)], platform="linux")
    assert install.backend is None
    assert install.problem is not None
    assert "rewind-engine[cpu]" in install.problem and "rewind-engine[cuda]" in install.problem
    assert mlx_install.inspect([str(tmp_path)], platform="darwin").problem is None


def test_cpu_unpacked_after_cuda_is_found_and_the_fix_keeps_cuda(tmp_path: Path) -> None:
    install_package(tmp_path, "mlx-cuda-13", "0.32.4", CUDA_BUILD)
    install_package(tmp_path, "mlx-cpu", "0.32.4", CPU_BUILD)  # overwrites libmlx
    install = mlx_install.inspect([str(tmp_path)], platform="linux")
    assert install.library_owner is not None and install.library_owner.name == "mlx-cpu"
    assert install.backend == "cpu"
    assert install.problem is not None
    assert "runs on the cpu, not the cuda GPU" in install.problem
    assert ("pip uninstall -y mlx-cpu && pip install --force-reinstall --no-deps "
            "'mlx-cuda-13==0.32.4'") in install.problem


def test_cuda_unpacked_last_still_warns_that_both_are_installed(tmp_path: Path) -> None:
    install_package(tmp_path, "mlx-cpu", "0.32.4", CPU_BUILD)
    install_package(tmp_path, "mlx-cuda-13", "0.32.4", CUDA_BUILD)
    install = mlx_install.inspect([str(tmp_path)], platform="linux")
    assert install.backend == "cuda"
    assert install.problem is not None and "pip uninstall -y mlx-cpu" in install.problem


@pytest.mark.parametrize("damage", ["removed", "same size, other bytes"])
def test_a_library_no_package_wrote_belongs_to_none(tmp_path: Path, damage: str) -> None:
    install_package(tmp_path, "mlx-cuda-13", "0.32.4", CUDA_BUILD)
    install_package(tmp_path, "mlx-cpu", "0.32.4", CPU_BUILD)
    if damage == "removed":  # what `pip uninstall mlx-cpu` leaves: it deletes the shared file
        (tmp_path / LIBRARY).unlink()
    else:
        (tmp_path / LIBRARY).write_bytes(b"x" * len(CPU_BUILD))
    install = mlx_install.inspect([str(tmp_path)], platform="linux")
    assert install.library_owner is None
    assert install.problem is not None and "missing or belongs to no installed" in install.problem
    assert "--force-reinstall --no-deps 'mlx-cuda-13==0.32.4'" in install.problem


def test_the_module_reports_and_exits_zero_here() -> None:
    done = subprocess.run([sys.executable, "-m", "rewind.mlx_install"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("MLX backend: ")


def test_rewind_keeps_mlx_kernels_in_its_cache_folder_unless_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata
    import os

    import mlx.core  # noqa: F401  (loaded: cli.main does not re-exec this process for OpenBLAS)

    from rewind import cli

    monkeypatch.setenv("REWIND_HOME", str(tmp_path))
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert "MLX backend: " in capsys.readouterr().out
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(
        tmp_path / "mlx" / importlib.metadata.version("mlx") / "ptx")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "mine")
