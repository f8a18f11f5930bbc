"""All configuration: groups of settings, each setting a CLI flag, an env var and a TOML key.

Precedence, lowest first: the defaults in :mod:`.groups`, the TOML file given by ``--config``
(or ``PRISMGATE_CONFIG``), environment variables ``PRISMGATE_<NAME>``, command-line flags.
A new setting is one field of one group; the CLI, the environment and the tables follow.
A mistake is a :class:`ConfigError` naming the setting and where its value came from.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prismgate.settings.fields import ENV_PREFIX, ConfigError, Group, Spec, group_specs
from prismgate.settings.groups import (
    GRPC,
    HTTP,
    Admission,
    Budget,
    Engine,
    Evergreen,
    GraphPipe,
    Instruments,
    Observability,
    OpenAI,
    Security,
    Server,
    Sessions,
    Streams,
    TransformersOptions,
    VLLMOptions,
)

__all__ = ["ENV_PREFIX", "GROUPS", "ConfigError", "ModelConfig", "Settings", "Spec"]

# what a [[models]] entry names with keys of its own, and the settings they stand for
MODEL_KEYS = {"name": "model_name", "model": "model", "engine": "engine"}
MODEL_INSTRUMENTS = ("concept_pack", "sae", "sae_labels")


@dataclass(frozen=True)
class ModelConfig:
    """One ``[[models]]`` table: a served model, its engine and that engine's own options.

    Keys: ``name`` (what clients ask for), ``model`` (a local folder; absent: the embedded
    default model), ``engine``, ``concept_pack``, ``sae``, ``sae_labels``, ``dtype``,
    ``max_model_len`` and any option of either engine's group; what an entry leaves out
    comes from the top-level settings.
    """

    name: str
    values: tuple[tuple[str, Any], ...] = ()  # public setting names -> values, checked
    source: str = field(default="", compare=False)  # "config file F, [[models]] #N": where an error points

    @staticmethod
    def keys() -> tuple[str, ...]:
        """Every key a ``[[models]]`` table may hold (``name`` aside)."""
        engine = ("model", "engine", "dtype", "max_model_len", *MODEL_INSTRUMENTS)
        return (*engine, *(s.name for s in Settings.fields() if GROUPS[s.group].per_model))

    @classmethod
    def parse(cls, table: object, source: str) -> ModelConfig:
        if not isinstance(table, dict):
            raise ConfigError("models", "each [[models]] entry must be a table", source)
        entry = {key.replace("-", "_"): value for key, value in table.items()}
        name = entry.pop("name", None)
        if not isinstance(name, str) or not name.strip() or "/" in name:
            raise ConfigError("name", f"must be a non-empty string without '/', got {name!r}", source)
        unknown = sorted(set(entry) - set(cls.keys()))
        if unknown:
            raise ConfigError(
                None,
                f"model {name!r}: unknown key(s) {', '.join(unknown)}; a model takes name and {', '.join(cls.keys())}",
                source,
            )
        specs = Settings.specs()
        values = {MODEL_KEYS.get(k, k): v for k, v in entry.items()}
        checked = {key: specs[key].convert(value, f"{source}, key {key}") for key, value in values.items()}
        return cls(name, tuple(sorted(checked.items())), source)

    def apply(self, base: Settings) -> Settings:
        """``base`` with this model's choices in place of the top-level engine settings."""
        values = dict(self.values)
        own = {key: values.get(key) for key in ("model", *MODEL_INSTRUMENTS)}  # unset here: unset, not inherited
        settings = base.replace(**{**values, **own, "model_name": self.name, "models": ()})
        try:
            settings.validate()
        except ConfigError as exc:
            raise exc.with_source(self.source) from None
        return settings


@dataclass(frozen=True)
class Settings:
    server: Server = field(default_factory=Server)
    http: HTTP = field(default_factory=HTTP)
    security: Security = field(default_factory=Security)
    sessions: Sessions = field(default_factory=Sessions)
    admission: Admission = field(default_factory=Admission)
    budget: Budget = field(default_factory=Budget)
    engine: Engine = field(default_factory=Engine)
    transformers: TransformersOptions = field(default_factory=TransformersOptions)
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    instruments: Instruments = field(default_factory=Instruments)
    observability: Observability = field(default_factory=Observability)
    openai: OpenAI = field(default_factory=OpenAI)
    graphpipe: GraphPipe = field(default_factory=GraphPipe)
    evergreen: Evergreen = field(default_factory=Evergreen)
    grpc: GRPC = field(default_factory=GRPC)
    streams: Streams = field(default_factory=Streams)
    # several models: TOML only, a list of [[models]] tables (the first is the default); empty: the one
    # model of the engine settings
    models: tuple[ModelConfig, ...] = ()

    @classmethod
    def fields(cls) -> list[Spec]:
        """Every setting (flag, environment variable, TOML key), group by group (``models`` is TOML only)."""
        return list(cls.specs().values())

    @staticmethod
    @functools.cache
    def specs() -> dict[str, Spec]:
        """Every setting by its public name."""
        return {s.name: s for attr, group in GROUPS.items() for s in group_specs(attr, group)}

    def value(self, name: str) -> Any:
        """A setting's value by its public name."""
        spec = self.specs()[name]
        return getattr(getattr(self, spec.group), spec.attr)

    def replace(self, **values: Any) -> Settings:
        """These settings with some replaced, by public name (``models`` too), unchecked."""
        models = values.pop("models", self.models)
        changes: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            spec = self.specs()[name]
            changes.setdefault(spec.group, {})[spec.attr] = value
        groups = {attr: dataclasses.replace(getattr(self, attr), **kw) for attr, kw in changes.items()}
        return dataclasses.replace(self, **groups, models=models)

    def served(self) -> list[Settings]:
        """One engine's settings per served model: each ``[[models]]`` entry, or these settings alone."""
        return [m.apply(self) for m in self.models] or [self]

    @classmethod
    def load(
        cls,
        overrides: Mapping[str, Any] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        config_file: str | None = None,
    ) -> Settings:
        """Settings from the file, then the environment, then ``overrides`` (the flags; None: not given)."""
        env = os.environ if env is None else env
        specs = cls.specs()
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        config_file = config_file or env.get(ENV_PREFIX + "CONFIG")
        if config_file:
            table, models = _read_toml(config_file)
            for key, (name, value) in table.items():
                sources[name] = f"config file {config_file}, key {key}"
                values[name] = specs[name].convert(value, sources[name])
            if models:
                values["models"] = models
        for spec in specs.values():
            raw = env.get(spec.env)
            if raw is not None:
                sources[spec.name] = f"environment variable {spec.env}"
                values[spec.name] = spec.parse(raw, sources[spec.name])
        for name, value in (overrides or {}).items():
            if value is not None:
                sources[name] = f"flag {specs[name].flag}"
                values[name] = specs[name].convert(value, sources[name])
        settings = cls().replace(**values)
        try:
            settings.validate()
        except ConfigError as exc:
            raise exc.with_source(sources.get(exc.name or "", "default")) from None
        return settings

    def validate(self) -> None:
        """Every value's type and bounds, then what settings require of each other."""
        for spec in self.specs().values():
            spec.convert(self.value(spec.name), "")
        engine, sessions = self.engine.engine, self.sessions
        if sessions.store != "memory" and not sessions.store.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("session_store", f"must be 'memory' or a redis:// URL, got {sessions.store!r}")
        if self.admission.reserved_slots >= self.admission.max_active:
            raise ConfigError(
                "reserved_slots",
                f"must be below max_active ({self.admission.max_active}), got {self.admission.reserved_slots}",
            )
        if engine == "vllm" and self.transformers.replicas != 1:
            raise ConfigError("replicas", "must be 1 with the vLLM engine, which has its own (data_parallel_size)")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if engine != "vllm" and self.value(name) != 1:
                raise ConfigError(name, f"must be 1 unless the engine is vllm, got {self.value(name)}")
        address = self.vllm.readout_address
        if address is not None and not re.fullmatch(r"tcp://[^\s:/]+:\d{1,5}", address):
            raise ConfigError("vllm_readout_address", f"must be tcp://HOST:PORT, got {address!r}")
        if self.instruments.sae_labels and not self.instruments.sae:
            raise ConfigError("sae_labels", "names labels for the SAEs in sae: give sae too")
        if self.instruments.sae and self.instruments.sae_labels:
            saes = [x for x in self.instruments.sae.split(",") if x.strip()]
            labels = self.instruments.sae_labels.split(",")
            if len(labels) > len(saes):
                raise ConfigError("sae_labels", f"names {len(labels)} files for {len(saes)} SAEs in sae")
            if any(x.strip().lower() == "auto" for x in saes):
                raise ConfigError(
                    "sae_labels",
                    "cannot be matched to sae = 'auto' (it may load several layers): put labels.json files in the "
                    "SAE folders",
                )
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError("models", f"[[models]] names must be unique, got {', '.join(names)}")
        if self.models and (self.engine.model is not None or self.engine.model_name is not None):
            name = "model" if self.engine.model is not None else "model_name"
            raise ConfigError(name, "give the models either as [[models]] in the config file or as --model, not both")
        for model in self.models:
            model.apply(self)  # each model's own engine settings must be valid too


# Settings' groups by attribute, in order: the --help sections and the tables follow it
GROUPS: dict[str, type[Group]] = {k: v for k, v in typing.get_type_hints(Settings).items() if k != "models"}


def _read_toml(path: str) -> tuple[dict[str, tuple[str, Any]], tuple[ModelConfig, ...]]:
    """The file's settings (its key -> public name and value) and its ``[[models]]``."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(None, "does not exist", f"config file {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(None, str(exc), f"config file {path}") from None
    table = dict(data.get("prismgate", data))
    specs = Settings.specs()
    models: tuple[ModelConfig, ...] = ()
    raw_models = table.pop("models", None)
    if raw_models is not None:
        if not isinstance(raw_models, list) or not raw_models:
            raise ConfigError("models", "must be a non-empty list of [[models]] tables", f"config file {path}")
        models = tuple(
            ModelConfig.parse(m, f"config file {path}, [[models]] #{i + 1}") for i, m in enumerate(raw_models)
        )
    out: dict[str, tuple[str, Any]] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in specs:
            raise ConfigError(None, f"unknown setting {key!r}", f"config file {path}")
        out[key] = (name, value)
    return out, models
