"""What rank 0 sends the other ranks before each engine step (its StepInputs): the requests submitted since the
last step, the ones cancelled, and whether to stop. The scheduler is deterministic given its
queue, its cancellations and the logits (the same on every rank), so with these every rank's
scheduler takes the same decisions and issues the same forward calls.

JSON, not pickle: a plan crosses the network between hosts under `mlx.launch --hosts`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from rewind.cache.blocks import BlockExtras
from rewind.engine.request import GenerationRequest, InvalidRequestError, SamplingParams


@dataclass
class StepInputs:
    submitted: list[GenerationRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # request ids
    stop: bool = False

    def encode(self) -> bytes:
        return json.dumps({"submitted": [_request_dict(r) for r in self.submitted],
                           "cancelled": self.cancelled, "stop": self.stop}).encode()

    @classmethod
    def decode(cls, data: bytes) -> "StepInputs":
        body = json.loads(data)
        return cls([_request_from(r) for r in body["submitted"]], list(body["cancelled"]),
                   bool(body["stop"]))


def check_replayable(request: GenerationRequest) -> None:
    """Requests whose inputs are callables (image embeddings, positions, residuals) cannot be
    sent to the other ranks: sharded serving takes text only."""
    if (request.embed is not None or request.positions is not None
            or request.layer_residuals is not None or request.model_tokens is not None):
        raise InvalidRequestError("images are not supported when the model is sharded over "
                                  "several processes; send text only")
    if request.extras is not None and getattr(request.extras, "image_hashes", None):
        raise InvalidRequestError("images are not supported when the model is sharded")


def _request_dict(request: GenerationRequest) -> dict[str, Any]:
    params = dataclasses.asdict(request.params)
    if params["logit_bias"] is not None:  # JSON keys are strings
        params["logit_bias"] = [[int(k), float(v)] for k, v in params["logit_bias"].items()]
    salt = request.extras.salt if request.extras is not None else None
    return {"id": request.request_id, "prompt": request.prompt_tokens, "params": params,
            "checkpoints": request.checkpoints, "salt": salt, "grammar": request.grammar}


def _request_from(body: dict[str, Any]) -> GenerationRequest:
    params = dict(body["params"])
    if params["logit_bias"] is not None:
        params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"]}
    extras = BlockExtras(salt=body["salt"]) if body["salt"] is not None else None
    return GenerationRequest(prompt_tokens=list(body["prompt"]),
                             params=SamplingParams(**params),
                             checkpoints=list(body["checkpoints"]), extras=extras,
                             grammar=body["grammar"], request_id=body["id"])
