"""The ``prismgate`` command: serve, generate, concepts."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from prismgate.core.errors import GatewayError
from prismgate.settings import add_arguments, from_arguments


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["concepts"]:
        from prismgate.engines.readouts.cli import main as concepts_main

        return concepts_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="prismgate",
        description="One model, many protocols, and a look inside: GraphPipe, Evergreen, Salience and an "
        "OpenAI-compatible API over one engine pool, with per-token concept readouts.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="Serve the model over every protocol (HTTP and gRPC).")
    add_arguments(serve)
    gen = commands.add_parser("generate", help="Run the model once on a prompt and stream the answer.")
    gen.add_argument("prompt", help="The user message (sent through the model's chat template).")
    gen.add_argument("--max-tokens", type=int, default=128, help="Decode budget (default 128).")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default).")
    gen.add_argument("--seed", type=int, default=None, help="Sampling seed.")
    gen.add_argument("--readouts", action="store_true", help="Print a compact concept readout per token.")
    gen.add_argument("--raw", action="store_true", help="Send the prompt as plain text, without the chat template.")
    add_arguments(gen)
    commands.add_parser("concepts", help="Build or inspect concept packs (prismgate concepts --help).")
    args = parser.parse_args(argv)
    try:
        settings = from_arguments(args)
    except GatewayError as exc:
        parser.error(exc.message)
    from prismgate import logs

    logs.configure(settings)
    if args.command == "serve":
        from prismgate.server import serve as run_server

        return run_server(settings)
    from prismgate.generate import run as run_generate

    try:
        return asyncio.run(run_generate(settings, args))
    except GatewayError as exc:
        print(f"error: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
