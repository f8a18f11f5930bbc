"""The settings as command-line flags and as the documentation's table, group by group."""

from __future__ import annotations

import argparse

from prismgate.settings import ENV_PREFIX, GROUPS, Settings, Spec
from prismgate.settings.fields import ConfigError


def sections() -> list[tuple[str, list[Spec]]]:
    """``--help``'s sections and the table's: one per settings group, in Settings' order."""
    return [(group.title, [s for s in Settings.fields() if s.group == attr]) for attr, group in GROUPS.items()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting, its help naming the env var and the default, one section per group."""
    parser.add_argument("--config", help=f"TOML file of settings ({ENV_PREFIX}CONFIG).")
    for title, specs in sections():
        group = parser.add_argument_group(title)
        for spec in specs:
            text = f"{spec.help} [env {spec.env}; default {spec.default!r}]".replace("%", "%%")
            if spec.kind is bool:
                group.add_argument(
                    spec.flag, dest=spec.name, action=argparse.BooleanOptionalAction, default=None, help=text
                )
            else:
                group.add_argument(
                    spec.flag, dest=spec.name, type=spec.kind, default=None, choices=spec.choices, help=text
                )


def from_arguments(args: argparse.Namespace) -> Settings:
    """The settings of a parsed command line (its flags over the environment over ``--config``)."""
    overrides = {s.name: getattr(args, s.name, None) for s in Settings.fields()}
    return Settings.load(overrides, config_file=getattr(args, "config", None))


def markdown_table() -> str:
    """docs/configuration.md's tables, one per group, generated so they cannot drift."""
    parts = []
    for title, specs in sections():
        rows = [f"### {title[:1].upper()}{title[1:]}", ""]
        rows += ["| flag | environment variable | TOML key | default | meaning |", "|---|---|---|---|---|"]
        rows += [f"| `{s.flag}` | `{s.env}` | `{s.name}` | `{s.default!r}` | {s.help} |" for s in specs]
        parts.append("\n".join(rows))
    return "\n\n".join(parts)


__all__ = ["ConfigError", "add_arguments", "from_arguments", "markdown_table", "sections"]
