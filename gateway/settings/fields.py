"""One setting's declaration and its conversion from what a user wrote, with the source named.

A setting is a field of a group (a small frozen dataclass, see :mod:`.groups`); its public
name, the one flags, environment variables and TOML keys use, is the group's prefix plus the
field's name unless the field says otherwise. Types and bounds are the field's annotation
(``Annotated[int, Meta(ge=0)]``); msgspec checks them, so a bound is written once.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

ENV_PREFIX = "PRISMGATE_"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


class ConfigError(Exception):
    """A configuration mistake: which setting, where it came from, what is wrong (reported at start)."""

    def __init__(self, name: str | None, message: str, source: str | None = None) -> None:
        super().__init__(message)
        self.name, self.message, self.source = name, message, source

    def with_source(self, source: str) -> ConfigError:
        """This error, naming ``source`` unless it already names one."""
        return self if self.source else ConfigError(self.name, self.message, source)

    def __str__(self) -> str:
        where = f" ({self.source})" if self.source else ""
        return (
            f"{self.name}{where}: {self.message}" if self.name else f"{self.source or 'configuration'}: {self.message}"
        )


def setting(
    default: Any, help: str, *, choices: Sequence[str] | None = None, prefixed: bool = True, engine_kwarg: bool = True
) -> Any:
    """A field of a settings group. ``prefixed=False``: the public name is the field's name alone;
    ``engine_kwarg=False``: an engine option the gateway uses itself, not passed to the engine."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "prefixed": prefixed}
    return field(default=default, metadata=metadata | {"engine_kwarg": engine_kwarg})


class Group:
    """Base of the settings groups: their ``--help`` section and the prefix of their public names."""

    title: ClassVar[str]
    prefix: ClassVar[str] = ""
    per_model: ClassVar[bool] = False  # a [[models]] entry may set every field of the group

    def engine_kwargs(self) -> dict[str, Any]:
        """The fields an engine takes as keyword arguments of the same names."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["engine_kwarg"]}  # type: ignore[arg-type]


@dataclass(frozen=True)
class Spec:
    """One setting as users see it: public name, its place in Settings, type, default and help."""

    name: str
    group: str
    attr: str
    hint: Any  # the field's annotation (Annotated bounds included)
    kind: type  # what a flag or an environment variable is parsed as: str, int, float or bool
    default: Any
    help: str
    choices: tuple[str, ...] | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def convert(self, value: Any, source: str) -> Any:
        """``value`` (from TOML, a flag or code) checked against the type, bounds and choices."""
        try:
            value = msgspec.convert(value, self.hint, strict=True)
        except msgspec.ValidationError as exc:
            reason = str(exc).replace("`", "").split(" - at ")[0]
            raise ConfigError(self.name, f"{value!r} is not valid: {reason[:1].lower()}{reason[1:]}", source) from None
        if self.choices and value is not None and value not in self.choices:
            raise ConfigError(self.name, f"{value!r} is not one of {', '.join(self.choices)}", source)
        return value

    def parse(self, raw: str, source: str) -> Any:
        """An environment variable's text, parsed and checked."""
        text = raw.strip()
        try:
            if self.kind is bool:
                if text.lower() not in TRUE_WORDS | FALSE_WORDS:
                    raise ValueError(raw)
                value: Any = text.lower() in TRUE_WORDS
            else:
                value = self.kind(raw if self.kind is str else text)
        except ValueError:
            raise ConfigError(self.name, f"{raw!r} is not a valid {self.kind.__name__}", source) from None
        return self.convert(value, source)


def group_specs(attr: str, group: type[Group]) -> list[Spec]:
    """The settings of ``group``, held by ``Settings`` under ``attr``."""
    hints = typing.get_type_hints(group, include_extras=True)
    specs = []
    for f in dataclasses.fields(group):  # type: ignore[arg-type]
        name = (group.prefix if f.metadata["prefixed"] else "") + f.name
        specs.append(
            Spec(
                name,
                attr,
                f.name,
                hints[f.name],
                _kind(hints[f.name]),
                f.default,
                f.metadata["help"],
                f.metadata["choices"],
            )
        )
    return specs


@functools.cache
def _kind(hint: Any) -> type:
    """The plain type under ``Optional`` and ``Annotated``."""
    if typing.get_origin(hint) is typing.Annotated:
        return _kind(typing.get_args(hint)[0])
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _kind(inner)
    return typing.cast(type, hint)
