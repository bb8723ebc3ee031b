"""The request bodies in /openapi.json.

The API routes read their raw bodies themselves (body.py: a size limit before reading, an idle
timeout, JSON that Python accepts but JSON does not), so FastAPI cannot see what they take.
`json_body(Model)` declares it on the route, and `describe_bodies(app)` puts the models' schemas
under components, so clients, SDK generators and fuzzers get a true description.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF_TEMPLATE = "#/components/schemas/{model}"
_BODY_MODELS: list[type[BaseModel]] = []
# Bodies whose `model` names something not served yet (a repo to pull): no enum of served names.
_OPEN_MODEL_FIELD: set[type[BaseModel]] = set()


def json_body(model: type[BaseModel], served_model: bool = True) -> dict[str, Any]:
    """`openapi_extra` for a route whose body is `model`, as JSON; `served_model` False where
    its `model` field is not limited to the names this server serves."""
    if model not in _BODY_MODELS:
        _BODY_MODELS.append(model)
    if not served_model:
        _OPEN_MODEL_FIELD.add(model)
    schema = {"$ref": _REF_TEMPLATE.format(model=model.__name__)}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def describe_bodies(app: FastAPI, served_models: Callable[[], list[str]]) -> None:
    """Wrap `app.openapi` so the document carries every declared body model's schema, with
    `model` limited to the names this server answers to (any other is a 404)."""
    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = plain_openapi()
        _, definitions = models_json_schema([(model, "validation") for model in _BODY_MODELS],
                                            ref_template=_REF_TEMPLATE)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(definitions.get("$defs", {}))
        model_names = {"anyOf": [{"enum": served_models()}, {"type": "null"}]}
        for model in _BODY_MODELS:
            properties = schemas[model.__name__].get("properties", {})
            if "model" in properties and model not in _OPEN_MODEL_FIELD:
                properties["model"] = {**model_names, "title": "Model"}
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
