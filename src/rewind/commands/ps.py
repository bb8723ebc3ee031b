"""`rewind ps`: the models a running `rewind serve` holds, and the memory each takes."""

from __future__ import annotations

import argparse
import sys

from rewind import env


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ps", help="list the models a running server has loaded",
                                   description=__doc__)
    parser.add_argument("--url", default=None,
                        help="the server (default: http://127.0.0.1:1234, or $REWIND_URL)")
    parser.add_argument("--api-key", default=env.api_key(),
                        help="the server's key (default: $REWIND_API_KEY)")
    parser.add_argument("--all", action="store_true", help="list models not loaded too")
    parser.set_defaults(func=run)


def _mib(value: float) -> str:
    return f"{value / (1 << 20):,.0f} MiB"


def run(args: argparse.Namespace) -> int:
    import httpx

    url = (args.url or env.server_url() or "http://127.0.0.1:1234").rstrip("/")
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
        health = httpx.get(f"{url}/health", timeout=10)
    except httpx.HTTPError as exc:
        print(f"rewind ps: no server at {url} ({exc}); start one with `rewind serve`",
              file=sys.stderr)
        return 1
    if models.status_code != 200:
        print(f"rewind ps: {url}/v1/models answered {models.status_code}: {models.text}",
              file=sys.stderr)
        return 1
    rows = [m for m in models.json()["data"] if args.all or m.get("loaded")]
    width = max([len(m["id"]) for m in rows] + [5])
    print(f"{'MODEL':<{width}}  {'STATE':<9} {'FORM':<6} {'MEMORY':>10}  {'RUNNING':>7}  "
          f"{'UNLOADS IN':>10}  CONTEXT")
    for m in rows:
        memory = _mib(m["memory_bytes"]) if "memory_bytes" in m else "-"
        until = m.get("unload_in_seconds")
        until_text = "-" if until is None else f"{until:.0f} s"
        print(f"{m['id']:<{width}}  {m['state']:<9} {m['form']:<6} {memory:>10}  "
              f"{m.get('running', 0):>7}  {until_text:>10}  {m.get('context_length') or '-'}")
    if health.status_code == 200:
        print(f"\n{len([m for m in models.json()['data'] if m.get('loaded')])} loaded of "
              f"{len(models.json()['data'])} servable at {url}")
    return 0
