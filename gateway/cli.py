"""The ``prismgate`` command: serve, generate, concepts, sae, keys."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from prismgate.core.errors import GatewayError
from prismgate.settings import ConfigError
from prismgate.settings.flags import add_arguments, from_arguments


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["concepts"]:
        from prismgate.instruments.packs.cli import main as concepts_main
        from prismgate.quiet import quiet_libraries

        quiet_libraries(debug=False)

        return concepts_main(argv[1:])
    if argv[:1] == ["sae"]:
        from prismgate.instruments.sae.cli import main as sae_main
        from prismgate.quiet import quiet_libraries

        quiet_libraries(debug=False)

        return sae_main(argv[1:])
    if argv[:1] == ["keys"]:
        from prismgate.keys_cli import main as keys_main

        return keys_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="prismgate",
        description="One model, many protocols, and a look inside: GraphPipe, Evergreen, Salience and an "
        "OpenAI-compatible API over one engine pool, with per-token concept readouts.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="Serve the model over every protocol (HTTP and gRPC).",
        usage="prismgate serve [--config TOML] [--FLAG VALUE ...]",
        description="Serve the model over every protocol (HTTP and gRPC). Every flag is also an environment "
        "variable and a TOML key (docs/configuration.md); flags win over the environment, which wins over the file.",
    )
    add_arguments(serve)
    from prismgate.cli_generate import add_parser as add_generate

    add_generate(commands)
    commands.add_parser("concepts", help="Build or inspect concept packs (prismgate concepts --help).")
    commands.add_parser("sae", help="Train or inspect sparse autoencoders (prismgate sae --help).")
    commands.add_parser("keys", help="Make named API keys for the keys file (prismgate keys --help).")
    args = parser.parse_args(argv)
    try:
        settings = from_arguments(args)
    except ConfigError as exc:  # one line naming the setting and where its value came from; no traceback
        print(f"prismgate: error: {exc}", file=sys.stderr)
        return 2
    from prismgate import logs

    logs.configure(settings)
    if args.command == "serve":
        from prismgate.server import serve as run_server

        return run_server(settings)
    from prismgate.cli_generate import run as run_generate

    try:
        return asyncio.run(run_generate(settings, args))
    except GatewayError as exc:
        print(f"error: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
