"""What agents send that is not content, dropped before templating so that a conversation's
prefix stays byte-identical from turn to turn (and the prompt cache hits).

Claude Code's first system block is `x-anthropic-billing-header: cc_version=...;
cc_entrypoint=...; cch=...;`: its `cch` changes on every request in interactive sessions (since
2.1.36), so a prefix cache would reuse nothing past the first few dozen tokens of a 60k-token
session. vLLM drops the block before templating for the same reason. Anthropic's API reads it as
billing metadata, never as part of the prompt, so dropping it changes no answer.
"""

from __future__ import annotations

# Text blocks that start with one of these are request metadata, not prompt.
_METADATA_PREFIXES = ("x-anthropic-billing-header:",)


def is_request_metadata(text: str) -> bool:
    return text.lstrip().startswith(_METADATA_PREFIXES)
