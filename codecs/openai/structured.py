"""``response_format`` and vLLM's ``structured_outputs``, translated into the core's :class:`Structured`.

OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) and
``json_schema`` (JSON valid under ``json_schema.schema``). vLLM's ``structured_outputs``: one of
``json`` (a schema, as an object or as JSON text), ``regex``, ``choice``, ``grammar`` (EBNF) or
``json_object``; its options that change the output are accepted only at their defaults.
The sizes are the core's to check (:meth:`~prismgate.core.budget.RequestBudget.check_structured`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prismgate.codecs.openai.errors import bad_request
from prismgate.core.errors import GatewayError
from prismgate.core.structured import Kind, Structured, json_schema

# structured_outputs options and the values that ask for nothing beyond vLLM's defaults
_NEUTRAL_OPTIONS: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (False,),
    "disable_any_whitespace": (False, True),  # whitespace is compact here either way
    "disable_additional_properties": (False,),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
    "backend": (None,),  # vLLM's own field, set by its server, never by a client
    "_backend": (None,),
    "_backend_was_auto": (None, False),
}
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


def read_structured(body: Mapping[str, Any]) -> Structured | None:
    """The request's constraint, from ``response_format`` or ``structured_outputs`` (not both)."""
    fmt = _response_format(body.get("response_format"))
    outputs = _structured_outputs(body.get("structured_outputs"))
    if fmt is not None and outputs is not None:
        raise bad_request("send either 'response_format' or 'structured_outputs', not both", "structured_outputs")
    return fmt or outputs


def _response_format(value: Any) -> Structured | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(Kind.JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("'response_format.json_schema' must be an object with a 'schema'", "response_format")
        schema = spec.get("schema")
        if schema is None:
            raise bad_request("'response_format.json_schema.schema' is required", "response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("'response_format.json_schema.strict' must be a boolean", "response_format")
        return _built(lambda: json_schema(schema), "response_format")
    raise bad_request(
        "'response_format.type' must be 'text', 'json_object' or 'json_schema'"
        + (f", got {kind!r}" if isinstance(kind, str) else ""),
        "response_format",
    )


def _structured_outputs(value: Any) -> Structured | None:
    if value is None:
        return None
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(f"'{where}' must be an object", where)
    for name, item in value.items():
        if name in _CONSTRAINTS:
            continue
        if name not in _NEUTRAL_OPTIONS:
            raise bad_request(f"'{where}.{name}' is not a structured-output option this server knows", where)
        if not any(item == n and isinstance(item, bool) == isinstance(n, bool) for n in _NEUTRAL_OPTIONS[name]):
            raise bad_request(f"'{where}.{name}' is not supported by this server (see docs/openai.md)", where)
    asked = [n for n in _CONSTRAINTS if value.get(n) not in (None, False)]
    if len(asked) != 1:
        raise bad_request(
            f"'{where}' must set exactly one of {', '.join(_CONSTRAINTS)}"
            + (f"; it sets {', '.join(asked)}" if asked else ""),
            where,
        )
    name = asked[0]
    item = value[name]
    if name == "json_object":
        if item is not True:
            raise bad_request(f"'{where}.json_object' must be true", where)
        return Structured(Kind.JSON_OBJECT)
    if name == "json":
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except ValueError:
                raise bad_request(f"'{where}.json' is not valid JSON", where) from None
        return _built(lambda: json_schema(item), where)
    if name == "choice":
        if not isinstance(item, list) or not all(isinstance(c, str) for c in item):
            raise bad_request(f"'{where}.choice' must be an array of strings", where)
        return _built(lambda: Structured(Kind.CHOICE, choices=tuple(item)), where)
    if not isinstance(item, str):
        raise bad_request(f"'{where}.{name}' must be a string", where)
    return _built(lambda: Structured(Kind(name), item), where)


def _built(make: Any, param: str) -> Structured:
    try:
        result: Structured = make()
    except GatewayError as exc:
        raise bad_request(exc.message, param) from None
    return result
