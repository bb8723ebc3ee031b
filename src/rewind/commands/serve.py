"""`rewind serve`: the OpenAI- and Anthropic-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rewind.commands.common import add_cpu_weights_arg
from rewind.commands.serve_config import apply_config_file, render_settings, track_explicit_flags
from rewind.config import CacheConfig, EngineConfig, ServerConfig, parse_size


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over OpenAI- and Anthropic-compatible HTTP APIs")
    parser.add_argument("--model", action="append", default=None, metavar="NAME|FOLDER",
                        help="a model to serve, by name (`rewind models`), folder or Hugging "
                        "Face repo id; repeatable. The first is loaded at start and is what a "
                        "request naming no model gets; every model `rewind models` lists is "
                        "served too, loaded on the first request that names it (default: "
                        "default)")
    parser.add_argument("--max-models", type=int, default=None, metavar="N",
                        help="models loaded at once; loading one more unloads the least "
                        "recently used (default: as many as the memory budget holds)")
    parser.add_argument("--idle-unload", default=None, metavar="DURATION",
                        help="unload a model unused this long, e.g. 15m (default: never; a "
                        "request's keep_alive overrides it for its model)")
    parser.add_argument("--memory-budget", default=None, metavar="SIZE|PERCENT",
                        help="cap on weights + live KV caches + the prompt cache's RAM tier, "
                        "e.g. 12GiB or 70%% (default: 80%% of RAM on the CPU, of the working set "
                        "on Metal, of device memory on CUDA)")
    parser.add_argument("--kv-reserve-tokens", type=int, default=4096, metavar="N",
                        help="KV tokens per --parallel slot a model's load must leave room for "
                        "(default: %(default)s, at most its context)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=1234)
    parser.add_argument("--parallel", type=int, default=4,
                        help="sequences decoded together (default: %(default)s)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests waiting for a slot before 429 (default: %(default)s)")
    parser.add_argument("--mixed-prefill-tokens", type=int, default=None, metavar="N",
                        help="prompt tokens' worth of prefill per step while others stream, "
                        "their rows included: smaller keeps their tokens coming evenly, larger "
                        "gives a new prompt its first token sooner (default: 64 plus --parallel "
                        "on the CPU kernels, where a prompt chunk's layers spread over steps; "
                        "one chunk plus --parallel elsewhere)")
    parser.add_argument("--speculative", choices=("auto", "off", "ngram", "suffix"),
                        default="auto",
                        help="draftless speculative decoding: ngram drafts from a request's own "
                        "prompt and answer, suffix also from recent answers; auto is suffix "
                        "where it is exact (rows on the CPU kernels) and off elsewhere "
                        "(default: %(default)s)")
    parser.add_argument("--draft-model", default=None, metavar="NAME|FOLDER",
                        help="a smaller model of the same vocabulary that drafts tokens for "
                        "--speculative auto to verify (e.g. the default Gemma 3 270M for a "
                        "larger Gemma 3); a served model of another vocabulary decodes without it")
    parser.add_argument("--speculative-max-draft", type=int, default=16, metavar="N",
                        help="tokens one request drafts in a step, at most (default: %(default)s)")
    parser.add_argument("--api-key", default=None,
                        help="require this key (Authorization: Bearer or x-api-key) on /v1")
    parser.add_argument("--api-key-file", default=None, type=Path, metavar="FILE",
                        help="accept the keys in FILE, one per line with an optional name "
                        "(`KEY NAME`); each key gets a prompt cache of its own")
    parser.add_argument("--admin-key", default=None, metavar="KEY",
                        help="also accept KEY, which sees every key's sessions on the web page "
                        "(/v1/rewind/sessions); the other keys see only their own")
    parser.add_argument("--max-sessions", type=int, default=256, metavar="N",
                        help="client sessions the web page remembers; the least recently seen "
                        "go first (default: %(default)s)")
    parser.add_argument("--shared-cache", action="store_true",
                        help="let all API keys share one prompt cache (one user's keys)")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="allow browser requests from ORIGIN (repeatable; default: none)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                        help="refuse prompts longer than N tokens (default: the model's "
                        "context)")
    parser.add_argument("--max-images", type=int, default=8, metavar="N",
                        help="images one request may carry (default: %(default)s)")
    parser.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="408 for a request body idle this long (default: %(default)s)")
    parser.add_argument("--no-prompt-cache", action="store_true",
                        help="recompute every prompt from scratch")
    parser.add_argument("--cache-ram", default=None, metavar="SIZE",
                        help="RAM budget of the prompt cache's hot tier, e.g. 2GiB")
    parser.add_argument("--cache-disk", default=None, metavar="SIZE",
                        help="disk budget of the prompt cache (default: min(30GiB, free/4))")
    parser.add_argument("--no-disk-cache", action="store_true",
                        help="keep the prompt cache in RAM only")
    parser.add_argument("--cache-dir", default=None, type=Path,
                        help="folder of the disk tier's file (unlinked unless --cache-persist)")
    parser.add_argument("--cache-persist", action="store_true",
                        help="keep the prompt cache on disk across restarts (a named file and "
                        "index in --cache-dir; see `rewind cache stats`)")
    parser.add_argument("--max-kv-size", type=int, default=None,
                        help="cap each sequence's KV cache (rotating) at N tokens")
    parser.add_argument("--max-body", default="32MiB", metavar="SIZE",
                        help="largest request body accepted (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=4096, metavar="N",
                        help="output tokens of a request that sends no limit, and the most any "
                        "request gets (default: %(default)s)")
    parser.add_argument("--allow-image-urls", action="store_true",
                        help="fetch http(s) image URLs sent in requests (off: only inline "
                        "base64 images are accepted)")
    add_cpu_weights_arg(parser)
    parser.add_argument("--no-warm-up", action="store_true",
                        help="on a GPU, skip the two short requests each model runs as it loads "
                        "(they compile its kernels, so the first request is not seconds slower)")
    parser.add_argument("--pipeline", action="store_true",
                        help="under mlx.launch: split the model's layers over the ranks "
                        "(pipeline parallelism) instead of its heads (tensor parallelism)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="read these settings from a TOML file, each named as its flag "
                        "without the dashes (port = 8080, cache_ram = \"2GiB\", model = "
                        "[\"a\", \"b\"]); flags given on the command line win")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective settings (flags, --config, defaults) as TOML "
                        "and exit without loading a model")
    parser.set_defaults(func=run)
    track_explicit_flags(parser)


def serve_parser() -> argparse.ArgumentParser:
    """A fresh `rewind serve` parser: the settings a config file may hold are its flags."""
    commands = argparse.ArgumentParser(prog="rewind").add_subparsers()
    register(commands)
    return commands.choices["serve"]


def apply_config(args: argparse.Namespace) -> set[str]:
    """Fill `args` from --config where no flag was given; the settings the file supplied."""
    if getattr(args, "config", None) is None:
        return set()
    return apply_config_file(args, serve_parser(), args.config)


def server_config(args: argparse.Namespace) -> ServerConfig:
    sizes = {}  # the budgets given; the others keep their defaults
    if args.cache_ram is not None:
        sizes["ram_bytes"] = parse_size(args.cache_ram)
    if args.cache_disk is not None:
        sizes["disk_bytes"] = parse_size(args.cache_disk)
    cache = CacheConfig(enabled=not args.no_prompt_cache, disk_enabled=not args.no_disk_cache,
                        cache_dir=args.cache_dir, persist=args.cache_persist, **sizes)
    engine = EngineConfig(parallel=args.parallel, max_queue=args.max_queue,
                          mixed_prefill_tokens=args.mixed_prefill_tokens,
                          max_kv_size=args.max_kv_size, speculative=args.speculative,
                          speculative_max_draft=args.speculative_max_draft, cache=cache)
    config = ServerConfig(model=(args.model or ["default"])[0], host=args.host, port=args.port, api_key=args.api_key,
                          api_key_file=args.api_key_file, shared_cache=args.shared_cache,
                          admin_key=args.admin_key, max_sessions=args.max_sessions,
                          cors_origins=list(args.cors_origin),
                          max_prompt_tokens=args.max_prompt_tokens, max_images=args.max_images,
                          body_idle_seconds=args.body_timeout,
                          max_body_bytes=parse_size(args.max_body),
                          allow_image_urls=args.allow_image_urls, max_tokens=args.max_tokens,
                          cpu_weights=args.cpu_weights, warm_up=not args.no_warm_up,
                          draft_model=args.draft_model,
                          engine=engine)  # validated when built
    from rewind.server.auth import key_ring

    try:
        key_ring(config)  # a bad key file stops here, before minutes of model loading
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file: {exc}") from exc
    return config


def run(args: argparse.Namespace) -> int:
    try:
        from_file = apply_config(args)
        config = server_config(args)
        if args.print_config:
            from rewind.server.keep_alive import parse_duration
            from rewind.server.memory_budget import parse_budget

            parse_budget(args.memory_budget)  # what serve_pool would refuse, refused here too
            parse_duration(args.idle_unload)
    except ValueError as exc:
        print(f"rewind serve: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(render_settings(args, serve_parser(), from_file), end="")
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s "
                        "%(name)s: %(message)s")
    if config.host not in ("127.0.0.1", "localhost", "::1") and not (
            config.api_key or config.api_key_file or config.admin_key):
        logging.warning("serving on %s without --api-key: anyone who can reach it can use it",
                        config.host)

    from rewind.parallel.group import world

    group = world()
    if group is not None:  # started by mlx.launch: one shard of the model per process
        return run_sharded(config, group, "pipeline" if args.pipeline else "tensor",
                           args.log_level)
    if args.pipeline:
        print("rewind serve: --pipeline needs several processes (start it with mlx.launch)",
              file=sys.stderr)
        return 2
    return serve_pool(config, args)


def serve_pool(config: ServerConfig, args: argparse.Namespace) -> int:
    """One process serving every model by name (rewind.server.model_pool)."""
    import uvicorn

    import rewind
    from rewind.models.catalog import Catalog
    from rewind.models.loader import cpu_weight_options
    from rewind.server.app import create_pool_app
    from rewind.server.keep_alive import parse_duration
    from rewind.server.memory_budget import gib, parse_budget
    from rewind.server.pool_setup import build_pool

    try:
        budget = parse_budget(args.memory_budget)
        idle = parse_duration(args.idle_unload)
    except ValueError as exc:
        print(f"rewind serve: {exc}", file=sys.stderr)
        return 2
    models = list(args.model or ["default"])
    # Which source tree is serving (benchmarks run a frozen worktree and check this line).
    print(f"loading {config.model} (rewind from {Path(rewind.__file__).resolve().parent}) ...",
          file=sys.stderr, flush=True)
    pool = build_pool(Catalog(models), config, budget, default_model=config.model,
                      max_models=args.max_models, idle_unload=idle,
                      reserve_tokens=args.kv_reserve_tokens,
                      load_options=cpu_weight_options(config.cpu_weights))
    try:
        first = pool.load_now(config.model)
    except Exception as exc:  # noqa: BLE001 - an ApiError or a loader error: say it and stop
        pool.close_blocking()
        print(f"rewind serve: cannot load {config.model}: {getattr(exc, 'message', exc)}",
              file=sys.stderr)
        return 1
    close = pool.close_blocking
    app = create_pool_app(pool, config, on_shutdown=close)
    print(f"serving {first.name} ({first.entry.path}) on http://{config.host}:{config.port}/v1 "
          f"with --parallel {config.engine.parallel}; {len(pool.catalog.names)} models servable "
          f"by name, memory budget {gib(budget)}", file=sys.stderr, flush=True)
    print(f"web page: http://{config.host}:{config.port}/", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        close()  # if the app never started (a port in use); a second close does nothing
    return 0


def serve_http(loaded, engine, prompt_cache, config: ServerConfig,  # type: ignore[no-untyped-def]
               log_level: str) -> int:
    """One engine behind the HTTP API: rank 0 of a sharded model."""
    import uvicorn

    import rewind
    from rewind.server.app import create_app

    def close() -> None:
        engine.shutdown()
        if prompt_cache is not None:
            prompt_cache.close()

    app = create_app(loaded, engine, config, prompt_cache, on_shutdown=close)
    print(f"serving {loaded.name} ({loaded.path}) on http://{config.host}:{config.port}/v1 "
          f"with --parallel {config.engine.parallel} (rewind from "
          f"{Path(rewind.__file__).resolve().parent})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level=log_level,
                    timeout_graceful_shutdown=5)
    finally:
        close()
    return 0


def run_sharded(config: ServerConfig, group, layout: str,  # type: ignore[no-untyped-def]
                log_level: str) -> int:
    """One rank of `mlx.launch ... -- rewind serve`: rank 0 serves HTTP and leads the engine;
    the others hold their shard and replay rank 0's steps until it stops."""
    from rewind.parallel.serving import build_rank_engine, load_shard
    from rewind.parallel.shard import ShardingError

    rank = group.rank()
    print(f"rank {rank} of {group.size()}: loading a {layout}-parallel shard of {config.model}",
          file=sys.stderr, flush=True)
    try:
        loaded = load_shard(config.model, group, layout)
    except ShardingError as exc:  # every rank finds the same, before any collective
        print(f"rewind serve: {exc}", file=sys.stderr, flush=True)
        return 2
    engine, prompt_cache = build_rank_engine(loaded, config.engine, group, layout)
    if rank == 0:
        return serve_http(loaded, engine.start(), prompt_cache, config, log_level)
    try:
        engine.run()
    finally:
        if prompt_cache is not None:
            prompt_cache.close()
    return 0
