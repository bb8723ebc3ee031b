"""`rewind bench agentic --random-model`: random weights of a real shape served by Rewind and by
llama-server (issue 27, a GPU machine with no weights to fetch), and llama.cpp's CUDA build found
in its prefix.

The tiny shape is built in seconds here; the runs against llama-server skip where it is not built
and smoke-run (bash scripts/install-llama-cpp.sh; never in CI).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rewind.bench import servers
from rewind.bench.agentic import request_extras, short_turns
from rewind.bench.decode_scaling_models import build_served_model
from rewind.bench.servers import (LLAMA_CPP_PREFIX, LLAMA_SERVER, ModelFiles, ServerOptions,
                                  llama_server_argv)
from rewind.bench.textgen import AgenticText
from rewind.testing.tiny_models import CHAT_TEMPLATE, EOS, TURN_END, VOCAB_SIZE

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_served_model("llama-tiny", tmp_path_factory.mktemp("random"))


def test_the_folder_has_a_template_a_token_for_every_id_and_a_gguf(served: Path) -> None:
    from tokenizers import Tokenizer

    config = json.loads((served / "config.json").read_text())
    assert json.loads((served / "tokenizer_config.json").read_text())["chat_template"] == \
        CHAT_TEMPLATE
    tokenizer = Tokenizer.from_file(str(served / "tokenizer.json"))
    vocab = config["vocab_size"]
    assert vocab > VOCAB_SIZE and tokenizer.get_vocab_size() == vocab
    assert tokenizer.decode([vocab - 1]) == f" w{vocab - 1}"  # every random pick streams text
    # The padded tokens are never made by encoding: prompts are the trained tokenizer's.
    text = AgenticText(3).system_prompt(300) + " w1000 w4095"
    assert max(tokenizer.encode(text).ids) < VOCAB_SIZE
    assert servers.resolve_model_files(str(served)).gguf == served / "model.gguf"
    assert build_served_model("llama-tiny", served.parent) == served  # built once


def test_the_gguf_tokenizes_as_the_folder_and_holds_its_weights(served: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(served / "model.gguf")
    config = json.loads((served / "config.json").read_text())
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == config["vocab_size"]
    assert bytes(tokens.parts[tokens.data[1000]]).decode() == "\u0120w1000"
    pre = reader.fields["tokenizer.ggml.pre"]
    assert bytes(pre.parts[pre.data[0]]).decode() == "gpt-2"  # the tokenizer's own split
    eos = reader.fields["tokenizer.ggml.eos_token_id"]
    assert int(eos.parts[eos.data[0]][0]) == config["eos_token_id"][0]
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    assert matrices and all(t.tensor_type == gguf.GGMLQuantizationType.F16 for t in matrices)


def test_random_weights_ban_the_end_of_sequence_ids_on_every_server(served: Path) -> None:
    args = argparse.Namespace(random_model="llama-tiny")
    model = ModelFiles("random", served, served / "model.gguf")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(served / "tokenizer.json"))
    banned = {str(tokenizer.token_to_id(TURN_END)): -100.0, str(tokenizer.token_to_id(EOS)): -100.0}
    assert request_extras(args, model, "rewind") == {"logit_bias": banned}
    assert request_extras(args, model, "llama.cpp") == {"logit_bias": banned, "ignore_eos": True}
    assert request_extras(argparse.Namespace(random_model=None), model, "rewind") is None


def test_turns_short_of_max_tokens_are_named() -> None:
    rows = [{"server": "a", "completion_tokens": 8, "finish_reason": "length"},
            {"server": "b", "completion_tokens": 3, "finish_reason": "stop"},
            {"server": "b", "completion_tokens": 5, "idle": True, "finish_reason": "stop"}]
    assert short_turns(rows, 8) == ["b: 1 turns generated other than 8 tokens (finish reasons "
                                    "['stop'], completion tokens [3])"]


# --- llama.cpp's CUDA build ------------------------------------------------------------------------
def fake_binaries(prefix: Path, names: tuple[str, ...]) -> None:
    (prefix / "bin").mkdir(parents=True)
    for name in names:
        (prefix / "bin" / name).write_text("#!/bin/sh\n")
        (prefix / "bin" / name).chmod(0o755)


def test_a_cuda_build_counts_as_built_for_llama_server_alone(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(servers, "LLAMA_CPP_PREFIX", tmp_path)
    fake_binaries(tmp_path, ("llama-server", "llama-batched-bench"))
    assert not servers.llama_cpp_installed(LLAMA_SERVER)  # no VERSION: not finished
    # What scripts/llama-cpp-cuda.sh writes once its binaries are copied in.
    (tmp_path / "VERSION").write_text(
        "llama_cpp_python-0.3.36\nversion: 8 (abc)\nbuilt with GNU 13.3.0 for Linux x86_64\n"
        "CUDA architectures: 90; built in 301 s with 16 jobs\n")
    assert servers.llama_cpp_is_cuda()
    assert servers.llama_cpp_installed(LLAMA_SERVER)
    assert not servers.llama_cpp_installed()  # llama-bench is not part of it
    assert not servers.llama_cpp_installed(("llama-perplexity",))
    assert servers.llama_cpp_version() == (
        "llama_cpp_python-0.3.36, version: 8 (abc), built with GNU 13.3.0 for Linux x86_64, "
        "CUDA architectures: 90; built in 301 s with 16 jobs")
    assert "on the F16 GGUF" in servers.describe_server("llama.cpp", "the F16 GGUF")


def test_a_cpu_build_still_needs_its_smoke_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(servers, "LLAMA_CPP_PREFIX", tmp_path)
    fake_binaries(tmp_path, servers.LLAMA_CPP_BINARIES)
    (tmp_path / "VERSION").write_text("llama_cpp_python-0.3.36\nversion: 8 (abc)\n")
    assert not servers.llama_cpp_is_cuda()
    assert not servers.llama_cpp_installed(LLAMA_SERVER)  # no BUILD_FLAGS: never smoke-run
    (tmp_path / "BUILD_FLAGS").write_text("flags: -DGGML_NATIVE=ON\nsmoke: passed\n")
    assert servers.llama_cpp_installed(LLAMA_SERVER) and servers.llama_cpp_installed()


def vendored_llama_cpp() -> Path | None:
    found = sorted(LLAMA_CPP_PREFIX.glob("src/sdist/*/vendor/llama.cpp/common/common.h"))
    return found[-1].parents[1] if found else None


@pytest.mark.skipif(vendored_llama_cpp() is None,
                    reason="no vendored llama.cpp tree (bash scripts/install-llama-cpp.sh)")
def test_llama_server_offloads_every_layer_by_default_so_it_gets_no_ngl(tmp_path) -> None:
    """llama_server_argv gives a CUDA build no -ngl: this llama.cpp's default offloads every
    layer. A llama.cpp bump that changes that default fails here."""
    source = vendored_llama_cpp()
    assert source is not None
    common = (source / "common" / "common.h").read_text()
    assert "int32_t n_gpu_layers       = -1;" in common
    model = (source / "src" / "llama-model.cpp").read_text()
    assert ("return params.n_gpu_layers >= 0 ? params.n_gpu_layers : hparams.n_layer_all + 1;"
            in model)
    argv = llama_server_argv(tmp_path / "m.gguf", tmp_path / "t.jinja", ServerOptions(), 8080)
    assert not {"-ngl", "--gpu-layers", "--n-gpu-layers"} & set(argv)


# --- end to end ---------------------------------------------------------------------------------
def run_agentic(tmp_path: Path, servers_list: str) -> dict:
    subprocess.run(
        [sys.executable, "-m", "rewind", "bench", "agentic", "--quick", "--random-model",
         "llama-tiny", "--servers", servers_list, "--work-dir", str(tmp_path / "models"),
         "--out", str(tmp_path)], check=True, cwd=REPO_ROOT, timeout=600)
    return json.loads((tmp_path / "agentic-quick.json").read_text())


def every_turn_is_full(payload: dict) -> None:
    max_tokens = payload["params"]["max_tokens"]
    assert payload["records"]
    assert all(r["completion_tokens"] == max_tokens and r["finish_reason"] == "length"
               for r in payload["records"]), payload["notes"]
    assert all(r["token_gaps_s"] for r in payload["records"])  # tokens streamed as text


def test_agentic_on_random_weights_generates_max_tokens_every_turn(tmp_path) -> None:
    every_turn_is_full(run_agentic(tmp_path, "rewind"))


@pytest.mark.skipif(not servers.llama_cpp_installed(LLAMA_SERVER),
                    reason=f"llama-server not built and smoke-run in {LLAMA_CPP_PREFIX} "
                           "(bash scripts/install-llama-cpp.sh; never in CI)")
def test_agentic_on_random_weights_side_by_side_with_llama_server(tmp_path) -> None:
    payload = run_agentic(tmp_path, "rewind,llama.cpp")
    every_turn_is_full(payload)
    assert {r["server"] for r in payload["records"]} == {"rewind", "llama.cpp"}
    prompts: dict[str, list[int]] = {}
    for record in payload["records"]:
        prompts.setdefault(record["server"], []).append(record["prompt_tokens"])
    # The same template and the same split into tokens: the same prompts on both servers.
    assert prompts["rewind"] == prompts["llama.cpp"]
