"""The Session/Action core: every protocol's requests end up here.

Codecs translate wire messages into a :class:`~prismgate.core.turns.ChatTurn` (the
chat-shaped protocols) or a :class:`GenerateAction` (Salience, which places tokens itself) and
session calls; this service is the one public API they use. It applies every policy a request
meets before an engine sees it, each kept in its own module of the core (docs/architecture.md,
"Where each policy lives"), then submits the work to the engine pool and keeps the session's
timeline true to what the engine produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Protocol

from prismgate.core import checks, steering
from prismgate.core.actions import GenerateAction, PositionRange
from prismgate.core.budget import RequestBudget
from prismgate.core.engine import EngineInfo, EngineRequest, ReadoutManifest, VisionTokens
from prismgate.core.errors import Code, GatewayError, invalid, quote
from prismgate.core.events import Done, Event, FinishReason, TokenEvent
from prismgate.core.fairness import Share
from prismgate.core.features import check_features
from prismgate.core.limits import check_fit, max_tokens_for
from prismgate.core.models import Models
from prismgate.core.pool import EnginePool
from prismgate.core.principal import Principal, current
from prismgate.core.prompts import plan_prompt
from prismgate.core.quota import LocalQuota, Quota
from prismgate.core.session import Session
from prismgate.core.steering import Steering
from prismgate.core.stores import SessionStore
from prismgate.core.stores.base import missing
from prismgate.core.text import TextStream
from prismgate.core.token_texts import TokenTexts
from prismgate.core.turns import ChatTurn, Turn


class GenerationMonitor(Protocol):
    """Sees every generation stream as it passes (metrics, logs, shutdown drain).

    ``watch`` returns the stream to hand to the caller: the events of ``events``
    unchanged, in order. The gateway installs one (``prismgate.observer``); the
    default passes the stream through untouched.
    """

    def watch(
        self, action: GenerateAction, session_id: str, request_id: str, events: AsyncGenerator[Event, None]
    ) -> AsyncGenerator[Event, None]: ...

    def refused(self, protocol: str, code: Code) -> None:
        """A request of ``protocol`` was refused before it reached a generation (auth, parse, validation)."""

    def running(self, request_id: str, model: str) -> None:
        """The watched generation ``request_id`` runs on the served model ``model``.

        Called before its first event, once its session (and so its model) is known; a request
        refused before that (an unknown session or model, a busy session) never gets the call.
        """


class _PassThrough:
    def watch(
        self, action: GenerateAction, session_id: str, request_id: str, events: AsyncGenerator[Event, None]
    ) -> AsyncGenerator[Event, None]:
        return events

    def running(self, request_id: str, model: str) -> None:
        pass

    def refused(self, protocol: str, code: Code) -> None:
        pass


class SessionService:
    def __init__(
        self,
        pool: EnginePool,
        store: SessionStore,
        budget: RequestBudget | None = None,
        quota: Quota | None = None,
        *,
        deterministic: bool = False,
        specials_in_text: bool = False,
    ) -> None:
        self.pool = pool  # the gateway's (start, drain, metrics); codecs go through the methods below
        self.store = store
        self._budget = budget or RequestBudget()
        self.quota = quota or LocalQuota()
        self.deterministic = deterministic  # every request's default for GenerateSpec.deterministic
        self.models = Models(pool, specials_in_text=specials_in_text)
        self._token_texts: dict[str, TokenTexts] = {}
        self.monitor: GenerationMonitor = _PassThrough()
        store.on_release(pool.release)

    @property
    def budget(self) -> RequestBudget:
        """The request budget, sized to the models loaded so far (see :meth:`Models.sizes`)."""
        sizes = self.models.sizes()
        return self._budget if sizes is None else self._budget.sized(*sizes)

    # -- models ----------------------------------------------------------------------

    @property
    def specials_in_text(self) -> bool:
        return self.models.specials_in_text

    def info(self, model: str | None = None) -> EngineInfo:
        """The model's facts (context, tokenizer, manifest); NOT_FOUND unknown, UNAVAILABLE loading."""
        return self.models.info(model)

    def readouts(self, model: str | None = None) -> ReadoutManifest:
        """The model's readout manifest; INVALID_ARGUMENT when it has no concept pack."""
        return self.models.readouts(model)

    def check_steering(self, steering: Steering, model: str | None = None) -> None:
        """Refuse steering the model cannot take, before a turn is planned (every generation checks it again)."""
        checks.check_steering(self.info(model), steering)

    def token_texts(self, model: str | None = None) -> TokenTexts:
        """Token id -> (text, exact bytes) for the model, cached per model (logprob displays)."""
        info = self.info(model)
        texts = self._token_texts.get(info.model_id)
        if texts is None or texts.tokenizer is not info.tokenizer:
            texts = self._token_texts[info.model_id] = TokenTexts(info.tokenizer)
        return texts

    async def image_tokens(self, data: bytes, mime: str, model: str | None = None) -> tuple[int, VisionTokens]:
        """How many image-pad tokens ``data`` becomes, and the ids that frame its run (decoded off the loop)."""
        return await asyncio.to_thread(self.models.image_tokens, data, mime, model)

    # -- session lifecycle -----------------------------------------------------------

    async def open(self, model: str | None = None, *, pinned: bool = False) -> Session:
        """A new session on ``model`` (the default model when None), owned by the calling key; the model must be loaded.

        ``pinned``: the session lives as long as the connection that opened it (Evergreen).
        """
        principal = current()
        model_id = self.info(model).model_id
        principal.check_model(model_id)
        return await self.store.create(model_id, pinned=pinned, owner=principal.name)

    async def close(self, session_id: str) -> None:
        """Close the caller's session (an admin's: any); another key's is left alone, as an unknown one is."""
        try:
            await self._owned(session_id, current())
        except GatewayError as exc:
            if exc.code is Code.NOT_FOUND:
                return
            raise
        await self.store.close(session_id)

    async def fork(self, session_id: str, at_position: int) -> Session:
        """A child of the caller's session, owned by the caller."""
        principal = current()
        await self._owned(session_id, principal)
        return await self.store.fork(session_id, at_position, owner=principal.name)

    async def dump(self, session_id: str) -> list[int]:
        return list((await self._owned(session_id, current())).tokens)

    async def session(self, session_id: str) -> Session:
        """The caller's session as stored now (from a shared store: a copy)."""
        return await self._owned(session_id, current())

    async def sessions(self) -> dict[str, str]:
        """Every open session's owner by id: for a key with the admin scope only."""
        current().check_admin("list sessions")
        return await self.store.owners()

    async def _owned(self, session_id: str, principal: Principal) -> Session:
        """The session, when ``principal`` may use it; NOT_FOUND otherwise, exactly as for an unknown id."""
        session = await self.store.get(session_id)
        if not principal.owns(session.owner):
            raise missing(session_id)
        return session

    # -- standing steering -------------------------------------------------------------

    async def set_steering(self, session_id: str, entries: Steering) -> Steering:
        """Steer every later generation on the session whose own spec names no steering.

        For a wire whose generate request has no steering field (salience.v1). The empty
        list clears it. Checked as a request's steering is (the budget's count, the model's
        pack and engine), and saved the way a timeline is, by holding the session: a session
        that is generating now is ABORTED rather than changed under a running turn.
        """
        principal = current()
        if entries:
            principal.check_steer()
        self.budget.check_lists(steering_entries=len(entries))
        await self._owned(session_id, principal)
        async with self.store.generation(session_id) as session:
            checks.check_steering(self.info(session.model), entries)
            session.standing_steering = entries
        return entries

    async def get_steering(self, session_id: str) -> Steering:
        """The session's standing steering (empty: none)."""
        return (await self._owned(session_id, current())).standing_steering

    # -- chat-shaped turns -------------------------------------------------------------

    async def plan_turn(self, turn: ChatTurn, *, session_id: str | None = None, model: str | None = None) -> Turn:
        """Apply the core's rules to a chat-shaped turn (see :mod:`prismgate.core.turns`).

        With ``session_id`` the turn goes onto that session (``model``, when given, must
        be the session's); without, onto a fresh timeline. Rendering runs in a worker
        thread: it costs time in proportion to the prompt.
        """
        principal = current()
        if session_id is not None:
            session = await self._owned(session_id, principal)
            if model and self.models.resolve(model) != session.model:
                raise GatewayError(
                    Code.INVALID_ARGUMENT,
                    f"session {quote(session_id)} is bound to model {session.model!r}, not {quote(model)}",
                )
            info = self.info(session.model)
            timeline, images = list(session.tokens), list(session.images)
        else:
            info = self.info(model)
            timeline, images = [], []
        principal.check_model(info.model_id)
        self.budget.check_prompt(turn.prompt, info.max_model_len)
        if turn.readouts:
            self.readouts(info.model_id)
        checks.check_steering(info, turn.sampling.steering)
        append = await asyncio.to_thread(
            plan_prompt, self.models, info.model_id, timeline, images, turn.prompt, turn.placement
        )
        prompt_tokens = append.prompt_tokens
        max_tokens = max_tokens_for(
            turn.max_tokens,
            prompt_tokens=prompt_tokens,
            context=info.max_model_len,
            default=turn.default_max_tokens,
        )
        first = append.offset if turn.report_prompt else prompt_tokens
        horizon = (PositionRange(first, prompt_tokens + max_tokens),)
        spec = replace(
            turn.sampling,
            max_tokens=max_tokens,
            logprob_ranges=horizon if turn.logprobs else (),
            readout_ranges=horizon if turn.readouts else (),
        )
        if spec.features is not None:  # the turn's horizon, at the layers the model has
            layers = check_features(info.features, info.model_id, spec.features)
            spec = replace(spec, features=replace(spec.features, ranges=horizon, layers=layers))
        principal.check_spec(spec)
        action = GenerateAction(
            append_tokens=append.tokens,
            images=append.images,
            offset=append.offset,
            truncating=append.truncating,
            spec=spec,
            detokenize=turn.detokenize,
            origin=turn.origin,
            atomic=True,
        )
        return Turn(model=info.model_id, session_id=session_id, append=append, action=action)

    def run_turn(self, turn: Turn) -> AsyncGenerator[Event, None]:
        """Run a planned turn on its session (or its ephemeral timeline)."""
        if turn.session_id is None:
            return self.run(turn.action, model=turn.model)
        return self.generate(turn.session_id, turn.action)

    # -- generation ----------------------------------------------------------------

    def generate(self, session_id: str, action: GenerateAction) -> AsyncGenerator[Event, None]:
        """Run ``action`` on a stored session; the stream ends with exactly one Done."""
        request_id = uuid.uuid4().hex
        principal = current()
        events = self._limited(principal, request_id, self._generate(session_id, action, request_id, principal))
        return _reported(self.monitor.watch(action, session_id, request_id, events))

    def run(self, action: GenerateAction, *, model: str | None = None) -> AsyncGenerator[Event, None]:
        """Run ``action`` on a fresh timeline that is thrown away afterwards."""
        request_id = uuid.uuid4().hex
        session_id = f"ephemeral-{request_id}"
        principal = current()
        ephemeral = self._run_ephemeral(session_id, action, model, request_id, principal)
        events = self._limited(principal, request_id, ephemeral)
        return _reported(self.monitor.watch(action, session_id, request_id, events))

    async def _limited(
        self, principal: Principal, request_id: str, events: AsyncGenerator[Event, None]
    ) -> AsyncGenerator[Event, None]:
        """``events`` within the key's limits: admitted first, its tokens counted once it ends."""
        try:
            await self.quota.admit(principal, request_id)
        except GatewayError:
            await events.aclose()
            raise
        used = 0
        try:
            async for event in events:
                if isinstance(event, Done):
                    used = event.prompt_tokens + event.completion_tokens
                elif not event.is_prefill:
                    used += 1  # a generation cut short is charged for what it produced
                yield event
        finally:
            await events.aclose()
            with contextlib.suppress(GatewayError):  # the count must not turn a finished answer into an error
                await asyncio.shield(self._settle(principal, request_id, used))

    async def _settle(self, principal: Principal, request_id: str, used: int) -> None:
        await self.quota.release(principal, request_id)
        await self.quota.charge(principal, used)

    async def _generate(
        self, session_id: str, action: GenerateAction, request_id: str, principal: Principal
    ) -> AsyncGenerator[Event, None]:
        done: Done | None = None
        await self._owned(session_id, principal)  # before the lock: a busy session of another key is not revealed
        async with self.store.generation(session_id) as session:
            action = _standing(session, action)
            before = session.snapshot() if action.atomic else None
            steered_before = session.steering
            finished = False
            try:
                async for event in self._run(session, action, session.id, request_id, principal):
                    if isinstance(event, Done):
                        done = event
                        finished = event.finish_reason is not FinishReason.CANCELLED
                    else:
                        yield event
            finally:
                if before is not None and not finished:
                    session.restore(before)  # turn atomicity: see prismgate.core.turns
                    session.steering = steered_before
        # Done goes out after the session is released, so a client that stops reading
        # at Done can start its next turn at once.
        assert done is not None
        yield done

    async def _run_ephemeral(
        self, session_id: str, action: GenerateAction, model: str | None, request_id: str, principal: Principal
    ) -> AsyncGenerator[Event, None]:
        info = self.info(model)
        session = Session(id=session_id, model=info.model_id, owner=principal.name)
        async for event in self._run(session, action, None, request_id, principal):
            yield event

    async def _run(
        self, session: Session, action: GenerateAction, session_key: str | None, request_id: str, principal: Principal
    ) -> AsyncIterator[Event]:
        self.monitor.running(request_id, session.model)
        info = self.info(session.model)
        spec = action.spec
        principal.check_model(session.model)
        principal.check_spec(spec)
        old_length = len(session)
        # cheapest first: counts and lengths before anything proportional to the append
        self.budget.check_spec(spec)
        checks.check_offset(session, action)
        base = old_length if action.offset is None else action.offset
        checks.check_readouts(info, spec)
        checks.check_steering(info, spec.steering)
        spec = checks.resolve_deterministic(info, spec, self.deterministic)
        spec = replace(spec, steering=steering.effective(spec.steering))
        check_fit(base + len(action.append_tokens), spec.max_tokens, info.max_model_len)
        checks.check_ranges(base + len(action.append_tokens), spec)
        checks.check_sampling(info, spec)
        if action.images and info.vision is None:  # say so before the image's tokens fail the vocabulary check
            raise invalid(f"model {info.model_id!r} takes no images (it has no vision encoder)")
        checks.check_vocabulary(info, action.append_tokens)
        tokens = session.tokens[:base] + list(action.append_tokens)
        images = [im for im in session.images if im.end <= base]
        images += await checks.check_images(self.models, info, base, tokens, action.images)

        if session_key is not None:  # the append and the whole decode budget must fit, checked before anything runs
            await self.store.reserve(len(action.append_tokens) - (old_length - base) + spec.max_tokens)
        if base < old_length:
            session.truncate(base)
        session.tokens.extend(action.append_tokens)
        session.images = images

        reports = spec.wants_logprobs or spec.wants_readouts or spec.wants_features
        if not action.append_tokens and spec.max_tokens == 0 and not reports:
            yield Done(prompt_tokens=len(tokens), completion_tokens=0, finish_reason=FinishReason.PREFILL_ONLY)
            return

        request = EngineRequest(
            request_id=request_id,
            tokens=tuple(tokens),
            spec=spec,
            images=tuple(images),
            session_key=session_key,
            fork=action.fork if session_key is None else None,
        )
        text = (
            TextStream(
                info.tokenizer.decode,
                spec.stop_strings,
                min_tokens=spec.min_tokens,
                include_stop=spec.include_stop_str_in_output,
            )
            if (action.detokenize or spec.stop_strings)
            else None
        )
        generated: list[int] = []
        stream = self.pool.generate(session.model, request, Share(principal.name, principal.weight))
        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    if not event.is_prefill:
                        generated.append(event.id)
                        if text is not None and (
                            spec.stop_token_text or not spec.ends_on(event.id, len(generated), info.eos_token_ids)
                        ):
                            event.text = text.push(event.id)
                    yield event
                    if text is not None and text.stopped_on is not None:
                        done = Done(
                            prompt_tokens=len(tokens),
                            completion_tokens=len(generated),
                            finish_reason=FinishReason.STOP_STRING,
                            stop_string=text.stopped_on,
                            text="",
                        )
                        break
                else:
                    done = event
                    if text is not None:
                        done.text = text.flush()
                    break
            else:
                raise GatewayError(Code.INTERNAL, "the engine stream ended without a Done event")
        finally:
            await stream.aclose()
        if done.finish_reason is not FinishReason.CANCELLED:
            session.tokens.extend(generated)
            # the engine ran the whole timeline under this request's steering (reusing only
            # positions that were computed under the same)
            session.steering = steering.spans(spec.steering, len(tokens), len(session.tokens))
        yield done


def _standing(session: Session, action: GenerateAction) -> GenerateAction:
    """The action under the session's standing steering when its own spec names none."""
    if action.spec.steering or not session.standing_steering:
        return action
    return replace(action, spec=replace(action.spec, steering=session.standing_steering))


async def _reported(events: AsyncGenerator[Event, None]) -> AsyncGenerator[Event, None]:
    """Mark an error that ended a watched stream as counted: the monitor saw it go by."""
    try:
        async for event in events:
            yield event
    except GatewayError as exc:
        exc.reported = True
        raise
    finally:
        await events.aclose()
