"""Checks our OpenAI-compatible output against the `openai` SDK's own models (a client we did not write).

`strict` validation: the SDK's models allow unknown fields, so a typo in a field name would pass a plain
parse; here every field we send must be one the SDK knows, at every depth.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is a dev dependency (pip install -e '.[dev]')")
from openai import BaseModel  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402


def _no_extra(value, path: str = "") -> None:
    if isinstance(value, BaseModel):
        extra = value.model_extra or {}
        assert not extra, f"fields the SDK does not know at {path or '<root>'}: {sorted(extra)}"
        for name in type(value).model_fields:
            _no_extra(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_extra(v, f"{path}[{i}]")


def strict(model_type, data):
    """`data` parsed as `model_type` (a model or a union), with no field unknown to the SDK."""
    parsed = TypeAdapter(model_type).validate_python(data)
    _no_extra(parsed)
    return parsed


def server_event(data: dict):
    from openai.types.realtime import RealtimeServerEvent

    event = strict(RealtimeServerEvent, data)
    assert event.type == data["type"]
    return event
