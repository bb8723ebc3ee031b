"""Every knob of Rewind, in dataclasses with defaults that serve. The CLI fills these in."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from rewind.paths import scratch_dir

BLOCK_TOKENS = 256  # checkpoint / prefill-chunk granularity, in tokens
KV_BITS = (2, 3, 4, 5, 6, 8)  # the bits MLX quantizes to (a quantized KV cache)

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'512MiB', '2G', '1.5GB', '1048576' -> bytes (binary multiples: this is about RAM and disk)."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (try 512MiB, 4GiB, 1048576)")
    number, unit = float(match.group(1)), match.group(2).lower()
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit]
    return int(number * scale)


def default_disk_budget(folder: Path | None = None) -> int:
    """min(30 GiB, a quarter of the free space where the scratch file goes)."""
    folder = folder or scratch_dir()
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    return int(min(30 << 30, free // 4))


@dataclass
class DiskFaults:
    """Tests only: faults that rewind.cache.file_io injects under the disk tier's file I/O, each
    on every `every`-th call of its kind after `after` calls (`every=1`: on every call). `write_errno` / `read_errno`: the errno raised (EIO, ENOSPC...);
    `short_write`: a write puts down at most this many bytes (the store must loop);
    `flip_reads`: a read comes back with one byte changed (the checksum must catch it)."""

    write_errno: int | None = None
    read_errno: int | None = None
    short_write: int | None = None
    flip_reads: bool = False
    every: int = 1
    after: int = 0


@dataclass
class CacheConfig:
    enabled: bool = True
    block_tokens: int = BLOCK_TOKENS
    ram_bytes: int = 2 << 30
    disk_enabled: bool = True
    disk_bytes: int | None = None  # None: default_disk_budget() when the store opens
    cache_dir: Path | None = None  # None: paths.scratch_dir()
    writer_queue: int = 64  # records waiting for the disk; the engine blocks only past this
    salt: str = ""  # per-tenant cache salt folded into every block key
    # Keep the disk tier in a named file + index in cache_dir that the next server reopens
    # (rewind.cache.persist); records are written through as they are made.
    persist: bool = False
    snapshot_records: int = 64  # the index is rewritten after this many new records...
    snapshot_seconds: float = 5.0  # ...or this long after the last snapshot, and at close
    # Tests only: faults injected under the disk tier's file I/O (rewind.cache.file_io).
    disk_faults: DiskFaults | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range (run when built; call again
        after changing a field)."""
        _check([
            (self.block_tokens >= 1, f"cache block tokens must be at least 1, not {self.block_tokens}"),
            (self.ram_bytes >= 0, f"the cache's RAM budget must not be negative ({self.ram_bytes})"),
            (self.disk_bytes is None or self.disk_bytes >= 0,
             f"the cache's disk budget must not be negative ({self.disk_bytes})"),
            (self.writer_queue >= 1, f"the writer queue must hold at least 1 record, not {self.writer_queue}"),
            (self.snapshot_records >= 1,
             f"the index snapshot interval must be at least 1 record, not {self.snapshot_records}"),
            (self.snapshot_seconds > 0,
             f"the index snapshot interval must be positive, not {self.snapshot_seconds} s"),
        ])


# Model calls of a prefill end on multiples of this many prompt tokens (it divides the block
# size, so checkpoints stay chunk ends). On the CPU a call's cost grows with its tokens, and a
# decoding row waits for the chunk that shares its step; the engine spreads a chunk's layers
# over steps (SLICED_PREFILL_TOKENS) so that wait stays near a step either way. Since the GGUF
# products unpack each claim's weights once per call (quant512.h's strips), bigger calls pay:
# the default's 1,024-token prefill on the Xeon of issue 25 ran at 888-905 tokens/s in calls of
# 64, 1,019-1,030 in 128 and 1,113-1,132 in 256 (benchmarks/probes/prefill_split.py).
CPU_CHUNK_TOKENS = 128
GPU_CHUNK_TOKENS = BLOCK_TOKENS


def default_chunk_tokens() -> int:
    import mlx.core as mx

    return CPU_CHUNK_TOKENS if mx.default_device() == mx.cpu else GPU_CHUNK_TOKENS


# Prompt tokens' worth of work per step next to decoding rows where a chunk's layers can be
# spread over steps (the CPU kernels): one chunk's. Agent sessions to 10k tokens on 2 cores, side
# by side with llama-server (benchmarks/results/mixed-budget): with 4 sessions and a budget of 36
# (with --parallel 4) the turns' first tokens waited 1.65x llama-server's in all and the sessions
# took 1.09x as long; more prefill a step gives the next turn its first token sooner, at a longer
# gap between a stream's tokens (p99 249 ms at 68 against 168 at 36, 3 sessions).
SLICED_PREFILL_TOKENS = 64
# Speculative decoding modes (rewind.engine.speculation.MODES; config imports no engine module).
SPECULATIVE_MODES = ("auto", "off", "ngram", "suffix")
# What one more pass through the layers costs beyond its rows, in prompt tokens' worth: reading
# every weight again. Default model, 2 cores: a 1-token call takes 22-25 ms, a 64-token one 150-156
# ms (~2.1 ms a token), so ~10 tokens. A step spends it on a sequence's next call once its last
# one passed every layer (the small calls the checkpoints cut), rather than leave it for a step.
PASS_TOKENS = 10


@dataclass
class EngineConfig:
    parallel: int = 4
    max_queue: int = 64
    # Prompt tokens per step when no sequence is decoding (several chunks, one call each).
    prefill_chunk: int = 512
    # Tokens per step while sequences decode: the decoding rows plus prompt chunks up to this
    # budget (at least one chunk, or one layer of one where a chunk's layers can be spread over
    # steps, so prompts never starve behind a full batch). None: by backend (below).
    mixed_prefill_tokens: int | None = None
    chunk_tokens: int | None = None  # the prefill call grid; None: by backend (above)
    # Queue each decode step before reading the previous one's tokens, so the host's work
    # (sampling, detokenizing, streaming) overlaps the device's. None: on GPUs only (the CPU
    # kernels compute as they are called, so there is nothing to overlap).
    pipeline_decode: bool | None = None
    max_kv_size: int | None = None
    kv_bits: int | None = None
    # Draftless speculative decoding (rewind.engine.speculation): auto, off, ngram (a row's own
    # prompt and answer) or suffix (that and recent answers of the same model). auto: suffix where
    # verification is exact (rows decoding through the CPU kernels), off elsewhere.
    speculative: str = "auto"
    speculative_max_draft: int = 16  # tokens one row drafts in a step, at most
    speculative_step_tokens: int = 32  # drafted tokens over all rows of a step, at most
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range (run when built)."""
        _check([
            (self.parallel >= 1, f"parallel must be at least 1, not {self.parallel}"),
            (self.max_queue >= 0, f"max queue must not be negative ({self.max_queue})"),
            (self.prefill_chunk >= 1, f"the prefill chunk must be at least 1 token, not {self.prefill_chunk}"),
            (self.mixed_prefill_tokens is None or self.mixed_prefill_tokens >= 1,
             f"the mixed-step token budget must be at least 1, not {self.mixed_prefill_tokens}"),
            # That it divides the block size is checked where the block size is known (the
            # engine's prompt cache may have its own): rewind.cache.checkpoints.check_chunk_tokens.
            (self.chunk_tokens is None or self.chunk_tokens >= 1,
             f"chunk tokens must be at least 1, not {self.chunk_tokens}"),
            (self.max_kv_size is None or self.max_kv_size >= 1,
             f"max KV size must be at least 1, not {self.max_kv_size}"),
            (self.kv_bits is None or self.kv_bits in KV_BITS,
             f"KV bits must be one of {', '.join(map(str, KV_BITS))}, not {self.kv_bits}"),
            (self.speculative in SPECULATIVE_MODES,
             f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, "
             f"not {self.speculative!r}"),
            (self.speculative_max_draft >= 1,
             f"the longest draft must be at least 1 token, not {self.speculative_max_draft}"),
            (self.speculative_step_tokens >= 1,
             f"drafted tokens a step must be at least 1, not {self.speculative_step_tokens}"),
        ])
        self.cache.validate()

    def resolved_pipeline_decode(self) -> bool:
        if self.pipeline_decode is not None:
            return self.pipeline_decode
        import mlx.core as mx

        return mx.default_device() != mx.cpu

    def resolved_mixed_prefill_tokens(self, sliced: bool = False) -> int:
        """The budget; by default one chunk plus the decoding rows, or, where a chunk's layers
        can be spread over steps (`sliced`: the CPU kernels), SLICED_PREFILL_TOKENS plus them."""
        if self.mixed_prefill_tokens is not None:
            return self.mixed_prefill_tokens
        if sliced:
            return SLICED_PREFILL_TOKENS + self.parallel
        chunk = self.chunk_tokens if self.chunk_tokens is not None else default_chunk_tokens()
        return chunk + self.parallel


@dataclass
class ServerConfig:
    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 1234
    api_key: str | None = None
    # One key per line, optionally named: each key is a tenant with a cache of its own.
    api_key_file: Path | None = None
    shared_cache: bool = False  # all keys share one prompt cache (a single user's keys)
    # A key that sees every tenant's sessions in /v1/rewind/sessions (the others see their own).
    admin_key: str | None = None
    # Client conversations the server remembers for the web page (least recently seen go first).
    max_sessions: int = 256
    cors_origins: list[str] = field(default_factory=list)  # none: no CORS headers at all
    max_prompt_tokens: int | None = None  # None: the model's context is the only bound
    max_images: int = 8  # images in one request
    max_body_bytes: int = 32 << 20
    # A body that sends nothing for this long is abandoned with a 408 (uvicorn itself never
    # times a body out, so a stalled upload would hold its connection forever).
    body_idle_seconds: float = 30.0
    allow_image_urls: bool = False
    # Output tokens of a request that names no limit, and the most any request gets.
    max_tokens: int = 4096
    cpu_weights: str = "auto"  # rewind.models.loader.CPU_WEIGHTS
    # On a GPU, run two short requests through each model as it loads (rewind.engine.warm_up):
    # the first user request then does not wait for kernels to be compiled.
    warm_up: bool = True
    # A model that drafts for the served models of its vocabulary (rewind.engine.draft_model).
    draft_model: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range (run when built; call again
        after changing a field)."""
        _check([
            (0 <= self.port <= 65535, f"port {self.port} is not a TCP port"),
            (self.max_body_bytes >= 1024, "the body limit must be at least 1KiB"),
            (self.body_idle_seconds > 0, "the body timeout must be positive"),
            (self.max_tokens >= 1, "max tokens must be at least 1"),
            (self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
             "max prompt tokens must be at least 1"),
            (self.max_images >= 0, "max images must not be negative"),
            (self.max_sessions >= 1, "max sessions must be at least 1"),
            (not (self.admin_key is not None and not self.admin_key.strip()),
             "the admin key must not be empty"),
        ])
        self.engine.validate()


def _check(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
