"""A test-only fault switch: make a forward pass raise inside a real server, to see what a failing
engine does to its requests, to other models' requests and to the requests after it.

REWIND_TEST_FORWARD_FAULT (rewind.env) names a trigger file. While the variable is unset nothing
is checked (`forward_fault` returns None and the runner calls nothing). While it is set, every
forward call of an engine looks for the file; when it exists and holds the engine's model name
(its id in /v1/models; an empty file means any model), the call removes the file and raises
`InjectedFault`. Each file fires once, in one engine, at a moment the test chooses (writing the
file), which a timing-based fault (every Nth call) could not promise. Write the file whole (a
finished file renamed onto the name): one caught empty mid-write would fault any model.
"""

from __future__ import annotations

from collections.abc import Callable

from rewind import env


class InjectedFault(RuntimeError):
    """Raised by a forward pass that REWIND_TEST_FORWARD_FAULT told to fail."""


def forward_fault(model_name: str) -> Callable[[], None] | None:
    """The check a runner makes before each forward call, or None when the switch is off."""
    trigger = env.forward_fault_file()
    if trigger is None:
        return None

    def check() -> None:
        try:
            wanted = trigger.read_text().strip()
        except OSError:  # no file (the usual case), or not readable yet
            return
        if wanted and wanted != model_name:
            return
        try:
            trigger.unlink()  # fire once: another engine that read it too finds it gone
        except FileNotFoundError:
            return
        raise InjectedFault(f"a fault injected into {model_name}'s forward pass "
                            "(REWIND_TEST_FORWARD_FAULT)")

    return check
