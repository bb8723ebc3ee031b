"""The prompt cache: 256-token checkpoints of every layer kind, a RAM hot tier and a one-file
disk tier, and restore of the longest cached prefix (see prompt_cache.py for the design)."""

from rewind.cache.blocks import BlockExtras
from rewind.cache.prompt_cache import PromptCache, Restored

__all__ = ["BlockExtras", "PromptCache", "Restored"]
