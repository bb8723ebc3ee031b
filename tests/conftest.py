"""Shared fixtures: tiny random-weight models, built once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from rewind.testing.tiny_models import FAMILIES, build_tiny_model


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


@pytest.fixture(params=FAMILIES)
def tiny_family(request: pytest.FixtureRequest) -> str:
    """Parametrizes a test over every tiny model family."""
    return request.param
