"""llama.cpp's side of `rewind bench decode-scaling`: the same random weights written as an F16 GGUF,
and `llama-batched-bench` on it at the same prompt length, decode steps and stream counts.

Why its own GGUF writer: the random models are mlx-lm folders of a Llama shape with a tiny BPE
tokenizer, which llama.cpp's convert_hf_to_gguf.py refuses (it only takes pre-tokenizers it knows
by hash). The tensor names come from gguf's own map (gguf.get_tensor_name_map), the query and key
rows are permuted as that converter does, and the vocabulary is the tokenizer's, padded to the
model's rows with unused tokens as the converter pads. Llama only: Qwen 3.5's conversion (value
head reorder, gate and norm transforms) is llama.cpp's own and is not redone here.

What llama-batched-bench times (tools/batched-bench): B sequences of PP random tokens prefilled
together, then TG steps that each decode one token per sequence with logits for every row and no
sampling; S_TG is B x TG over that time. Rewind's rows time sampling and streaming too.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

LLAMA_ARCH = "llama"


def _permute_rope_rows(weights: Any, heads: int) -> Any:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotary halves -> GGML's interleaved pairs."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_f16_gguf(folder: Path, out: Path) -> Path:
    """The model folder's weights as llama.cpp's F16 GGUF (norms kept in float32, as its converter
    keeps them). Written once: an existing file is reused."""
    import gguf
    import mlx.core as mx
    import numpy as np

    weights_file = folder / "model.safetensors"
    if out.exists() and out.stat().st_mtime >= weights_file.stat().st_mtime:
        return out  # written from these weights (a rebuilt folder writes it again)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != LLAMA_ARCH:
        raise ValueError(f"llama.cpp's GGUF is written for Llama shapes only, not "
                         f"{config.get('model_type')!r}")
    layers, heads, kv_heads = (config["num_hidden_layers"], config["num_attention_heads"],
                               config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    vocab_size = config["vocab_size"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), LLAMA_ARCH)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    by_id = {index: token for token, index in tokenizer["model"]["vocab"].items()}
    specials = {token["id"]: token["content"] for token in tokenizer.get("added_tokens", [])}
    by_id.update(specials)
    tokens: list[str] = []
    types: list[int] = []
    for index in range(vocab_size):  # by id, unknown ids padded, as the converter does
        if index in by_id:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.CONTROL if index in specials else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    # GPT-2's split, the one the tiny tokenizer's byte-level pre-tokenizer makes (llama.cpp's
    # "default" splits punctuation and digits apart first): the same text, the same tokens.
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in tokenizer["model"].get("merges", [])])
    eos = config.get("eos_token_id")
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(config["bos_token_id"])
    if eos is not None:
        writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)

    weights = mx.load(str(weights_file))  # random models are one file (build_tiny_model)
    for name, value in weights.items():
        array = np.array(value.astype(mx.float32))
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            array = _permute_rope_rows(array, heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            array = _permute_rope_rows(array, kv_heads)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"no GGUF name for {name}")
        writer.add_tensor(target, array.astype(np.float16) if array.ndim == 2 else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    partial.rename(out)
    return out


def batched_bench_argv(binary: Path, gguf: Path, prompt_tokens: int, decode_tokens: int,
                       streams: list[int]) -> list[str]:
    """llama-batched-bench as its README runs it on a GPU: every layer offloaded, flash attention
    left at its default (auto: on for CUDA), one sequence per stream with its own prompt."""
    context = max(streams) * (prompt_tokens + decode_tokens) + 256
    return [str(binary), "-m", str(gguf), "-c", str(context), "-ngl", "99",
            "-npp", str(prompt_tokens), "-ntg", str(decode_tokens),
            "-npl", ",".join(str(n) for n in streams), "--output-format", "jsonl"]


def parse_batched_bench(output: str) -> dict[int, dict[str, Any]]:
    """Its jsonl rows by stream count (B): decode tokens/s of all streams (S_TG) and the rest."""
    rows: dict[int, dict[str, Any]] = {}
    for line in output.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        row = json.loads(line)
        rows[int(row["pl"])] = {"tok_s": round(float(row["speed_tg"]), 1),
                                "decode_s": round(float(row["t_tg"]), 4),
                                "prefill_tok_s": round(float(row["speed_pp"]), 1),
                                "mean_context": int(row["pp"]) + int(row["tg"]) / 2,
                                "flash_attn": row.get("flash_attn")}
    return rows


def llama_cpp_version(bin_dir: Path) -> str:
    """`llama-batched-bench --version`'s build line (llama.cpp prints it to stderr)."""
    try:
        done = subprocess.run([str(bin_dir / "llama-batched-bench"), "--version"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})"
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "version" in line]
    return lines[0].strip() if lines else "unknown"


def run_llama_cpp(folder: Path, bin_dir: Path, work_dir: Path, prompt_tokens: int,
                  decode_tokens: int, streams: list[int], timeout: float = 600) -> dict[str, Any]:
    """The F16 GGUF written (once), then llama-batched-bench over every stream count in one
    process: {"rows": {B: {...}}, "command": ..., "version": ...} or {"error": ...}."""
    gguf = write_f16_gguf(folder, work_dir / f"{folder.name}-f16.gguf")
    argv = batched_bench_argv(bin_dir / "llama-batched-bench", gguf, prompt_tokens,
                              decode_tokens, streams)
    result: dict[str, Any] = {"command": " ".join(argv), "version": llama_cpp_version(bin_dir),
                              "gguf_bytes": gguf.stat().st_size}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**result, "error": f"timed out after {timeout:.0f} s"}
    rows = parse_batched_bench(done.stdout + "\n" + done.stderr)
    if done.returncode != 0 or not rows:
        tail = (done.stdout + done.stderr)[-3000:]
        return {**result, "error": f"exit status {done.returncode}, {len(rows)} rows",
                "log_tail": tail}
    return {**result, "rows": rows}
