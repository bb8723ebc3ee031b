"""Every REWIND_* variable is read through rewind.env, a bad value is a clear error naming the
variable and what it takes, and every config is validated when it is built."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rewind import env
from rewind.config import CacheConfig, EngineConfig, ServerConfig

SRC = Path(env.__file__).parent


def test_no_module_but_env_reads_a_rewind_variable() -> None:
    """grep: os.environ / getenv next to a REWIND_ name, or a REWIND_ name in quotes, only in
    env.py."""
    pattern = re.compile(r"""["']REWIND_[A-Z0-9_]+["']""")
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "env.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize(("var", "reader", "bad"), [
    (env.NATIVE, env.native_form, "fast"),
    (env.CPU_HEAD, env.cpu_head, "f16"),
    (env.CPU_ATTENTION, env.cpu_attention_off, "0"),
    (env.GATED_DELTA, env.gated_delta_off, "no"),
    (env.FAST_GELU, env.fast_gelu, "off"),
    (env.NO_AVX512, env.no_avx512, "yes"),
    (env.COMPUTE_DTYPE, env.compute_dtype, "fp32"),
    (env.DEFAULT_FORM, env.default_form, "q9x"),
])
def test_bad_value_is_a_clear_error(monkeypatch, var, reader, bad) -> None:
    monkeypatch.setenv(var.name, bad)
    with pytest.raises(env.EnvError, match=re.escape(f"{var.name}={bad!r}")) as caught:
        reader()
    assert isinstance(caught.value, ValueError)
    if var.choices:
        assert ", ".join(var.choices) in str(caught.value)
    with pytest.raises(env.EnvError, match=var.name):
        env.check_all()


def test_values_read_as_before(monkeypatch, tmp_path) -> None:
    for var in env.ALL:
        monkeypatch.delenv(var.name, raising=False)
    assert env.home() is None and env.native_form() is None and env.fast_gelu()
    assert not env.cpu_attention_off() and not env.gated_delta_off() and not env.no_avx512()
    monkeypatch.setenv("REWIND_HOME", "")  # empty counts as unset, as before
    assert env.home() is None
    monkeypatch.setenv("REWIND_HOME", str(tmp_path))
    assert env.home() == tmp_path
    monkeypatch.setenv("REWIND_NATIVE_DECODE", "off")  # the old name still works...
    assert env.native_form() == "off"
    monkeypatch.setenv("REWIND_NATIVE", "int8")  # ...behind the new one
    assert env.native_form() == "int8"
    monkeypatch.setenv("REWIND_FAST_GELU", "0")
    monkeypatch.setenv("REWIND_CPU_ATTENTION", "off")
    monkeypatch.setenv("REWIND_NO_OPENBLAS", "anything")
    assert not env.fast_gelu() and env.cpu_attention_off() and env.no_openblas()
    assert env.check_all() == []
    monkeypatch.setenv("REWIND_NATIVE_FORM", "int8")  # a misspelt name: a warning, not an error
    assert any("REWIND_NATIVE_FORM" in warning for warning in env.check_all())


def test_overridden_restores(monkeypatch) -> None:
    monkeypatch.delenv("REWIND_GATED_DELTA", raising=False)
    monkeypatch.setenv("REWIND_CPU_ATTENTION", "on")
    with env.overridden({env.CPU_ATTENTION: "off", env.GATED_DELTA: "off"}):
        assert env.cpu_attention_off() and env.gated_delta_off()
    assert os.environ["REWIND_CPU_ATTENTION"] == "on" and "REWIND_GATED_DELTA" not in os.environ
    with pytest.raises(env.EnvError):
        with env.overridden({env.GATED_DELTA: "of"}):
            pass


def test_native_forms_match_the_kernels() -> None:
    from rewind.kernels.native_forward import WEIGHT_FORMS

    assert env.NATIVE_FORMS == WEIGHT_FORMS


def test_cli_stops_on_a_bad_value() -> None:
    environment = dict(os.environ, REWIND_COMPUTE_DTYPE="fp32",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(SRC.parent), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "rewind", "--version"], env=environment,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "REWIND_COMPUTE_DTYPE='fp32': expected one of float32, bfloat16, float16" in result.stderr


@pytest.mark.parametrize(("build", "words"), [
    (lambda: CacheConfig(ram_bytes=-1), "RAM budget"),
    (lambda: CacheConfig(disk_bytes=-5), "disk budget"),
    (lambda: CacheConfig(block_tokens=0), "block tokens"),
    (lambda: CacheConfig(writer_queue=0), "writer queue"),
    (lambda: CacheConfig(snapshot_seconds=0), "snapshot interval"),
    (lambda: EngineConfig(parallel=0), "parallel"),
    (lambda: EngineConfig(max_queue=-1), "max queue"),
    (lambda: EngineConfig(prefill_chunk=0), "prefill chunk"),
    (lambda: EngineConfig(max_kv_size=0), "max KV size"),
    (lambda: EngineConfig(kv_bits=7), "KV bits"),
    (lambda: ServerConfig(port=70000), "TCP port"),
    (lambda: ServerConfig(max_tokens=0), "max tokens"),
])
def test_config_is_validated_when_built(build, words) -> None:
    with pytest.raises(ValueError, match=words):
        build()


def test_nested_configs_are_validated_again_by_validate() -> None:
    config = ServerConfig()
    config.engine.cache.ram_bytes = -1  # changed after building: validate() sees it
    with pytest.raises(ValueError, match="RAM budget"):
        config.validate()
