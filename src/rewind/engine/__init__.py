"""The continuous-batching engine: requests in, token events out (see docs/INTERFACES.md)."""

from rewind.engine.engine import Completion, Engine, RequestHandle
from rewind.engine.request import (
    EngineError,
    EngineStoppedError,
    Event,
    FinishEvent,
    GenerationRequest,
    InvalidRequestError,
    QueueFullError,
    SamplingParams,
    TokenEvent,
    Usage,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "EngineStoppedError",
    "Event",
    "FinishEvent",
    "GenerationRequest",
    "InvalidRequestError",
    "QueueFullError",
    "RequestHandle",
    "SamplingParams",
    "TokenEvent",
    "Usage",
]
