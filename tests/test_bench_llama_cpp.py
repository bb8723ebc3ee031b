"""The llama.cpp baseline of the side-by-side bench: llama-server and llama-bench, built from
source by scripts/install-llama-cpp.sh, started with the options a user would give them.

The command lines, the chat template file and what the reports say of the build are checked
everywhere. The tests that run the binaries skip when they are not built and smoke-run (CI never
builds them: about 12 minutes on 2 cores); where they are, they run them on the default model's
GGUF (converted on first use).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rewind.bench import servers
from rewind.bench.machine import command_line, display_path, repo_root, user_command
from rewind.bench.servers import (LLAMA_CPP_PREFIX, ServerOptions, chat_template_file,
                                  llama_cpp_installed, llama_server_argv)

REPO_ROOT = Path(__file__).resolve().parents[1]
needs_llama_cpp = pytest.mark.skipif(
    not llama_cpp_installed(),
    reason=f"llama-server/llama-bench not built and smoke-run in {LLAMA_CPP_PREFIX} "
           "(bash scripts/install-llama-cpp.sh; never in CI)")


# --- commands as a user types them ---------------------------------------------------------------
def test_paths_are_shown_relative_to_the_repository_or_home() -> None:
    assert display_path(repo_root() / "benchmarks" / "results") == "benchmarks/results"
    assert display_path(repo_root()) == "."
    assert display_path(Path.home() / ".cache" / "rewind" / "x.gguf") == "~/.cache/rewind/x.gguf"
    assert display_path("/definitely/elsewhere") == "/definitely/elsewhere"


def test_a_python_module_command_reads_as_its_console_script() -> None:
    argv = [sys.executable, "-m", "rewind", "serve", "--model",
            str(Path.home() / ".cache/rewind/models/default-bf16"), "--port", "8080",
            f"--out={repo_root() / 'benchmarks/results'}"]
    assert user_command(argv) == ("rewind serve --model ~/.cache/rewind/models/default-bf16 "
                                  "--port 8080 --out=benchmarks/results")


def test_the_bench_records_its_own_command_without_absolute_paths(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/x/rewind/__main__.py", "bench", "agentic", "--out",
                                      str(repo_root() / "benchmarks" / "results")])
    assert command_line() == "rewind bench agentic --out benchmarks/results"


def test_llama_server_gets_every_slot_its_context_and_the_models_template(tmp_path) -> None:
    argv = llama_server_argv(tmp_path / "model.gguf", tmp_path / "template.jinja",
                             ServerOptions(parallel=3, context=16384), port=8081)
    assert argv[0] == str(LLAMA_CPP_PREFIX / "bin" / "llama-server")
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert flags["-np"] == "3"
    assert flags["-c"] == str(3 * 16384)  # llama-server splits -c evenly across its slots
    assert "--jinja" in argv and argv[argv.index("--chat-template-file") + 1].endswith(
        "template.jinja")
    # Nothing else: llama.cpp's defaults (threads, batch, --cache-ram, checkpoints) stay as they are.
    assert not {"-t", "--threads", "-b", "-ub", "--cache-ram", "--ctx-checkpoints"} & set(argv)


def test_the_chat_template_file_is_the_mlx_folders(tiny_model_path, monkeypatch,
                                                   tmp_path) -> None:
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    folder = tiny_model_path("gemma3")
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    written = chat_template_file(folder)
    assert written.read_text() == template
    assert chat_template_file(folder) == written  # reused, not rewritten


# --- what the reports say of the build -----------------------------------------------------------
def test_binaries_count_as_built_only_once_they_passed_the_smoke_run(tmp_path,
                                                                      monkeypatch) -> None:
    monkeypatch.setattr(servers, "LLAMA_CPP_PREFIX", tmp_path)
    (tmp_path / "bin").mkdir()
    for name in ("llama-server", "llama-bench"):
        (tmp_path / "bin" / name).write_text("#!/bin/sh\n")
        (tmp_path / "bin" / name).chmod(0o755)
    (tmp_path / "VERSION").write_text("llama_cpp_python-0.3.36\nversion: 1 (abc)\n")
    assert not servers.llama_cpp_installed()  # built, never smoke-run: no BUILD_FLAGS
    assert servers.llama_cpp_version() == "llama_cpp_python-0.3.36, version: 1 (abc)"
    (tmp_path / "BUILD_FLAGS").write_text(
        "flags: -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF\n"
        "why: the GGML_NATIVE=ON build died at its smoke run: `llama-server --version` died "
        "with signal 11 (SIGSEGV)\ncpu: Test CPU\nsmoke: passed: llama-server --version\n")
    assert servers.llama_cpp_installed()
    named = ("llama_cpp_python-0.3.36, version: 1 (abc); built with GGML_NATIVE=OFF, AVX2 "
             "AVX512 on, AMX_TILE off (the GGML_NATIVE=ON build died at its smoke run: "
             "`llama-server --version` died with signal 11 (SIGSEGV))")
    assert servers.llama_cpp_version() == named
    assert f"llama-server ({named})" in servers.describe_server("llama.cpp")


# --- the binaries, where they are built ----------------------------------------------------------
@needs_llama_cpp
@pytest.mark.real_model
def test_llama_server_renders_the_same_prompt_and_reuses_its_prefix(tmp_path) -> None:
    """llama-server sees as many prompt tokens as Rewind's tokenizer makes of the same chat
    (the same template), answers with text, and reports the prefix it reused."""
    from rewind.bench.client import make_client, timed_chat
    from rewind.bench.harness import free_port
    from rewind.bench.servers import build_server, resolve_model_files
    from rewind.models.tokenizer_loading import load_tokenizer

    model = resolve_model_files("default")
    server = build_server("llama.cpp", model, ServerOptions(parallel=2, context=4096),
                          free_port(), tmp_path)
    first = [{"role": "system", "content": "You answer in one short sentence. " * 20},
             {"role": "user", "content": "What is the capital of France?"}]
    with server.start():
        server.wait_ready(timeout=120)
        client = make_client(server.base_url)
        answer = timed_chat(client, first, max_tokens=8, model=server.model_id or "default")
        second = first + [{"role": "assistant", "content": answer.text},
                          {"role": "user", "content": "And of Italy?"}]
        again = timed_chat(client, second, max_tokens=8, model=server.model_id or "default")
    tokenizer = load_tokenizer(model.mlx_folder)
    expected = len(tokenizer.apply_chat_template(first, add_generation_prompt=True))
    assert answer.prompt_tokens == expected
    assert answer.text.strip() and again.text.strip()
    assert again.cached_tokens is not None and again.cached_tokens >= expected // 2


@needs_llama_cpp
@pytest.mark.real_model
def test_llama_bench_gives_the_speed_rows_figures() -> None:
    from rewind.bench.speed import measure_llama_cpp

    row = measure_llama_cpp("default", prompt_count=64, gen_tokens=8, context=32)
    assert row["prefill_tps"] > 0 and row["decode_tps"] > 0
    prefill, decode = row["commands"]
    assert prefill.startswith(".bench-venvs/llama-cpp/bin/llama-bench -m ~/")
    assert "-p 64 -n 0 -d 32" in prefill and "-p 0 -n 8 -d 96" in decode


@needs_llama_cpp
@pytest.mark.real_model
@pytest.mark.slow
def test_parallel_chat_quick_runs_llama_server_at_both_settings(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rewind", "bench", "parallel-chat", "--quick", "--model",
         "default", "--servers", "llama.cpp", "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "parallel-chat-quick.json").read_text())
    assert {r["server"] for r in payload["records"]} == {"llama.cpp@p4", "llama.cpp@p1"}
    assert all(r["text"].strip() for r in payload["records"])
    command = payload["commands"]["llama.cpp@p4"]
    assert command.startswith(".bench-venvs/llama-cpp/bin/llama-server -m ~/")
    assert " -np 4 -c 16384 --jinja --chat-template-file ~/" in command
    assert str(repo_root()) not in json.dumps(payload["commands"])


@needs_llama_cpp
@pytest.mark.real_model
def test_the_installed_binaries_pass_the_smoke_run_on_the_default_gguf() -> None:
    """What the install script checked before it installed them, again: both binaries start,
    llama-bench runs a prefill and a decode, llama-server answers a completion."""
    from rewind.bench.llama_cpp_build import parse_build_flags, smoke
    from rewind.models.registry import default_gguf

    passed, failure = smoke(LLAMA_CPP_PREFIX / "bin", default_gguf())
    assert failure is None, failure.describe()
    assert passed[-1] == "llama-server -m gemma-3-270m-q4_k_m.gguf answered /completion"
    recorded = parse_build_flags((LLAMA_CPP_PREFIX / "BUILD_FLAGS").read_text())
    assert recorded["flags"].startswith("-DGGML_NATIVE=")
    assert recorded["smoke"].startswith("passed: ")
