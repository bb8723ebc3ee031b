"""`rewind serve --config rewind.toml` and `--print-config`: the flags' settings from a file.

The file holds the same settings as the flags, named by the flag without its dashes (`port`,
`cache_ram` or `cache-ram`, `model = ["a", "b"]` for a repeatable one). A flag given on the
command line wins over the file; the file wins over the defaults. Each value goes through the
flag's own type and choices, so the file and the command line accept the same things, and a
setting that is unknown or of the wrong kind is an error naming it and the file.
"""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
from pathlib import Path
from typing import Any

EXPLICIT = "explicit_flags"  # the namespace attribute: dests given on the command line
NOT_SETTINGS = {"help", "func", "config", "print_config", EXPLICIT}
SECRETS = {"api_key", "admin_key"}  # shown as set / not set, never printed


def track_explicit_flags(parser: argparse.ArgumentParser) -> None:
    """Make every option of `parser` record its dest in `args.explicit_flags` when it is given on
    the command line: argparse fills defaults in the same namespace, so a value alone cannot
    tell a flag the user typed from a default (`--port 1234` must still beat the file)."""
    for action in parser._actions:  # argparse has no public iterator over its actions
        if action.dest in NOT_SETTINGS or action.dest == argparse.SUPPRESS:
            continue
        action.__class__ = _recording(type(action))


_RECORDING: dict[type, type] = {}


def _recording(base: type) -> type:
    if base not in _RECORDING:
        def call(self: argparse.Action, parser: argparse.ArgumentParser,
                 namespace: argparse.Namespace, values: Any, option_string: str | None = None
                 ) -> None:
            base.__call__(self, parser, namespace, values, option_string)
            explicit = set(getattr(namespace, EXPLICIT, set()))
            explicit.add(self.dest)
            setattr(namespace, EXPLICIT, explicit)

        _RECORDING[base] = type(f"Recording{base.__name__}", (base,), {"__call__": call})
    return _RECORDING[base]


def settings_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each setting a config file may hold, by its name (the flag's dest)."""
    return {action.dest: action for action in parser._actions
            if action.dest not in NOT_SETTINGS and action.dest != argparse.SUPPRESS
            and action.option_strings}


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read --config {path}: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from exc
    return {key.replace("-", "_"): value for key, value in data.items()}


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser,
                      path: Path) -> set[str]:
    """Fill `args` from the file at `path` where no flag was given; returns the settings the file
    supplied. Raises ValueError naming the first bad setting."""
    settings = settings_of(parser)
    explicit = getattr(args, EXPLICIT, set())
    used = set()
    for name, value in read_config_file(path).items():
        action = settings.get(name)
        if action is None:
            close = difflib.get_close_matches(name, list(settings), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{path}: unknown setting {name!r}{hint}; the settings are the "
                             "flags of `rewind serve --help` without their dashes")
        if name in explicit:
            continue  # the command line wins
        setattr(args, name, _converted(action, value, f"{path}: {name}", path.parent))
        used.add(name)
    return used


def _converted(action: argparse.Action, value: Any, where: str, folder: Path) -> Any:
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, not {value!r}")
        return value if action.const is True else not value
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_one(action, item, where, folder) for item in items]
    return _one(action, value, where, folder)


def _one(action: argparse.Action, value: Any, where: str, folder: Path) -> Any:
    kind = action.type
    if isinstance(value, (dict, list)) or isinstance(value, bool):
        raise ValueError(f"{where} must be a single {_kind_name(kind)}, not {value!r}")
    if kind is int and not isinstance(value, int):
        raise ValueError(f"{where} must be a whole number, not {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, not {value!r}")
    if kind is Path:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a path (a string), not {value!r}")
        path = Path(value).expanduser()
        converted: Any = path if path.is_absolute() else folder / path  # beside the file
    elif kind is None:  # a string flag; sizes and durations may come as plain numbers
        if not isinstance(value, (str, int, float)):
            raise ValueError(f"{where} must be a string, not {value!r}")
        converted = str(value)
    else:
        try:
            converted = kind(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"{where} must be one of {', '.join(map(str, action.choices))}, "
                         f"not {value!r}")
    return converted


def _kind_name(kind: Any) -> str:
    return {int: "whole number", float: "number", Path: "path", None: "string"}.get(kind, "value")


def render_settings(args: argparse.Namespace, parser: argparse.ArgumentParser,
                    from_file: set[str]) -> str:
    """The effective settings as a TOML file `--config` reads back (secrets left out), each
    line saying where its value came from."""
    explicit = getattr(args, EXPLICIT, set())
    lines = ["# rewind serve: effective settings (flags win over --config, which wins over "
             "the defaults)"]
    for name in sorted(settings_of(parser)):
        value = getattr(args, name, None)
        source = "flag" if name in explicit else "config" if name in from_file else "default"
        if name in SECRETS:
            state = "set" if value else "not set"
            lines.append(f"# {name}: {state} ({source}; never printed)")
        elif value is None:
            lines.append(f"# {name}: not set ({source})")
        else:
            lines.append(f"{name} = {_toml(value)}  # {source}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return json.dumps(str(value))  # a JSON string is a TOML basic string
