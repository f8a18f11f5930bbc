"""Typed reads of JSON request fields, each failure a 400 that names the field.

JSON has one number type and Python's ``bool`` is an ``int``; these helpers keep
``true`` from passing as ``1`` and ``1.5`` from passing as a token count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, overload

from prismgate.codecs.openai.errors import bad_request


@overload
def get_bool(body: Mapping[str, Any], name: str, default: bool, *, path: str | None = None) -> bool: ...


@overload
def get_bool(body: Mapping[str, Any], name: str, default: None, *, path: str | None = None) -> bool | None: ...


def get_bool(body: Mapping[str, Any], name: str, default: bool | None, *, path: str | None = None) -> bool | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{path or name}' must be a boolean, got {_kind(value)}", path or name)
    return value


def get_int(
    body: Mapping[str, Any],
    name: str,
    default: int | None,
    *,
    lo: int | None = None,
    hi: int | None = None,
    path: str | None = None,
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    where = path or name
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise bad_request(f"'{where}' must be an integer, got {_kind(value)}", where)
    if lo is not None and value < lo:
        raise bad_request(f"'{where}' must be >= {lo}, got {value}", where)
    if hi is not None and value > hi:
        raise bad_request(f"'{where}' must be <= {hi}, got {value}", where)
    return value


def get_float(
    body: Mapping[str, Any], name: str, default: float, *, lo: float, hi: float, path: str | None = None
) -> float:
    value = body.get(name)
    if value is None:
        return default
    where = path or name
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{where}' must be a number, got {_kind(value)}", where)
    if not lo <= value <= hi:
        raise bad_request(f"'{where}' must be between {lo} and {hi}, got {value}", where)
    return float(value)


def get_str(body: Mapping[str, Any], name: str, *, required: bool = False, path: str | None = None) -> str | None:
    value = body.get(name)
    where = path or name
    if value is None:
        if required:
            raise bad_request(f"you must provide a '{where}' parameter", where)
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{where}' must be a string, got {_kind(value)}", where)
    return value


def get_object(body: Mapping[str, Any], name: str, *, path: str | None = None) -> Mapping[str, Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"'{path or name}' must be an object, got {_kind(value)}", path or name)
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
