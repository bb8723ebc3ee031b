"""`rewind bench repeated-image`: the same high-resolution image prompt sent twice, one token
generated each time; the second request's time against the first's, with Rewind's caches (prompt
cache + vision-feature LRU) and without them. LM Studio reported 3.5x for this with its cache.

No vision weights can be downloaded here, so the model is random-weight with a real model's
configuration (`--config gemma3-4b`: Gemma 3 4B's SigLIP So400m tower, 27 layers 1152 wide at
896 px, 256 tokens per image, and its 34-layer 2560-wide language model with sliding-window and
global layers). Speed does not depend on the weights' values. The tokenizer is the tiny test
tokenizer (its ids fit the real vocabulary; text content does not change the timing).

Gemma 3 gives every image 256 tokens. A high-resolution image reaches thousands of tokens the way
Gemma 3's pan-and-scan does it: the picture is cut into a grid of crops, each sent as its own
image after a downscaled whole (`--grid 3`: 9 crops + 1 whole = 10 images = 2,560 image tokens).

Requests go through the same path as the server's (decode the PNG bytes, expand placeholders,
engine with the vision embedding seam); timings are wall-clock from the bytes to the first token.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path("benchmarks/results")

# Gemma 3 4B's configuration (google/gemma-3-4b-it config.json), less what mlx ignores.
GEMMA3_4B = {
    "vocab_size": 262208,
    "hidden_size": 2560,
    "mm_tokens_per_image": 256,
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
        "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
        "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072, "mm_tokens_per_image": 256, "vocab_size": 262208,
        "tie_word_embeddings": True,
    },
    "vision_config": {
        "model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "image_size": 896,
        "num_channels": 3, "layer_norm_eps": 1e-6,
    },
}
CONFIGS = {"gemma3-4b": GEMMA3_4B, "tiny": None}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", choices=sorted(CONFIGS), default="gemma3-4b",
                        help="model configuration, random weights (default: %(default)s; 'tiny' "
                        "is the test model, for a quick check only)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="build the random-weight model here (default: a temporary folder)")
    parser.add_argument("--grid", type=int, default=3,
                        help="crops per side of the high-resolution image; images sent = "
                        "grid*grid + 1 (default: %(default)s)")
    parser.add_argument("--image-px", type=int, default=2688,
                        help="side of the square high-resolution image (default: %(default)s)")
    parser.add_argument("--pairs", type=int, default=3,
                        help="first/second pairs per mode, each with a fresh image (default: "
                        "%(default)s)")
    parser.add_argument("--json", type=Path, default=RESULTS / "repeated_image.json",
                        help="JSON output; the Markdown report goes beside it (.md)")


def synthetic_photo(side: int, seed: int) -> Any:
    """A deterministic picture with smooth gradients and noise (PNG-compressible, not flat)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
    phase = rng.uniform(0, 6.28, size=3)
    channels = [127 + 100 * np.sin(6 * x + 4 * y + p) for p in phase]
    pixels = np.stack(channels, axis=-1) + rng.normal(0, 12, size=(side, side, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def image_payloads(side: int, grid: int, seed: int, overview_px: int) -> list[bytes]:
    """PNG bytes of the downscaled whole, then each crop of the grid (row by row)."""
    photo = synthetic_photo(side, seed)

    def png(image: Any) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, "PNG", compress_level=1)
        return buffer.getvalue()

    step = side // grid
    payloads = [png(photo.resize((overview_px, overview_px)))]
    for row in range(grid):
        for col in range(grid):
            payloads.append(png(photo.crop((col * step, row * step, (col + 1) * step,
                                            (row + 1) * step))))
    return payloads


def build_model(config_name: str, folder: Path) -> Path:
    import mlx.core as mx

    from rewind.models.loader import is_cpu_backend
    from rewind.testing.tiny_vision import build_tiny_vision_model

    override = CONFIGS[config_name]
    if override is None:
        return build_tiny_vision_model(folder)
    dtype = mx.float32 if is_cpu_backend() else mx.bfloat16
    return build_tiny_vision_model(folder, config_override=override, gain=1.0, dtype=dtype)


def prompt_tokens(loaded: Any, boi_text: str, crops: int) -> list[int]:
    text = (f"Here is the original image {boi_text} and here are some crops to help you see "
            f"better {' '.join([boi_text] * crops)} Describe the image in detail.")
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    tokenize=False, add_generation_prompt=True)
    return list(loaded.tokenizer.encode(rendered, add_special_tokens=False))


def one_request(engine: Any, adapter: Any, loaded: Any, tokens: list[int],
                payloads: list[bytes]) -> dict[str, Any]:
    """Bytes -> first token, as the server does it; returns timings and cache figures."""
    from rewind.engine import GenerationRequest, SamplingParams
    from rewind.vision.images import image_from_bytes
    from rewind.vision.prompting import prepare_image_prompt

    tower_runs = adapter.tower_runs
    start = time.perf_counter()
    images = [image_from_bytes(data, known=adapter.known_image) for data in payloads]
    decoded = time.perf_counter()
    prepared = prepare_image_prompt(adapter, loaded.model, tokens, images, [len(tokens)])
    # into(): every image field (Qwen's 3-D positions and Qwen3-VL's deepstack too).
    request = prepared.into(GenerationRequest(prepared.tokens,
                                              SamplingParams(temperature=0.0, max_tokens=1),
                                              prepared.checkpoints))
    submitted = time.perf_counter()
    result = engine.generate(request, timeout=600)
    seconds = time.perf_counter() - start
    if result.finish.reason == "error":
        raise RuntimeError(f"request failed: {result.finish.error}")
    usage = result.finish.usage
    return {"seconds": round(seconds, 4), "decode_s": round(decoded - start, 4),
            "preprocess_s": round(submitted - decoded, 4),
            "engine_s": round(seconds - (submitted - start), 4),
            "prompt_tokens": usage.prompt_tokens,
            "image_tokens": prepared.prompt.image_tokens, "cached_tokens": usage.cached_tokens,
            "tower_runs": adapter.tower_runs - tower_runs,
            "restore_seconds": round(usage.restore_seconds, 4)}


def run_mode(mode: str, loaded: Any, adapter: Any, tokens: list[int], args: argparse.Namespace,
             scratch: Path) -> dict[str, Any]:
    from rewind.cache import PromptCache
    from rewind.config import CacheConfig, EngineConfig
    from rewind.engine import Engine
    from rewind.vision.features import FeatureLRU

    cached = mode == "rewind"
    prompt_cache = (PromptCache(loaded.model, loaded.fingerprint,
                                CacheConfig(cache_dir=scratch, disk_bytes=8 << 30))
                    if cached else None)
    # Without caches, the feature LRU keeps nothing (a zero budget refuses every entry).
    adapter.feature_cache = FeatureLRU() if cached else FeatureLRU(budget_bytes=0)
    overview_px = adapter.preprocessing.size[0]
    pairs = []
    try:
        with Engine(loaded, EngineConfig(parallel=1), prompt_cache) as engine:
            # Warm-up on another picture: kernels compiled, allocator sized.
            one_request(engine, adapter, loaded, tokens,
                        image_payloads(args.image_px, args.grid, 10_000, overview_px))
            for pair in range(args.pairs):
                payloads = image_payloads(args.image_px, args.grid, 1 + pair, overview_px)
                first = one_request(engine, adapter, loaded, tokens, payloads)
                second = one_request(engine, adapter, loaded, tokens, payloads)
                pairs.append({"first": first, "second": second,
                              "speedup": round(first["seconds"] / second["seconds"], 2)})
                print(f"{mode:8s} pair {pair}: first {first['seconds']:.3f} s, second "
                      f"{second['seconds']:.3f} s ({pairs[-1]['speedup']:.2f}x), cached "
                      f"{second['cached_tokens']} of {second['prompt_tokens']} tokens, tower runs "
                      f"{first['tower_runs']} then {second['tower_runs']}; 2nd: decode "
                      f"{second['decode_s']:.3f} s, preprocess {second['preprocess_s']:.3f} s, "
                      f"engine {second['engine_s']:.3f} s (restore "
                      f"{second['restore_seconds']:.3f} s)", flush=True)
    finally:
        if prompt_cache is not None:
            prompt_cache.close()
    firsts = [p["first"]["seconds"] for p in pairs]
    seconds_ = [p["second"]["seconds"] for p in pairs]
    return {"mode": mode, "pairs": pairs, "first_median_s": round(statistics.median(firsts), 4),
            "second_median_s": round(statistics.median(seconds_), 4),
            "speedup_median": round(statistics.median(p["speedup"] for p in pairs), 2)}


def markdown(result: dict[str, Any]) -> str:
    model = result["model"]
    lines = [
        "# Repeated image prompt: the second request against the first",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Model: **random weights** with the `{model['config']}` configuration "
        f"({model['description']}). No vision weights can be downloaded here; speed does not "
        "depend on the weights' values.",
        "",
        f"Prompt: {model['prompt_tokens']} tokens, of which **{model['image_tokens']} image "
        f"tokens** ({model['images']} images of {model['tokens_per_image']} tokens: a "
        f"{result['image_px']}x{result['image_px']} picture as its "
        f"{result['grid']}x{result['grid']} "
        "crops plus the downscaled whole, as Gemma 3's pan-and-scan sends a high-resolution "
        "image). One token generated per request; times are wall-clock from the PNG bytes to "
        "the first token (decode, preprocessing, vision tower, prefill).",
        "",
        "| mode | first request (s) | second request (s) | first / second | cached tokens "
        "(2nd) | tower runs (1st / 2nd) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in result["modes"]:
        last = mode["pairs"][-1]
        lines.append(
            f"| {mode['mode']} | {mode['first_median_s']:.3f} | {mode['second_median_s']:.3f} | "
            f"{mode['speedup_median']:.2f}x | {last['second']['cached_tokens']} | "
            f"{last['first']['tower_runs']} / {last['second']['tower_runs']} |")
    lines += [
        "",
        "Second request of the last pair, split: "
        + "; ".join(f"{m['mode']}: decode {m['pairs'][-1]['second']['decode_s']:.3f} s, "
                    f"preprocess {m['pairs'][-1]['second']['preprocess_s']:.3f} s, engine "
                    f"{m['pairs'][-1]['second']['engine_s']:.3f} s (restore "
                    f"{m['pairs'][-1]['second']['restore_seconds']:.3f} s)"
                    for m in result["modes"]) + ".",
        "",
        "Medians over the pairs (each pair a fresh picture). `rewind`: prompt cache (RAM tier "
        "first, scratch file behind it) and the vision-feature LRU; `no-cache`: neither, so the "
        "second request recomputes everything. LM Studio reported 3.5x for this workload with "
        "its cache.",
        "",
        "## Machine",
        "",
        *[f"- {key}: {value}" for key, value in result["machine"].items()],
        "",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        print("rewind bench repeated-image needs the vision extra: pip install "
              "'rewind-engine[vision]'", file=sys.stderr)
        return 2
    from rewind.bench.machine import machine_info
    from rewind.models.loader import load_model
    from rewind.vision.vlm import adapter_for

    command = "rewind bench repeated-image " + " ".join(
        sys.argv[sys.argv.index("repeated-image") + 1:]) if "repeated-image" in sys.argv else \
        "rewind bench repeated-image"
    with tempfile.TemporaryDirectory(prefix="rewind-repeated-image-") as tmp:
        folder = args.model_dir or Path(tmp) / "model"
        started = time.perf_counter()
        build_model(args.config, folder)
        loaded = load_model(str(folder))
        adapter = adapter_for(loaded)
        print(f"built and loaded the random-weight {args.config} model in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        boi_text = loaded.tokenizer.convert_ids_to_tokens(adapter.boi_token_id)
        crops = args.grid * args.grid
        tokens = prompt_tokens(loaded, boi_text, crops)
        modes = [run_mode(mode, loaded, adapter, tokens, args, Path(tmp))
                 for mode in ("no-cache", "rewind")]
        config = loaded.config
    vision, text = config["vision_config"], config["text_config"]
    images = crops + 1
    result = {
        "command": command.strip(), "grid": args.grid, "image_px": args.image_px,
        "model": {
            "config": args.config, "random_weights": True,
            "description": (f"vision tower {vision['num_hidden_layers']} layers x "
                            f"{vision['hidden_size']} at {vision['image_size']} px; language "
                            f"model {text['num_hidden_layers']} layers x {text['hidden_size']}"),
            "images": images, "tokens_per_image": adapter.tokens_per_image,
            "image_tokens": modes[0]["pairs"][0]["first"]["image_tokens"],
            "prompt_tokens": modes[0]["pairs"][0]["first"]["prompt_tokens"],
        },
        "modes": modes,
        "machine": machine_info(),
    }
    out: Path = args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0
