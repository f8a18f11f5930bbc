"""``prismgate generate``: the embedded engine once, from the shell, through the same core."""

from __future__ import annotations

import argparse
import sys

from prismgate.compose import build_service
from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
from prismgate.core.events import Done, TokenEvent
from prismgate.settings import Settings


async def run(settings: Settings, args: argparse.Namespace) -> int:
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
        want_readouts = bool(args.readouts and manifest is not None)
        if args.readouts and manifest is None:
            print("note: no concept pack is loaded, so there are no readouts", file=sys.stderr)
        horizon = len(prompt) + args.max_tokens
        spec = GenerateSpec(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            readout_ranges=(PositionRange(len(prompt), horizon),) if want_readouts else (),
            logprob_ranges=(PositionRange(len(prompt), horizon),) if want_readouts else (),
        )
        action = GenerateAction(append_tokens=tuple(prompt), spec=spec, detokenize=True, origin="cli")
        if want_readouts and manifest is not None:
            layer = len(manifest.layers) // 2
            print(f"readouts at layer {manifest.layers[layer]}: " + "  ".join(manifest.concepts))
        async for event in service.run(action):
            if isinstance(event, TokenEvent) and not event.is_prefill:
                if want_readouts and event.readout is not None:
                    values = " ".join(f"{v:+6.2f}" for v in event.readout[layer])
                    lp = f"{event.logprob:6.2f}" if event.logprob is not None else "      "
                    print(f"{event.position:5d} {tokenizer.token_text(event.id)!r:>14} lp {lp} | {values}")
                else:
                    sys.stdout.write(event.text or "")
                    sys.stdout.flush()
            elif isinstance(event, Done):
                if not want_readouts:
                    sys.stdout.write((event.text or "") + "\n")
                print(
                    f"[{event.completion_tokens} tokens, finish {event.finish_reason.value}]",
                    file=sys.stderr,
                )
        return 0
    finally:
        await service.pool.close()
