"""The Session/Action core: every protocol's requests end up here.

Codecs translate wire messages into :class:`GenerateAction` and session calls; this
module applies the rules (offsets, truncation, image blocks, context limits, busy
sessions), submits work to the engine pool and keeps the session's timeline true to
what the engine produced.

Which tokens a session keeps when a generation does not finish normally:

* the append (and any rewind) is applied once the action is validated, before the
  engine runs, and is kept whatever happens next;
* decoded tokens are appended when the generation ends with EOS, LENGTH or a stop
  string, and on CANCELLED (client went away) or an engine error they are all
  dropped, so that after a cancelled call the session length is exactly
  ``offset + len(append_tokens)``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Protocol

from prismgate.core.actions import GenerateAction, GenerateSpec, ImageInput
from prismgate.core.engine import EngineInfo, EngineRequest, VisionTokens
from prismgate.core.errors import Code, GatewayError, exhausted, invalid, precondition
from prismgate.core.events import Done, Event, FinishReason, TokenEvent
from prismgate.core.pool import EnginePool
from prismgate.core.session import ImageSpan, Session, SessionStore
from prismgate.core.text import TextStream


class GenerationMonitor(Protocol):
    """Sees every generation stream as it passes (metrics, logs, shutdown drain).

    ``watch`` returns the stream to hand to the caller: the events of ``events``
    unchanged, in order. The gateway installs one (``prismgate.monitor``); the
    default passes the stream through untouched.
    """

    def watch(
        self, action: GenerateAction, session_id: str, request_id: str, events: AsyncGenerator[Event, None]
    ) -> AsyncGenerator[Event, None]: ...

    def refused(self, protocol: str, code: Code) -> None:
        """A request of ``protocol`` was refused before it reached a generation (auth, parse, validation)."""


class _PassThrough:
    def watch(
        self, action: GenerateAction, session_id: str, request_id: str, events: AsyncGenerator[Event, None]
    ) -> AsyncGenerator[Event, None]:
        return events

    def refused(self, protocol: str, code: Code) -> None:
        pass


class SessionService:
    def __init__(self, pool: EnginePool, store: SessionStore) -> None:
        self.pool = pool
        self.store = store
        self.monitor: GenerationMonitor = _PassThrough()
        store.on_release(pool.release)

    # -- model ---------------------------------------------------------------------

    def info(self, model: str | None = None) -> EngineInfo:
        info = self.pool.engine(model).info
        if info is None:  # engines fill ``info`` in start(); the server answers while the model loads
            raise GatewayError(Code.UNAVAILABLE, "the model is still loading; retry once the server reports ready")
        return info

    def image_tokens(self, data: bytes, mime: str, model: str | None = None) -> tuple[int, VisionTokens]:
        """How many image-pad tokens ``data`` becomes, and the ids that frame its run.

        Lets a client size an image's placeholder block before sending it, instead of
        guessing the model's image processing. A text-only model is FAILED_PRECONDITION.
        """
        info = self.info(model)
        if info.vision is None:
            raise precondition(f"model {info.model_id!r} takes no images (it has no vision encoder)")
        return self.pool.engine(info.model_id).image_tokens(data, mime), info.vision

    def check_model(self, model: str) -> str:
        served = self.pool.models
        if model not in served:
            raise invalid(
                f"model {model!r} is not the model served here; this server serves "
                + ", ".join(repr(m) for m in served)
            )
        return model

    # -- session lifecycle -----------------------------------------------------------

    def open(self, model: str) -> Session:
        return self.store.create(self.check_model(model))

    def close(self, session_id: str) -> None:
        self.store.close(session_id)

    def fork(self, session_id: str, at_position: int) -> Session:
        return self.store.fork(session_id, at_position)

    def dump(self, session_id: str) -> list[int]:
        return list(self.store.get(session_id).tokens)

    def session(self, session_id: str) -> Session:
        return self.store.get(session_id)

    # -- generation ----------------------------------------------------------------

    def generate(self, session_id: str, action: GenerateAction) -> AsyncGenerator[Event, None]:
        """Run ``action`` on a stored session; the stream ends with exactly one Done."""
        request_id = uuid.uuid4().hex
        return self.monitor.watch(action, session_id, request_id, self._generate(session_id, action, request_id))

    def run(self, action: GenerateAction, *, model: str | None = None) -> AsyncGenerator[Event, None]:
        """Run ``action`` on a fresh timeline that is thrown away afterwards."""
        request_id = uuid.uuid4().hex
        session_id = f"ephemeral-{request_id}"
        events = self._run_ephemeral(session_id, action, model, request_id)
        return self.monitor.watch(action, session_id, request_id, events)

    async def _generate(self, session_id: str, action: GenerateAction, request_id: str) -> AsyncGenerator[Event, None]:
        session = self.store.get(session_id)
        done: Done | None = None
        with session.generation():
            async for event in self._run(session, action, session.id, request_id):
                if isinstance(event, Done):
                    done = event
                else:
                    yield event
            self.store.touch(session)
        # Done goes out after the session is released, so a client that stops reading
        # at Done can start its next turn at once.
        assert done is not None
        yield done

    async def _run_ephemeral(
        self, session_id: str, action: GenerateAction, model: str | None, request_id: str
    ) -> AsyncGenerator[Event, None]:
        info = self.info(model)
        session = Session(id=session_id, model=info.model_id)
        async for event in self._run(session, action, None, request_id):
            yield event

    async def _run(
        self, session: Session, action: GenerateAction, session_key: str | None, request_id: str
    ) -> AsyncIterator[Event]:
        info = self.info(session.model)
        spec = action.spec
        old_length = len(session)
        self._check_offset(session, action)
        base = old_length if action.offset is None else action.offset
        tokens = session.tokens[:base] + list(action.append_tokens)
        images = [im for im in session.images if im.end <= base]
        images += await self._check_images(info, base, tokens, action.images)
        self._check_tokens(info, action.append_tokens)
        self._check_limits(info, len(tokens), spec)

        if session_key is not None:  # the append and the whole decode budget must fit, checked before anything runs
            self.store.reserve(len(action.append_tokens) - (old_length - base) + spec.max_tokens)
        if base < old_length:
            session.truncate(base)
        session.tokens.extend(action.append_tokens)
        session.images = images

        if not action.append_tokens and spec.max_tokens == 0 and not (spec.wants_logprobs or spec.wants_readouts):
            yield Done(prompt_tokens=len(tokens), completion_tokens=0, finish_reason=FinishReason.PREFILL_ONLY)
            return

        request = EngineRequest(
            request_id=request_id,
            tokens=tuple(tokens),
            spec=spec,
            images=tuple(images),
            session_key=session_key,
        )
        text = (
            TextStream(info.tokenizer.decode, spec.stop_strings) if (action.detokenize or spec.stop_strings) else None
        )
        generated: list[int] = []
        stream = self.pool.generate(session.model, request)
        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    if not event.is_prefill:
                        generated.append(event.id)
                        if text is not None:
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
        yield done

    # -- rules -----------------------------------------------------------------------

    @staticmethod
    def _check_offset(session: Session, action: GenerateAction) -> None:
        if action.offset is None:
            if action.truncating:
                raise invalid("truncating needs an offset to rewind to")
            return
        length = len(session)
        if action.offset == length:
            return
        if action.offset < length and action.truncating:
            session.check_boundary(action.offset, "truncation")
            return
        if action.offset < length:
            raise precondition(
                f"offset {action.offset} is behind the session length {length}; "
                "set truncating to rewind, or resynchronise with DumpSession"
            )
        raise precondition(f"offset {action.offset} is past the session length {length}")

    @staticmethod
    def _check_tokens(info: EngineInfo, tokens: Sequence[int]) -> None:
        for i, t in enumerate(tokens):
            if not 0 <= t < info.vocab_size:
                raise invalid(f"token id {t} at append index {i} is outside the vocabulary [0, {info.vocab_size})")

    async def _check_images(
        self, info: EngineInfo, base: int, tokens: list[int], images: Sequence[ImageInput]
    ) -> list[ImageSpan]:
        vision = info.vision
        if vision is None:
            if images:
                raise invalid(f"model {info.model_id!r} takes no images (it has no vision encoder)")
            return []
        spans: list[ImageSpan] = []
        for i, image in enumerate(sorted(images, key=lambda im: im.start)):
            where = f"image {i} at [{image.start}, {image.end})"
            if image.start < base or image.end > len(tokens) or image.end - image.start < 3:
                raise invalid(
                    f"{where} must lie inside this call's appended tokens [{base}, {len(tokens)}) "
                    "and hold at least start, one pad and end"
                )
            if spans and image.start < spans[-1].end:
                raise invalid(f"{where} overlaps the image at [{spans[-1].start}, {spans[-1].end})")
            run = tokens[image.start : image.end]
            if (
                run[0] != vision.vision_start
                or run[-1] != vision.vision_end
                or any(t != vision.image_pad for t in run[1:-1])
            ):
                raise invalid(f"{where} is not a <|vision_start|> + N*<|image_pad|> + <|vision_end|> run")
            engine = self.pool.engine(info.model_id)
            # decoding and resizing an image takes a while: keep it off the event loop
            expected = await asyncio.to_thread(engine.image_tokens, image.data, image.mime)
            if expected != len(run) - 2:
                raise invalid(
                    f"{where} holds {len(run) - 2} image pad tokens but this image becomes "
                    f"{expected} under {info.model_id!r}; expected a range of length {expected + 2}"
                )
            spans.append(ImageSpan.of(image.start, image.end, image.data, image.mime))
        declared = {p for s in spans for p in range(s.start, s.end)}
        for position in range(base, len(tokens)):
            if tokens[position] == vision.image_pad and position not in declared:
                raise invalid(f"image pad token at position {position} belongs to no declared image")
        return spans

    @staticmethod
    def _check_limits(info: EngineInfo, prompt_len: int, spec: GenerateSpec) -> None:
        if spec.wants_readouts and info.readouts is None:
            raise invalid(f"model {info.model_id!r} has no concept pack loaded, so it has no readouts")
        limit = info.max_model_len
        if prompt_len > limit:
            raise exhausted(f"the prompt has {prompt_len} tokens, more than the model's context of {limit}")
        if prompt_len + spec.max_tokens > limit:
            raise exhausted(
                f"{prompt_len} prompt tokens + max_tokens {spec.max_tokens} = "
                f"{prompt_len + spec.max_tokens} exceeds the model's context of {limit}"
            )
        if spec.max_tokens > 0 and prompt_len == 0:
            raise invalid("cannot decode from an empty timeline: append at least one token")
        horizon = prompt_len + spec.max_tokens
        for name, ranges in (("logprob", spec.logprob_ranges), ("readout", spec.readout_ranges)):
            for r in ranges:
                if r.end > horizon:
                    raise invalid(
                        f"{name} range [{r.start}, {r.end}) reaches past position {horizon} "
                        f"(prompt {prompt_len} + max_tokens {spec.max_tokens})"
                    )
