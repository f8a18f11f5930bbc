"""``prismgate generate``: the model once, from the shell, through the same core the server runs.

With ``--readouts`` every generated token gets one table row: its position, text and logprob,
then the chosen concepts at the chosen layers, each **minus the concept's center** (the value a
reader should look at: above zero leans to the concept's positive side) when the pack has
centers. Only the settings that load and run a model are flags here; the server's are not.
"""

from __future__ import annotations

import argparse
import sys

from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
from prismgate.core.engine import ReadoutManifest
from prismgate.core.events import Done, TokenEvent
from prismgate.engines.readouts.pack import PREFERRED_VIEW_LAYER, ConceptPack
from prismgate.engines.readouts.table import Columns, ReadoutTable
from prismgate.settings import Settings
from prismgate.settings.flags import add_arguments

# The settings that change what `generate` loads or how it runs the model.
SETTINGS = (
    "engine",
    "model",
    "model_name",
    "concept_pack",
    "device",
    "dtype",
    "threads",
    "max_model_len",
    "prefill_chunk",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "vllm_block_size",
    "log_level",
    "log_json",
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    gen = commands.add_parser(
        "generate",
        help="Run the model once on a prompt and stream the answer.",
        description="Run the model once on a prompt and stream the answer (no server). "
        "With --readouts, one row per token: logprob and concept readouts minus each concept's center.",
    )
    gen.add_argument("prompt", help="The user message (sent through the model's chat template).")
    gen.add_argument("--max-tokens", type=int, default=128, help="Decode budget (default 128).")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default).")
    gen.add_argument("--seed", type=int, default=None, help="Sampling seed.")
    gen.add_argument("--raw", action="store_true", help="Send the prompt as plain text, without the chat template.")
    gen.add_argument("--readouts", action="store_true", help="Print a table: one row of concept readouts per token.")
    gen.add_argument(
        "--layers",
        metavar="L,L",
        help=f"Readout layers to show, model layer numbers from the pack or 'all' "
        f"(default: {PREFERRED_VIEW_LAYER} when the pack has it, else its middle layer).",
    )
    gen.add_argument("--concepts", metavar="NAME,NAME", help="Concepts to show, by name (default: all).")
    # Settings.add_arguments defines every setting; generate takes only the ones it uses, so its
    # --help lists no server flags (argparse's own `parents=` copies actions the same way).
    every = argparse.ArgumentParser(add_help=False)
    add_arguments(every)
    for action in every._actions:
        if action.dest in SETTINGS or action.dest == "config":
            gen._add_action(action)
    return gen


def pack_manifest(settings: Settings) -> ReadoutManifest | None:
    """The concept pack's manifest, read from its file before any model loads (None: no pack, or not built yet)."""
    from prismgate.compose import (
        concept_pack_for,
    )  # here: the composition imports torch, which --help must not wait for

    path = concept_pack_for(settings, served_default=not settings.engine.model)
    return ConceptPack.load(path).manifest if path is not None and path.exists() else None


async def run(settings: Settings, args: argparse.Namespace) -> int:
    early = pack_manifest(settings) if args.readouts else None
    if early is not None:
        Columns.choose(early, args.layers, args.concepts)  # a misspelt concept or layer: refused before the model loads
    from prismgate.compose import build_service

    service = build_service(settings)
    await service.pool.start()
    try:
        info = service.info()
        tokenizer = info.tokenizer
        if args.raw:
            prompt = tokenizer.encode(args.prompt)
        else:
            prompt = tokenizer.render_chat([{"role": "user", "content": args.prompt}])
        manifest = info.readouts
        table = None
        if args.readouts and manifest is None:
            print("note: no concept pack is loaded, so there are no readouts", file=sys.stderr)
        elif args.readouts and manifest is not None:
            table = ReadoutTable(manifest, Columns.choose(manifest, args.layers, args.concepts))
        horizon = len(prompt) + args.max_tokens
        wanted = (PositionRange(len(prompt), horizon),) if table is not None else ()
        spec = GenerateSpec(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            readout_ranges=wanted,
            logprob_ranges=wanted,
        )
        action = GenerateAction(append_tokens=tuple(prompt), spec=spec, detokenize=True, origin="cli")
        if table is not None:
            print("\n".join(table.header()))
        answer = []
        async for event in service.run(action):
            if isinstance(event, TokenEvent) and not event.is_prefill:
                answer.append(event.text or "")
                if table is not None and event.readout is not None:
                    print(table.row(event.position, tokenizer.token_text(event.id), event.logprob, event.readout))
                elif table is None:
                    sys.stdout.write(event.text or "")
                    sys.stdout.flush()
            elif isinstance(event, Done):
                if table is None:
                    sys.stdout.write((event.text or "") + "\n")
                else:
                    print(f"answer: {''.join(answer)}{event.text or ''}")
                print(
                    f"[{event.completion_tokens} tokens, finish {event.finish_reason.value}]",
                    file=sys.stderr,
                )
        return 0
    finally:
        await service.pool.close()
