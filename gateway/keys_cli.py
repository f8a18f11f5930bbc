"""``prismgate keys``: make a named key, append its hash to the keys file, print the key once."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from prismgate.core.errors import GatewayError
from prismgate.core.principal import Principal
from prismgate.keys import add_key, parse_file

FILE_ENV = "PRISMGATE_KEYS_FILE"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prismgate keys", description="Named API keys (docs/keys.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser(
        "add", help="Make a new key, append its SHA-256 to the keys file and print the key (only this once)."
    )
    add.add_argument("name", help="The key's name: in logs, metrics and session ownership (letters, digits, _.-).")
    listing = commands.add_parser("list", help="The keys in the file: names and permissions, never a key.")
    for sub in (add, listing):
        sub.add_argument(
            "--file", default=os.environ.get(FILE_ENV), help=f"The keys file (default: ${FILE_ENV}); add creates it."
        )
    add.add_argument("--models", help="Comma-separated model names the key may use (default: every model).")
    for flag, what in (
        ("steer", "steer"),
        ("readouts", "read concept readouts"),
        ("logprobs", "read logprobs"),
        ("playground", "use the playground"),
    ):
        add.add_argument(f"--no-{flag}", dest=flag, action="store_false", help=f"The key may not {what}.")
    add.add_argument("--admin", action="store_true", help="The key may list and close every key's sessions.")
    add.add_argument("--max-concurrent", type=int, default=0, help="Generations at once (0: no limit).")
    add.add_argument("--tokens-per-minute", type=int, default=0, help="Prompt plus generated tokens a minute.")
    add.add_argument("--weight", type=float, default=1.0, help="Share of a saturated pool, relative to other keys.")
    args = parser.parse_args(argv)
    if not args.file:
        parser.error(f"say which keys file: --file PATH or ${FILE_ENV}")
    path = Path(args.file)
    try:
        if args.command == "list":
            for entry in parse_file(path.read_text(), str(path)):
                print(describe(entry.principal))
            return 0
        key = add_key(path, args.name, _options(args))
    except (GatewayError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(key)
    print(f"added key {args.name!r} to {path}; the key is shown only now (the file keeps its hash)", file=sys.stderr)
    return 0


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The table's fields that differ from the defaults."""
    options: dict[str, Any] = {}
    if args.models:
        options["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    for flag in ("steer", "readouts", "logprobs", "playground"):
        if not getattr(args, flag):
            options[flag] = False
    if args.admin:
        options["admin"] = True
    for limit in ("max_concurrent", "tokens_per_minute"):
        if getattr(args, limit):
            options[limit] = getattr(args, limit)
    if args.weight != 1.0:
        options["weight"] = args.weight
    return options


def describe(principal: Principal) -> str:
    """One line: the name, models, permissions, limits and weight (never the key or its hash)."""
    p = principal
    models = "every model" if p.models is None else ",".join(sorted(p.models))
    may = [flag for flag in ("steer", "readouts", "logprobs", "playground", "admin") if getattr(p, flag)]
    limits = [f"{limit}={getattr(p, limit)}" for limit in ("max_concurrent", "tokens_per_minute") if getattr(p, limit)]
    return "  ".join([p.name, models, "may " + (",".join(may) or "nothing more"), *limits, f"weight={p.weight:g}"])
