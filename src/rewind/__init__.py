"""Rewind: a local MLX inference server for agentic workloads."""

__version__ = "0.1.0"
