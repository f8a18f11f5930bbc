"""Benchmark 3: a growing conversation sent as deltas through a session vs resent whole each turn.

    .venv/bin/python -m bench.sessions [--quick] [--model tiny|smollm2]

Over Salience gRPC, one conversation grows turn by turn: the user adds ``--chunk`` tokens,
the model answers ``--answer`` tokens. Two clients play the same conversation, turn by
turn interleaved:

* ``session``: one session; each turn sends only the new user tokens (``offset`` + append);
* ``resend``: a new session each turn carrying the whole conversation so far (what a
  stateless API does), then closed.

Per turn: request and response bytes (protobuf payloads, without HTTP/2 framing), tokens the
engine prefilled (the engine's own counter), and turn latency. Reported at the turns where
the conversation passes 1K, 4K and 16K tokens, and in total.

Model: ``tiny`` (default) is the tests' tiny random Llama built with a 20K context
(``max_position_embeddings=20480``), so all three sizes fit; ``smollm2`` is the embedded
SmolLM2-135M-Instruct (8K context: 1K and 4K only).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Server, serve, settings, table, tiny_model, write_results


class Conversation:
    def __init__(self, stub: Any, pb: Any, model: str) -> None:
        self.stub, self.pb, self.model = stub, pb, model

    async def turn(self, session_id: str, offset: int, append: list[int], answer: int) -> tuple[list[int], int, int]:
        request = self.pb.GenerateRequest(
            session_id=session_id, offset=offset, append_tokens=append, max_tokens=answer, top_k=1
        )
        received = 0
        ids: list[int] = []
        async for event in self.stub.Generate(request):
            received += event.ByteSize()
            if event.HasField("token"):
                ids.append(event.token.id)
        return ids, request.ByteSize(), received


async def run(server: Server, args: argparse.Namespace) -> list[dict[str, Any]]:
    import grpc

    from prismgate.schemas import salience_pb2 as pb
    from prismgate.schemas import salience_pb2_grpc

    engine = server.engine
    model = server.service.info().model_id
    limit = server.service.info().max_model_len
    targets = [t for t in args.targets if t + args.chunk + args.answer <= limit]
    rng = random.Random(0)
    async with grpc.aio.insecure_channel(server.grpc_target, options=[("grpc.max_receive_message_length", -1)]) as ch:
        stub = salience_pb2_grpc.SalienceStub(ch)
        conv = Conversation(stub, pb, model)
        sid = (await stub.OpenSession(pb.OpenSessionRequest(model=model))).session_id
        timeline: list[int] = []
        rows: list[dict[str, Any]] = []
        totals = {m: {"sent": 0, "received": 0, "prefilled": 0, "seconds": 0.0} for m in ("session", "resend")}
        pending = list(targets)
        turn = 0
        while pending:
            append = [rng.randrange(32, 127) for _ in range(args.chunk)]
            measured: dict[str, dict[str, Any]] = {}
            for mode in ("session", "resend") if turn % 2 == 0 else ("resend", "session"):
                before = engine.stats["prefilled_tokens"]
                t0 = time.perf_counter()
                if mode == "session":
                    ids, sent, received = await conv.turn(sid, len(timeline), append, args.answer)
                    session_ids = ids
                else:
                    fresh = (await stub.OpenSession(pb.OpenSessionRequest(model=model))).session_id
                    ids, sent, received = await conv.turn(fresh, 0, timeline + append, args.answer)
                    await stub.CloseSession(pb.CloseSessionRequest(session_id=fresh))
                seconds = time.perf_counter() - t0
                prefilled = engine.stats["prefilled_tokens"] - before
                measured[mode] = {"sent": sent, "received": received, "prefilled": prefilled, "seconds": seconds}
                for k, v in measured[mode].items():
                    totals[mode][k] += v
            timeline += append + session_ids
            turn += 1
            while pending and len(timeline) >= pending[0]:
                target = pending.pop(0)
                s, r = measured["session"], measured["resend"]
                row = {
                    "context": target,
                    "turn": turn,
                    "tokens": len(timeline),
                    "session_bytes_sent": s["sent"],
                    "resend_bytes_sent": r["sent"],
                    "bytes_ratio": r["sent"] / s["sent"],
                    "session_prefilled": s["prefilled"],
                    "resend_prefilled": r["prefilled"],
                    "prefill_ratio": r["prefilled"] / max(1, s["prefilled"]),
                    "session_turn_ms": s["seconds"] * 1e3,
                    "resend_turn_ms": r["seconds"] * 1e3,
                    "latency_ratio": r["seconds"] / s["seconds"],
                }
                for mode in ("session", "resend"):
                    for k, v in totals[mode].items():
                        row[f"{mode}_total_{k}"] = v
                rows.append(row)
                print(table([row], COLUMNS), flush=True)
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return rows


COLUMNS = (
    "context",
    "turn",
    "session_bytes_sent",
    "resend_bytes_sent",
    "bytes_ratio",
    "session_prefilled",
    "resend_prefilled",
    "session_turn_ms",
    "resend_turn_ms",
    "latency_ratio",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bigger turns, so fewer of them")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--chunk", type=int, default=None, help="user tokens added per turn (128; quick 512)")
    parser.add_argument("--answer", type=int, default=16, help="tokens the model answers per turn")
    parser.add_argument("--targets", default="1024,4096,16384")
    args = parser.parse_args(argv)
    args.chunk = args.chunk or (512 if args.quick else 128)
    args.targets = sorted(int(t) for t in args.targets.split(","))
    if args.model == "tiny":
        model_dir, _ = tiny_model(20480)
        config = settings(model=str(model_dir), model_name="tiny-llama-20k", concept_pack="none")
    else:
        config = settings(concept_pack="none")
    with serve(config) as server:
        rows = asyncio.run(run(server, args))
    path = write_results(
        "sessions",
        {
            "quick": args.quick,
            "model": args.model,
            "chunk": args.chunk,
            "answer": args.answer,
            "rows": rows,
        },
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
