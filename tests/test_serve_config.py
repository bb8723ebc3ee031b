"""`rewind serve --config rewind.toml` and `--print-config`: the file takes the flags' settings,
the command line wins, bad settings are clear errors naming the file, and what --print-config
prints is a file --config reads back to the same settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewind.cli import build_parser
from rewind.commands.serve import apply_config, run, server_config


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def write(folder: Path, text: str) -> Path:
    path = folder / "rewind.toml"
    path.write_text(text)
    return path


def test_the_file_fills_the_settings_and_flags_win(tmp_path):
    (tmp_path / "keys.txt").write_text("sk-1 one\n")
    path = write(tmp_path, """
port = 8080
parallel = 2
cache-ram = "512MiB"
cache_disk = 1073741824
api_key_file = "keys.txt"
cors_origin = "https://a.example"
model = ["first", "second"]
no_disk_cache = true
memory_budget = "70%"
admin_key = "sk-admin"
""")
    args = parse("--config", str(path), "--parallel", "3", "--port", "1234")
    assert apply_config(args) == {"cache_ram", "cache_disk", "api_key_file", "cors_origin",
                                  "model", "no_disk_cache", "memory_budget", "admin_key"}
    config = server_config(args)
    # --port 1234 is the default's value, typed on the command line: it still wins.
    assert (config.port, config.engine.parallel) == (1234, 3)
    assert config.model == "first" and args.model == ["first", "second"]
    assert config.api_key_file == tmp_path / "keys.txt"  # relative to the file, not the cwd
    assert config.cors_origins == ["https://a.example"] and config.admin_key == "sk-admin"
    cache = config.engine.cache
    assert (cache.ram_bytes, cache.disk_bytes, cache.disk_enabled) == (512 << 20, 1 << 30, False)
    assert args.memory_budget == "70%"


@pytest.mark.parametrize("text, problem", [
    ("prot = 80\n", "unknown setting 'prot' (did you mean 'port'?)"),
    ("port = \"eighty\"\n", "port must be a whole number"),
    ("port = 80.5\n", "port must be a whole number"),
    ("no_prompt_cache = \"yes\"\n", "no_prompt_cache must be true or false"),
    ("log_level = \"loud\"\n", "log_level must be one of debug, info, warning, error"),
    ("cpu_weights = [\"int8\"]\n", "cpu_weights must be a single string"),
    ("parallel = 0\n", "parallel must be at least 1"),
    ("max_body = \"lots\"\n", "not a size"),
    ("port = \n", "is not valid TOML"),
])
def test_bad_settings_are_clear_errors(tmp_path, capsys, text, problem):
    path = write(tmp_path, text)
    assert run(parse("--config", str(path))) == 2
    error = capsys.readouterr().err
    assert problem in error, error


def test_a_missing_file_is_an_error(tmp_path, capsys):
    assert run(parse("--config", str(tmp_path / "none.toml"))) == 2
    assert "cannot read --config" in capsys.readouterr().err


def test_print_config_reads_back_and_keeps_secrets(tmp_path, capsys):
    path = write(tmp_path, 'port = 8080\ncache_ram = "1GiB"\napi_key = "sk-secret"\n'
                           'cors_origin = ["https://a.b", "https://c.d"]\n')
    assert run(parse("--config", str(path), "--max-tokens", "99", "--print-config")) == 0
    printed = capsys.readouterr().out
    assert "sk-secret" not in printed and "# api_key: set (config; never printed)" in printed
    assert "port = 8080  # config" in printed and "max_tokens = 99  # flag" in printed
    assert "parallel = 4  # default" in printed
    again = write(tmp_path / "again", printed) if (tmp_path / "again").mkdir() is None else None
    assert run(parse("--config", str(again), "--print-config")) == 0
    reprinted = capsys.readouterr().out
    settings = [line.split("  #")[0] for line in printed.splitlines() if not line.startswith("#")]
    assert settings == [line.split("  #")[0] for line in reprinted.splitlines()
                        if not line.startswith("#")]
