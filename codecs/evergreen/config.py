"""``Action.configs`` -> prismgate's GenerateConfig, in its binary or JSON form.

Two spellings of one thing, so that binary-protobuf clients and JSON clients (browsers)
are served alike:

* ``type.googleapis.com/prismgate.evergreen.v1.GenerateConfig``: the message itself;
* ``type.googleapis.com/google.protobuf.Struct``: a JSON object with the same fields
  (camelCase or snake_case).

Unknown fields are errors in both (a typo must not silently change decoding). Either is
measured before it is decoded: a config larger than any the served models can take (the
budget's ``max_config_bytes``) is refused unread, whatever keys hold its bulk.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from google.protobuf import any_pb2, json_format, struct_pb2, unknown_fields

from prismgate.core.budget import RequestBudget
from prismgate.core.errors import invalid
from prismgate.schemas import evergreen_generate_pb2 as gpb

CONFIG_TYPE_URL = "type.googleapis.com/prismgate.evergreen.v1.GenerateConfig"
STRUCT_TYPE_URL = "type.googleapis.com/google.protobuf.Struct"


def parse_configs(configs: Sequence[any_pb2.Any], where: str, budget: RequestBudget) -> gpb.GenerateConfig:
    """At most one config; an absent one means all defaults."""
    if len(configs) > 1:
        raise invalid(f"{where}: at most one config, got {len(configs)}")
    if not configs:
        return gpb.GenerateConfig()
    packed = configs[0]
    budget.check_config_bytes(len(packed.value), f"{where}: config")
    kind = packed.type_url.rpartition("/")[2]
    if kind == gpb.GenerateConfig.DESCRIPTOR.full_name:
        config = gpb.GenerateConfig()
        try:
            config.ParseFromString(packed.value)
        except Exception as exc:
            raise invalid(f"{where}: GenerateConfig does not decode: {exc}") from None
        extra = unknown_fields.UnknownFieldSet(config)
        if len(extra):
            numbers = sorted({f.field_number for f in extra})
            raise invalid(f"{where}: GenerateConfig has unknown field numbers {numbers}")
        return config
    if kind == struct_pb2.Struct.DESCRIPTOR.full_name:
        struct = struct_pb2.Struct()
        try:
            struct.ParseFromString(packed.value)
            return json_format.ParseDict(json_format.MessageToDict(struct), gpb.GenerateConfig())
        except json_format.ParseError as exc:
            unknown = re.search(r'has no field named "([^"]+)"', str(exc))
            if unknown:
                raise invalid(f"{where}: unknown config field {unknown.group(1)!r}") from None
            raise invalid(f"{where}: config: {str(exc).splitlines()[0]}") from None
        except Exception as exc:
            raise invalid(f"{where}: config Struct does not decode: {exc}") from None
    raise invalid(f"{where}: unknown config type {packed.type_url!r}; use {CONFIG_TYPE_URL} or {STRUCT_TYPE_URL}")
