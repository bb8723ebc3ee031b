"""Shared fixtures: tiny random-weight models, built once per test session.

The suite compares answers at float32 tolerances on every backend: on a GPU the models compute
in float32 (REWIND_COMPUTE_DTYPE) with full-precision matmuls (MLX_ENABLE_TF32=0: MLX's CUDA
backend otherwise runs float32 matmuls as TF32, ~3e-4 relative error). Both are set before MLX
is imported, and child processes inherit them. Tests of the CPU kernels are marked `cpu_only`.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")
os.environ.setdefault("REWIND_COMPUTE_DTYPE", "float32")

from collections.abc import Callable  # noqa: E402
from pathlib import Path

import pytest  # noqa: E402

from rewind.testing.tiny_models import FAMILIES, build_tiny_model  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--on-demand", action="store_true",
                     help="also run the tests marked on_demand (long ones CI leaves out)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`cpu_only` tests (the C kernels, the CPU loader path) skip on another backend;
    `on_demand` ones (long, and covered in small by others) unless --on-demand."""
    import mlx.core as mx

    if not config.getoption("--on-demand"):
        later = pytest.mark.skip(reason="on demand: pytest --on-demand")
        for item in items:
            # A module's ON_DEMAND_CASES names cases of a parametrized test (test[id]): where
            # the parameters come from fixtures, a mark cannot be put on one combination.
            cases = getattr(getattr(item, "module", None), "ON_DEMAND_CASES", frozenset())
            if "on_demand" in item.keywords or item.name in cases:
                item.add_marker(later)
    if mx.default_device() == mx.cpu:
        return
    skip = pytest.mark.skip(reason="tests the CPU backend's path")
    for item in items:
        if "cpu_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_model_path("gemma3") -> the folder of that family's tiny model (built on first use)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_path: Callable[[str], Path]):
    """tiny_loaded("qwen3_5") -> rewind.models.loader.LoadedModel of that tiny model (cached)."""
    from rewind.models.loader import load_model

    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = load_model(str(tiny_model_path(family)))
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def bf16_loaded(tmp_path_factory: pytest.TempPathFactory):
    """bf16_loaded("qwen3_5") -> that tiny family with bf16 weights, as real checkpoints are
    (on the CPU, MLX's layers then read them in Rewind's C matrix kernel), loaded (cached)."""
    from rewind.models.loader import load_model

    loaded = {}

    def get(family: str):
        if family not in loaded:
            folder = tmp_path_factory.mktemp(f"tiny-{family}-bf16")
            loaded[family] = load_model(str(build_tiny_model(family, folder,
                                                             dtype="bfloat16")))
        return loaded[family]

    return get


@pytest.fixture(params=FAMILIES)
def tiny_family(request: pytest.FixtureRequest) -> str:
    """Parametrizes a test over every tiny model family."""
    return request.param
