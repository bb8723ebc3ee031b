"""rewind bench decode-scaling: the all-decoding window, the bound's arithmetic, and one --quick
run of the in-process parts (engine, mlx-lm) on a tiny model. No speed is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rewind.bench import decode_scaling
from rewind.bench.decode_scaling_bound import StreamBytes, hbm_bytes_per_s
from rewind.bench.decode_scaling_window import all_decoding_window, stagger_tokens


def test_window_spans_from_the_last_first_token_to_the_first_last_token() -> None:
    stamps = [[1.0, 2.0, 3.0, 4.0], [2.5, 3.5, 4.5, 5.5]]
    window = all_decoding_window(stamps, prompt_tokens=100)
    assert window.seconds == 4.0 - 2.5
    assert window.tokens == 3  # 3.0 and 4.0 of the first stream, 3.5 of the second
    assert window.tok_s == 2.0


def test_bound_reads_weights_once_and_each_rows_state() -> None:
    sizes = StreamBytes(weight_bytes=4_800_000, kv_bytes_per_token=100, fixed_state_bytes=0)
    assert sizes.step_bytes(2, 1000) == 4_800_000 + 2 * 100 * 1000
    assert round(sizes.bound_tok_s(1, 0)) == 1_000_000  # 1 ms a step at 4.8 TB/s


def test_the_bound_takes_the_cards_own_bandwidth() -> None:
    sizes = StreamBytes(weight_bytes=3_350_000, kv_bytes_per_token=0, fixed_state_bytes=0)
    h100 = hbm_bytes_per_s("NVIDIA H100 80GB HBM3")
    assert round(sizes.bound_tok_s(1, 0, h100)) == 1_000_000  # 1 ms a step at 3.35 TB/s
    assert hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert hbm_bytes_per_s("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_bytes_per_s(None) == 4.8e12  # no NVIDIA card: the report names none
    assert hbm_bytes_per_s("NVIDIA A100-SXM4-80GB") == 4.8e12  # not listed: the report says so


def test_stagger_covers_one_chunk_per_step() -> None:
    assert stagger_tokens(32, 1024, 256) == 32 * 4 + 8


def _quick_run(tmp_path: Path, *parts: str) -> dict:
    """`rewind bench decode-scaling --quick` on the tiny Llama with these parts: its report."""
    parser = argparse.ArgumentParser()
    decode_scaling.register(parser)
    args = parser.parse_args(["--quick", "--models", "llama-tiny", "--parts", *parts,
                              "--json", str(tmp_path / "out.json"),
                              "--work-dir", str(tmp_path / "models")])
    assert decode_scaling.run(args) == 0
    return json.loads((tmp_path / "out.json").read_text())


def test_quick_run_writes_rows(tmp_path: Path) -> None:
    report = _quick_run(tmp_path, "engine", "mlx-lm")
    rows = report["models"]["llama-tiny"]["rows"]
    assert set(rows) == {"1", "3"}
    for parts in rows.values():
        assert parts["engine"]["tok_s"] > 0 and parts["mlx-lm"]["tok_s"] > 0
        assert parts["engine"]["finish_reasons"] == {"length": int(next(
            k for k, v in rows.items() if v is parts))}
        assert parts["engine"]["per_step"]["steps"] > 0
        # The three calls of a step, timed through the engine's step listener.
        per_step = parts["engine"]["per_step"]
        assert per_step["run_ms"] > 0 and per_step["postprocess_ms"] > 0
        assert per_step["schedule_ms"] + per_step["run_ms"] + per_step["postprocess_ms"] \
            == pytest.approx(per_step["step_ms"], abs=0.01)
    assert "| 1 |" in (tmp_path / "out.md").read_text()


def test_reports_name_the_nvidia_card_and_driver_or_none(tmp_path: Path, monkeypatch) -> None:
    """nvidia-smi's answer where there is one (a stand-in script here: this machine has no
    NVIDIA GPU), and None where it is absent."""
    from rewind.bench.machine import machine_info, nvidia_gpu

    monkeypatch.setenv("PATH", str(tmp_path))
    assert nvidia_gpu() is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04'\n")
    smi.chmod(0o755)
    assert nvidia_gpu() == {"name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04"}
    info = machine_info()
    assert info["gpu"]["driver"] == "580.159.04"
    assert info["mlx_backend"] in ("cpu", "cuda", "metal")


# -- llama.cpp's side: the same weights as an F16 GGUF, llama-batched-bench's rows --------------

def test_llama_cpp_gguf_holds_the_same_model(tmp_path: Path) -> None:
    """The GGUF llama-batched-bench runs is the random model itself: converted back by Rewind's
    GGUF importer (which undoes llama.cpp's names and rope permutation), it gives the folder's
    logits up to F16 rounding, and its vocabulary is padded to the model's rows."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load

    from rewind.bench.decode_scaling_llama_cpp import write_f16_gguf
    from rewind.models.conversion import QuantSpec, convert
    from rewind.models.gguf_file import GgufFile
    from rewind.testing.tiny_models import build_tiny_model

    source = build_tiny_model("llama", tmp_path / "source",
                              overrides={"vocab_size": 4096, "tie_word_embeddings": True})
    gguf_path = write_f16_gguf(source, tmp_path / "model-f16.gguf")
    with GgufFile(gguf_path) as gguf:
        tokens = gguf.metadata["tokenizer.ggml.tokens"]
        assert len(tokens) == 4096 and tokens[-1] == "[PAD4095]"
        assert gguf.metadata["general.file_type"] == 1  # MOSTLY_F16
        assert "output.weight" not in gguf.tensors  # tied: llama.cpp reads token_embd as the head
    converted = convert(gguf_path, tmp_path / "converted", QuantSpec(16), show_progress=False)

    prompt = mx.array([[1, 40, 41, 42, 100, 200, 300, 17, 5, 99, 3000, 4000]])

    def logits(folder: Path) -> np.ndarray:
        from mlx.utils import tree_map

        model, _ = load(str(folder))  # computed in float32: only the weights' storage rounds
        model.update(tree_map(lambda v: v.astype(mx.float32), model.parameters()))
        return np.array(model(prompt)[0])

    ours, back = logits(source), logits(converted)
    # measured: 0.85% of the mean logit apart (the weights' F16 and bf16 rounding); without the
    # query/key permutation 57%
    assert np.abs(back - ours).mean() < 0.05 * np.abs(ours).mean()
    config = json.loads((converted / "config.json").read_text())
    assert config["vocab_size"] == 4096


def test_llama_cpp_gguf_refuses_other_shapes(tmp_path: Path) -> None:
    from rewind.bench.decode_scaling_llama_cpp import write_f16_gguf
    from rewind.testing.tiny_models import build_tiny_model

    source = build_tiny_model("qwen3_5", tmp_path / "qwen")
    with pytest.raises(ValueError, match="Llama shapes only"):
        write_f16_gguf(source, tmp_path / "q.gguf")
    assert not (tmp_path / "q.gguf").exists()


def test_batched_bench_rows_by_stream_count() -> None:
    from rewind.bench.decode_scaling_llama_cpp import batched_bench_argv, parse_batched_bench

    # tools/batched-bench/batched-bench.cpp's jsonl line, between its log lines
    line = ('{{"n_kv_max": 37120, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, '
            '"is_pp_shared": 0, "n_gpu_layers": 99, "n_threads": 8, "n_threads_batch": 8, '
            '"pp": 1024, "tg": 128, "pl": {pl}, "n_kv": {kv}, "t_pp": 0.050000, '
            '"speed_pp": {spp}, "t_tg": {ttg}, "speed_tg": {stg}, "t": 0.2, "speed": 1.0}}')
    output = "\n".join(["main: n_kv_max = 37120", line.format(pl=1, kv=1152, spp=20480.0,
                        ttg=0.128, stg=1000.0), "llama_perf_context_print: ...",
                        line.format(pl=32, kv=36864, spp=90000.5, ttg=0.512, stg=8000.25)])
    rows = parse_batched_bench(output)
    assert set(rows) == {1, 32}
    assert rows[1]["tok_s"] == 1000.0 and rows[32]["tok_s"] == 8000.2
    assert rows[32]["mean_context"] == 1024 + 64
    argv = batched_bench_argv(Path("/bin/llama-batched-bench"), Path("m.gguf"), 1024, 128, [1, 8, 32])
    # every stream holds its own prompt and decode steps in the context
    assert argv[argv.index("-c") + 1] == str(32 * (1024 + 128) + 256)
    assert argv[argv.index("-npl") + 1] == "1,8,32"


def test_llama_cpp_part_needs_its_binary(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    decode_scaling.register(parser)
    args = parser.parse_args(["--quick", "--parts", "llama-cpp", "--json", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit, match="llama-batched-bench"):
        decode_scaling.run(args)


def test_the_compiled_part_runs_the_compiled_step(tmp_path: Path, monkeypatch) -> None:
    """--parts compiled times the same engine with REWIND_COMPILED_DECODE=on (on MLX's layers:
    REWIND_NATIVE=off on the CPU), and its steps go through the compiled call."""
    monkeypatch.setenv("REWIND_NATIVE", "off")
    entry = _quick_run(tmp_path, "engine", "compiled")["models"]["llama-tiny"]
    for parts in entry["rows"].values():
        assert parts["compiled"]["tok_s"] > 0 and parts["engine"]["tok_s"] > 0
    assert entry["engine_stats"]["compiled_decode_steps"] > 0
    assert "compiled decode step" in (tmp_path / "out.md").read_text()
