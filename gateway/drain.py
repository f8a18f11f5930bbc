"""The generations in flight, so that shutdown can wait for them, refuse new ones and cut off the rest.

A graceful stop needs three things from one place: to know when nothing is running any
more, to turn new work away once stopping has begun, and, when the grace period is
over, to end what is still running with an error each protocol can report on its own
wire (rather than dropping connections). :class:`Drain` keeps that registry; the
generation observer enters and leaves it around every generation.
"""

from __future__ import annotations

import asyncio

from prismgate.core.errors import Code, GatewayError


class Drain:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.draining = False
        self._in_flight: dict[str, asyncio.Task[object] | None] = {}
        self._cut: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def enter(self, request_id: str) -> None:
        """Register the current task's generation; UNAVAILABLE once draining has begun."""
        if self.draining:
            raise GatewayError(Code.UNAVAILABLE, "the server is shutting down; retry on another replica")
        self._in_flight[request_id] = asyncio.current_task()
        self._idle.clear()

    def leave(self, request_id: str) -> None:
        self._in_flight.pop(request_id, None)
        if not self._in_flight:
            self._idle.set()

    def cut_error(self) -> GatewayError | None:
        """Inside ``except CancelledError``: the error to raise if this cancellation was our cut-off.

        A cancellation from :meth:`cut_off` becomes UNAVAILABLE, so that the codec reports it
        on its wire; any other cancellation (the client went away) stays a cancellation (None).
        """
        task = asyncio.current_task()
        if task is None or task not in self._cut:
            return None
        self._cut.discard(task)
        if task.uncancel() != 0:
            return None
        return GatewayError(
            Code.UNAVAILABLE,
            f"the server shut down before this generation finished (grace period {self.grace_s:g}s); "
            "retry on another replica",
        )

    def start_draining(self) -> None:
        """From now on new generations fail UNAVAILABLE; running ones go on."""
        self.draining = True

    async def wait_idle(self, seconds: float, abort: asyncio.Event | None = None) -> bool:
        """Wait until no generation is in flight (True), ``seconds`` pass or ``abort`` is set (False)."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if abort is not None:
            waits.append(asyncio.ensure_future(abort.wait()))
        try:
            await asyncio.wait(waits, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._idle.is_set()

    def cut_off(self) -> int:
        """The grace period is over: cancel every task still consuming a generation.

        The observer turns that cancellation into UNAVAILABLE (:meth:`cut_error`) where the
        generation is waiting on the engine, so each codec tells its client on its own wire
        (HTTP 503, an SSE error, a gRPC status, an Evergreen abort).
        """
        tasks = {t for t in self._in_flight.values() if t is not None and not t.done()}
        for task in tasks:
            self._cut.add(task)
            task.cancel("the gateway is shutting down")
        return len(tasks)
