"""Options given as a dict (the Python API) or as a JSON object (the command line)."""

from __future__ import annotations

import json


def json_object(value, name: str) -> dict:
    """`value` as a dict: a dict as given, a str parsed as JSON; anything else, or JSON that is not
    an object, is a ValueError naming the option `name`."""
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return dict(parsed)
