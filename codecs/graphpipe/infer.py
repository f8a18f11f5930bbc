"""Run a batch: each row is one ephemeral generation, all rows at once through the shared pool.

The pool's admission control decides how many rows really run together (shared with
every other protocol); this module only fans out, collects, and fails the whole request
with the first row's error (by row index) once any row fails, cancelling the others.
"""

from __future__ import annotations

import asyncio
import logging
import math

from prismgate.codecs.graphpipe.outputs import RowResult
from prismgate.codecs.graphpipe.plan import Plan
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import TokenEvent
from prismgate.core.service import SessionService
from prismgate.core.turns import Turn

log = logging.getLogger(__name__)


async def run_row(service: SessionService, index: int, turn: Turn) -> RowResult:
    result = RowResult()
    try:
        async for event in service.run_turn(turn):
            if isinstance(event, TokenEvent):
                if event.is_prefill:
                    continue
                result.ids.append(event.id)
                result.logprobs.append(math.nan if event.logprob is None else event.logprob)
                result.top.append(event.top_logprobs or [])
                result.readouts.append(event.readout)
                result.features.append(event.features)
                if event.text:
                    result.text.append(event.text)
            elif event.text:
                result.text.append(event.text)
    except GatewayError as exc:
        raise exc.within(f"row {index}") from exc
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        log.exception("graphpipe row %d failed", index)
        raise GatewayError(Code.INTERNAL, f"row {index}: internal error: {type(exc).__name__}: {exc}") from exc
    return result


async def run_plan(service: SessionService, plan: Plan) -> list[RowResult]:
    tasks = [
        asyncio.create_task(run_row(service, i, turn), name=f"graphpipe-row-{i}") for i, turn in enumerate(plan.turns)
    ]
    try:
        if tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        errors = [t.exception() for t in tasks if t.done() and not t.cancelled()]  # marks each one retrieved
        first = next((e for e in errors if e is not None), None)  # the lowest failing row decides the error
        if first is not None:
            raise first
        return [task.result() for task in tasks]
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
