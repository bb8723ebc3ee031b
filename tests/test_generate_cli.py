"""`rewind generate` and `rewind cache-prompt` on the tiny models.

The whole-CLI checks run `python -m rewind` as a subprocess; the per-family matrix calls the
same command functions in-process (one mlx import instead of one per run) to stay fast.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from rewind.cli import build_parser

LONG_TEXT = "The quick brown fox jumps over the lazy dog while the weather in Berlin turns. " * 6


def cli(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rewind", *argv], input=stdin,
                          capture_output=True, text=True, timeout=120)


def run_in_process(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """Run one rewind command in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    args = build_parser().parse_args(list(argv))
    code = args.func(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def mlx_lm_greedy(loaded, prompt: str, max_tokens: int) -> str:
    """The reference: mlx-lm's own stream_generate on the same tokens."""
    tokens = loaded.tokenizer.encode(prompt)
    return "".join(r.text for r in stream_generate(loaded.model, loaded.tokenizer,
                                                   mx.array(tokens), max_tokens=max_tokens,
                                                   sampler=make_sampler(0.0)))


def test_generate_subprocess_streams_text_and_reports(tiny_model_path):
    out = cli("generate", "--model", str(tiny_model_path("llama")), "--prompt", "Hello there",
              "--max-tokens", "12", "--temp", "0", "--verbose")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "tokens/s" in out.stderr and "Peak memory" in out.stderr and "BLAS:" in out.stderr


@pytest.mark.cpu_only
def test_cpu_weights_int8_computes_with_int8_copies(capsys, tiny_model_path):
    code, text, err = run_in_process(capsys, "generate", "--model", str(tiny_model_path("llama")),
                                     "--prompt", "Hello there", "--max-tokens", "8", "--temp", "0",
                                     "--cpu-weights", "int8", "--verbose")
    assert code == 0 and text.strip()
    assert "Compute: int8 layers (C kernels, float32 math), int8 head (C kernel)" in err
    code, _, err = run_in_process(capsys, "generate", "--model", str(tiny_model_path("llama")),
                                  "--prompt", "Hello there", "--max-tokens", "8", "--verbose")
    assert code == 0 and "Compute: f32 layers (C kernels, float32 math)" in err


def test_greedy_matches_mlx_lm(capsys, tiny_model_path, tiny_loaded, tiny_family):
    prompt = LONG_TEXT + "Then"  # longer than gemma3's 64-token window
    code, text, _ = run_in_process(capsys, "generate", "--model",
                                   str(tiny_model_path(tiny_family)), "--prompt", prompt,
                                   "--max-tokens", "24", "--temp", "0")
    assert code == 0
    assert text == mlx_lm_greedy(tiny_loaded(tiny_family), prompt, 24) + "\n"


def test_prompt_cache_file_gives_the_same_text(capsys, tmp_path, tiny_model_path, tiny_family):
    model = str(tiny_model_path(tiny_family))
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(LONG_TEXT)
    cache_file = tmp_path / "prompt.cache"
    code, _, err = run_in_process(capsys, "cache-prompt", "--model", model, "--prompt-file",
                                  str(prompt_file), "--out", str(cache_file))
    assert code == 0, err
    with_cache = run_in_process(capsys, "generate", "--model", model, "--prompt-cache-file",
                                str(cache_file), "--prompt", "And then", "--max-tokens", "24",
                                "--verbose")
    without = run_in_process(capsys, "generate", "--model", model,
                             "--prompt", LONG_TEXT + "And then", "--max-tokens", "24")
    assert with_cache[0] == 0 and without[0] == 0
    assert with_cache[1] == without[1]
    assert "from cache" in with_cache[2]  # it really started from the file


def test_prompt_cache_file_with_chat_template(capsys, tmp_path, tiny_model_path):
    model = str(tiny_model_path("gemma3"))
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(LONG_TEXT)
    cache_file = tmp_path / "chat.cache"
    assert run_in_process(capsys, "cache-prompt", "--model", model, "--chat", "--prompt-file",
                          str(prompt_file), "--out", str(cache_file))[0] == 0
    with_cache = run_in_process(capsys, "generate", "--model", model, "--chat",
                                "--prompt-cache-file", str(cache_file), "--prompt", " Why?",
                                "--max-tokens", "16", "--verbose")
    without = run_in_process(capsys, "generate", "--model", model, "--chat",
                             "--prompt", LONG_TEXT + " Why?", "--max-tokens", "16")
    assert with_cache[1] == without[1]
    assert "from cache" in with_cache[2]
    # A chat cache used without --chat is refused rather than misread.
    code, _, err = run_in_process(capsys, "generate", "--model", model, "--prompt-cache-file",
                                  str(cache_file), "--prompt", "x")
    assert code == 1 and "--chat" in err


def test_prompt_that_merges_across_the_join_still_matches(capsys, tmp_path, tiny_model_path):
    """The cached text ends mid-word, so the tokenizer merges across the join: the cache must be
    cut back (or dropped), never used as if it were a prefix."""
    model = str(tiny_model_path("qwen3_5"))  # a recurrent state: cannot be trimmed
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(LONG_TEXT + "The weather in Ber")
    cache_file = tmp_path / "join.cache"
    assert run_in_process(capsys, "cache-prompt", "--model", model, "--prompt-file",
                          str(prompt_file), "--out", str(cache_file))[0] == 0
    with_cache = run_in_process(capsys, "generate", "--model", model, "--prompt-cache-file",
                                str(cache_file), "--prompt", "lin is", "--max-tokens", "16")
    without = run_in_process(capsys, "generate", "--model", model, "--prompt",
                             LONG_TEXT + "The weather in Berlin is", "--max-tokens", "16")
    assert with_cache[1] == without[1]
    assert "recomputing" in with_cache[2]


def test_cache_from_another_model_is_refused(capsys, tmp_path, tiny_model_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Hello there")
    cache_file = tmp_path / "llama.cache"
    assert run_in_process(capsys, "cache-prompt", "--model", str(tiny_model_path("llama")),
                          "--prompt-file", str(prompt_file), "--out", str(cache_file))[0] == 0
    code, out, err = run_in_process(capsys, "generate", "--model", str(tiny_model_path("gemma3")),
                                    "--prompt-cache-file", str(cache_file), "--prompt", "x")
    assert code == 1 and out == ""
    assert "another model" in err


@pytest.mark.parametrize("options", [("--kv-bits", "4"), ("--kv-bits", "8"),
                                     ("--max-kv-size", "32"),
                                     ("--temp", "0.8", "--top-p", "0.9", "--top-k", "20",
                                      "--min-p", "0.05", "--seed", "7")])
def test_cache_and_sampling_options_run(capsys, tiny_model_path, options):
    argv = ("generate", "--model", str(tiny_model_path("gemma3")), "--prompt", LONG_TEXT,
            "--max-tokens", "8", *options)
    first = run_in_process(capsys, *argv)
    assert first[0] == 0 and first[1].strip()
    if "--seed" in options:  # a seed makes sampling repeatable
        assert run_in_process(capsys, *argv)[1] == first[1]


def test_kv_bits_quantizes_full_attention_only(tiny_loaded):
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

    from rewind.commands.common import new_cache

    cache = new_cache(tiny_loaded("gemma3").model, None, 4)
    assert {type(c) for c in cache} == {QuantizedKVCache, RotatingKVCache}


def test_unknown_model_is_a_clean_error(capsys, tmp_path):
    code, out, err = run_in_process(capsys, "generate", "--model", str(tmp_path / "nothing-here"),
                                    "--prompt", "hi")
    assert code == 1 and out == ""
    assert "nothing-here" in err and err.startswith("rewind: error:")


def test_bad_cache_file_is_a_clean_error(capsys, tmp_path, tiny_model_path):
    junk = tmp_path / "junk.cache"
    junk.write_bytes(b"not a safetensors file")
    model = str(tiny_model_path("llama"))
    for path in (junk, tmp_path / "missing.cache"):
        code, _, err = run_in_process(capsys, "generate", "--model", model,
                                      "--prompt-cache-file", str(path), "--prompt", "x")
        assert code == 1 and "prompt cache" in err


def test_bad_sampling_values_are_refused(capsys, tiny_model_path):
    code, _, err = run_in_process(capsys, "generate", "--model", str(tiny_model_path("llama")),
                                  "--prompt", "x", "--top-p", "0")
    assert code == 1 and "--top-p" in err


def test_cache_prompt_writes_atomically(capsys, tmp_path, tiny_model_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Hello there")
    out_file = tmp_path / "sub" / "c.bin"
    code, _, _ = run_in_process(capsys, "cache-prompt", "--model", str(tiny_model_path("llama")),
                                "--prompt-file", str(prompt_file), "--out", str(out_file))
    assert code == 0
    assert [p.name for p in Path(out_file.parent).iterdir()] == ["c.bin"]  # no partial left


def test_kv_group_size_that_does_not_fit_is_refused(capsys, tiny_model_path):
    code, _, err = run_in_process(capsys, "generate", "--model", str(tiny_model_path("llama")),
                                  "--prompt", "x", "--kv-bits", "4", "--kv-group-size", "128")
    assert code == 1 and "--kv-group-size" in err


def test_quantized_prompt_cache_file(capsys, tmp_path, tiny_model_path):
    """A cache saved with --kv-bits comes back quantized and gives the --kv-bits answer."""
    model = str(tiny_model_path("gemma3"))
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(LONG_TEXT)
    cache_file = tmp_path / "q4.cache"
    assert run_in_process(capsys, "cache-prompt", "--model", model, "--kv-bits", "4",
                          "--prompt-file", str(prompt_file), "--out", str(cache_file))[0] == 0
    with_cache = run_in_process(capsys, "generate", "--model", model, "--prompt-cache-file",
                                str(cache_file), "--prompt", " And", "--max-tokens", "16")
    without = run_in_process(capsys, "generate", "--model", model, "--kv-bits", "4",
                             "--prompt", LONG_TEXT + " And", "--max-tokens", "16")
    assert with_cache[0] == 0 and with_cache[1] == without[1]
    code, _, err = run_in_process(capsys, "generate", "--model", model, "--kv-bits", "8",
                                  "--prompt-cache-file", str(cache_file), "--prompt", "x")
    assert code == 1 and "--kv-bits" in err
