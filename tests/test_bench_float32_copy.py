"""The float32 copy the bench gives mlx-lm on the CPU: the same weights, widened, and the same
tokenizer files as the source, also after the source's were upgraded."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from rewind.bench.servers import float32_copy, has_half_weights
from rewind.models.conversion import QuantSpec, convert


def test_copy_is_float32_and_follows_the_source_tokenizer_files(tiny_model_path, tmp_path,
                                                               monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    source = convert(tiny_model_path("llama"), tmp_path / "bf16", QuantSpec(16),
                     show_progress=False)
    assert has_half_weights(source)
    copy = float32_copy(source)
    assert copy != source and not has_half_weights(copy)
    for name, value in mx.load(str(copy / "model.safetensors")).items():
        stored = mx.load(str(source / "model.safetensors"))[name]
        assert mx.array_equal(value, stored.astype(mx.float32)).item()

    config_path = source / "tokenizer_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"upgraded": True}))
    assert float32_copy(source) == copy
    assert json.loads((copy / "tokenizer_config.json").read_text())["upgraded"] is True
