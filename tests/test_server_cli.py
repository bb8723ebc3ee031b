"""`rewind serve` as a user runs it: a subprocess on a tiny model, loopback, a free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from serve_subprocess import wait_healthy

from rewind.cli import build_parser
from rewind.commands.serve import server_config


def test_flags_fill_the_config(tmp_path):
    args = build_parser().parse_args([
        "serve", "--model", "m", "--port", "9999", "--parallel", "2", "--max-queue", "3",
        "--api-key", "k", "--cache-ram", "512MiB", "--cache-disk", "2GiB", "--no-disk-cache",
        "--cache-dir", str(tmp_path), "--max-kv-size", "1024", "--max-body", "1MiB",
        "--cpu-weights", "int8"])
    config = server_config(args)
    assert config.cpu_weights == "int8"
    assert (config.model, config.host, config.port, config.api_key) == ("m", "127.0.0.1", 9999, "k")
    assert config.max_body_bytes == 1 << 20
    engine = config.engine
    assert (engine.parallel, engine.max_queue, engine.max_kv_size) == (2, 3, 1024)
    cache = engine.cache
    assert cache.enabled and not cache.disk_enabled and cache.cache_dir == tmp_path
    assert (cache.ram_bytes, cache.disk_bytes) == (512 << 20, 2 << 30)
    assert not server_config(build_parser().parse_args(["serve", "--no-prompt-cache"])) \
        .engine.cache.enabled


def test_tenant_and_limit_flags_fill_the_config(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-1 one\n")
    config = server_config(build_parser().parse_args([
        "serve", "--api-key-file", str(keys), "--shared-cache", "--cors-origin", "https://a.b",
        "--cors-origin", "https://c.d", "--max-prompt-tokens", "9000", "--max-images", "2",
        "--max-tokens", "512", "--body-timeout", "5"]))
    assert (config.api_key_file, config.shared_cache) == (keys, True)
    assert config.cors_origins == ["https://a.b", "https://c.d"]
    assert (config.max_prompt_tokens, config.max_images, config.max_tokens) == (9000, 2, 512)
    assert config.body_idle_seconds == 5


def test_bad_settings_stop_serve_before_loading_a_model(tmp_path, capsys):
    from rewind.commands.serve import run

    for argv, problem in ((["--api-key-file", str(tmp_path / "none")], "cannot read"),
                          (["--max-tokens", "0"], "max tokens"),
                          (["--port", "70000"], "not a TCP port")):
        assert run(build_parser().parse_args(["serve", *argv])) == 2
        assert problem in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter imports mlx, mlx-lm and transformers
def test_rewind_serve_answers_and_shuts_down(tiny_model_path, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "rewind", "serve", "--model", str(tiny_model_path("gemma3")),
               "--port", str(port), "--parallel", "2", "--api-key", "sk-test",
               "--cache-dir", str(tmp_path), "--log-level", "warning"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, 120)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "temperature": 0}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 401
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                           headers={"authorization": "Bearer sk-test"})
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] > 3
    finally:
        server.send_signal(signal.SIGINT)
        try:
            output, _ = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            output, _ = server.communicate()
    assert server.returncode in (0, 130), output
