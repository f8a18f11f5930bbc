"""Structured outputs: a grammar the generated text must follow, as a generation option.

A :class:`Structured` says what the answer must be: any JSON object, JSON valid under a
schema, a match of a regular expression, one of a list of strings, or a sentence of an
EBNF grammar. Codecs build it from their wire fields; engines turn it into a token mask
(the transformers engine, with llguidance) or into their own structured-output parameters
(vLLM). Its size is checked by the request budget before any engine compiles it
(:meth:`~prismgate.core.budget.RequestBudget.check_structured`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from prismgate.core.errors import Code, GatewayError, invalid

MAX_CHOICES = 1024  # strings in a choice constraint; each becomes an alternative of the grammar


class Kind(enum.StrEnum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # JSON valid under ``source`` (a JSON Schema, as JSON text)
    REGEX = "regex"  # a full match of ``source``
    CHOICE = "choice"  # exactly one of ``choices``
    GRAMMAR = "grammar"  # a sentence of ``source``, an EBNF (GBNF, root rule ``root``) or Lark grammar


@dataclass(frozen=True, slots=True)
class Structured:
    """What the generated text must be; ``source`` is the schema, regex or grammar text (empty for the others)."""

    kind: Kind
    source: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind is Kind.CHOICE:
            if not self.choices:
                raise invalid("a choice constraint needs at least one string")
            if len(self.choices) > MAX_CHOICES:
                raise invalid(f"a choice constraint holds {len(self.choices)} strings; the limit is {MAX_CHOICES}")
        elif self.kind is not Kind.JSON_OBJECT and not self.source:
            raise invalid(f"a {self.kind.value} constraint needs its {self.kind.value} text")

    @property
    def size(self) -> int:
        """UTF-8 bytes of what a grammar compiler reads: the schema, regex or grammar, or the choices."""
        if self.kind is Kind.CHOICE:
            return sum(len(c.encode("utf-8", "surrogatepass")) + 1 for c in self.choices)
        return len(self.source.encode("utf-8", "surrogatepass"))

    @property
    def schema(self) -> dict[str, object] | None:
        """The JSON schema of a JSON_SCHEMA constraint, parsed (its text was checked to be an object)."""
        if self.kind is not Kind.JSON_SCHEMA:
            return None
        value = json.loads(self.source)
        assert isinstance(value, dict)
        return value


class GrammarRefused(GatewayError):
    """An engine could not compile a request's constraint (invalid, over its limits, or too slow): INVALID_ARGUMENT."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.INVALID_ARGUMENT, message)


def json_schema(schema: object) -> Structured:
    """A JSON_SCHEMA constraint from a schema a client sent (an object, or ``true`` for any JSON)."""
    if schema is True:
        return Structured(Kind.JSON_SCHEMA, "{}")
    if not isinstance(schema, dict):
        raise invalid("a JSON schema must be an object")
    return Structured(Kind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False, separators=(",", ":")))
