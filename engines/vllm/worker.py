"""The part of the vLLM engine that runs inside vLLM's worker process.

prismgate's worker classes (:mod:`.workers`) add :class:`PrismgateWorkerExtension` to vLLM's
own. At **load**, before vLLM's first (compiling) forward pass, the concept pack and SAEs go
into the model's graph (:mod:`.capture`, :mod:`.sae_op`). At **setup** (called once by name
through ``collective_rpc``) it wraps the runner's ``_model_forward``: before each real engine
step it maps rows to requests and writes their steering and watched features; after it, it
sends what they asked for (readouts, prompt logprobs, SAE features) to the gateway over ZMQ
(:mod:`.channel`). Row mapping, who sends and what is docs/vllm.md, "The worker's side".

This module imports only torch, numpy and zmq at the top: it is loaded by vLLM's worker
process, long before any model exists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prismgate.engines.introspect import decoder_layers
from prismgate.engines.vllm.channel import FeatureRows, LogprobRows, StepPacket, encode_step
from prismgate.engines.vllm.steer import MAX_ROUNDS
from prismgate.engines.vllm.steer_rows import SteeredRows, SteerWriter

if TYPE_CHECKING:
    from prismgate.engines.vllm.capture import SteerBuffers
    from prismgate.engines.vllm.sae_op import FeatureBuffers, LayerFeatures

log = logging.getLogger(__name__)

EXTRA_KEY = "prismgate"


@dataclass(frozen=True)
class Stage:
    """This worker's place in the model: the pack's layers it computes, and whether it scores logprobs.

    ``slots`` are indices into the pack's layers (None: every layer, or no pack); only the
    last pipeline stage has the final hidden states prompt logprobs are scored from.
    """

    slots: list[int] | None = None
    last: bool = True


SOLE_STAGE = Stage()


class _RequestPlan:
    """What one request in this step wants, and where its rows lie in the flat batch."""

    __slots__ = ("fe_ids", "fe_k", "hi", "key", "lo", "lp_k", "lp_ranges", "positions", "prompt", "readouts")

    def __init__(self, key: str, lo: int, hi: int, positions: np.ndarray, want: dict[str, Any], prompt: Any) -> None:
        self.key = key
        self.lo = lo
        self.hi = hi
        self.positions = positions
        self.readouts = bool(want.get("ro"))
        self.lp_ranges = [(int(a), int(b)) for a, b in want.get("lp", ())]
        self.lp_k = int(want.get("k", 0))
        self.prompt = prompt
        fe = want.get("fe")  # SAE features: {"k": top features to send, "ids": watched ids}, or absent
        self.fe_k = int(fe["k"]) if fe else 0
        self.fe_ids = [int(i) for i in fe["ids"]] if fe else []

    @property
    def features(self) -> bool:
        return self.fe_k > 0 or bool(self.fe_ids)

    def logprob_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The prompt positions this step scores: their flat rows, target positions and target tokens
        (int64 arrays); None when there are none."""
        if not self.lp_ranges or self.prompt is None:
            return None
        targets = self.positions + 1
        scored = np.zeros(targets.shape[0], dtype=bool)
        for a, b in self.lp_ranges:
            scored |= (targets >= a) & (targets < b)
        scored &= targets < len(self.prompt)
        picked = np.flatnonzero(scored)
        if picked.size == 0:
            return None
        targets = targets[picked]
        tokens = np.asarray(self.prompt[int(targets[0]) : int(targets[-1]) + 1], dtype=np.int64)[targets - targets[0]]
        return self.lo + picked, targets, tokens


class _Tap:
    """Wraps the runner's model call: plans before it, reads and sends what it computed after.

    The runner's ``_model_forward`` is host code around the (compiled, maybe CUDA-graphed)
    model, called once per real engine step and never for warm-up or capture runs, so it
    is the one place that sees each step's batch layout and, right after, its outputs:
    the readout buffers the graph wrote (:mod:`prismgate.engines.vllm.capture`) and the
    final hidden states prompt logprobs are scored from.
    """

    def __init__(
        self,
        runner: Any,
        buffers: list[torch.Tensor],
        sender: Any,
        stage: Stage = SOLE_STAGE,
        steer: list[SteerBuffers] | None = None,
        wanted: torch.Tensor | None = None,
        features: tuple[FeatureBuffers, list[LayerFeatures]] | None = None,
        steer_slots: list[int] | None = None,
    ) -> None:
        """``steer_slots``: the engine's slot numbers of ``steer``'s layers (None: ``stage.slots``)."""
        self.runner = runner
        self.model = runner.get_model()
        self.sender = sender
        self.stage = stage
        self.buffers = buffers
        self.wanted = wanted  # the graph's readout ops run only in steps where this is 1
        self.steer = SteerWriter(steer, steer_slots if steer_slots is not None else stage.slots) if steer else None
        self.plans: list[_RequestPlan] = []
        self.n_rows = 0
        self.any_readouts = False
        self.features = features  # the SAE ops' shared inputs and each SAE layer's outputs
        self.any_features = False
        self.step = 0
        self._forward = runner._model_forward
        runner._model_forward = self._model_forward

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before()
        output = self._forward(*args, **kwargs)
        self._after(output)
        return output

    def _before(self) -> None:
        self.plans = []
        self.steered: list[SteeredRows] = []
        self.n_rows = 0
        self.any_readouts = False
        self.any_features = False
        try:
            self._plan()
            self._watch()
        except Exception:  # never break the engine over a readout
            log.exception("prismgate: could not plan readouts for this step")
            self.plans = []
            self.any_readouts = self.any_features = False
        if self.wanted is not None:
            self.wanted[0] = int(self.any_readouts)
        if self.features is not None:
            self.features[0].flags[0] = int(self.any_features)
        if self.steer is not None:  # steering is the request's answer: a failure here fails the step
            self.steer.plan(self.steered, self.n_rows)

    def _plan(self) -> None:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        if num_reqs == 0:
            return
        qsl = np.asarray(runner.query_start_loc.np[: num_reqs + 1]).copy()
        self.n_rows = int(qsl[-1])
        # Absolute positions as the runner computes them (num_computed_tokens + offset in the
        # query), from host memory: reading the device-side positions would sync every step.
        computed = np.asarray(batch.num_computed_tokens_cpu[:num_reqs]).astype(np.int64)
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            state = runner.requests.get(req_id)
            params = getattr(state, "sampling_params", None)
            extra = getattr(params, "extra_args", None) or {}
            want = extra.get(EXTRA_KEY)
            if not want:
                continue
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            if hi <= lo:
                continue
            steering = want.get("st")
            if steering:
                self.steered.append(SteeredRows(want["key"], lo, hi - lo, int(computed[i]), steering))
            if not (want.get("ro") or want.get("lp") or want.get("fe")):
                continue  # it only steers: nothing to send back
            positions = computed[i] + np.arange(hi - lo, dtype=np.int64)
            prompt = getattr(state, "prompt_token_ids", None)
            plan = _RequestPlan(str(want["key"]), lo, hi, positions, want, prompt)
            self.plans.append(plan)
            self.any_readouts = self.any_readouts or plan.readouts
            self.any_features = self.any_features or plan.features

    def _watch(self) -> None:
        """Write each row's watched feature ids for the SAE ops, and how many columns the step uses."""
        if self.features is None:
            return
        shared = self.features[0]
        width = max((len(plan.fe_ids) for plan in self.plans), default=0) if self.any_features else 0
        if width:
            ids = np.zeros((self.n_rows, width), dtype=np.int64)
            for plan in self.plans:
                if plan.fe_ids:
                    ids[plan.lo : plan.hi, : len(plan.fe_ids)] = plan.fe_ids
            shared.watch[: self.n_rows, :width].copy_(torch.from_numpy(ids))
        shared.flags[1] = width

    def _after(self, output: Any) -> None:
        if self.steer is not None and self.steered:
            self.steer.carry(self.steered)
        if not self.plans:
            return
        try:
            packet = self._collect(output)
        except Exception:
            log.exception("prismgate: could not compute readouts for this step")
            return
        self.step += 1
        if packet.requests:
            self.sender.send(encode_step(packet))

    def _collect(self, output: Any) -> StepPacket:
        packet = StepPacket(step=self.step, layers=self.stage.slots)
        readouts: np.ndarray | None = None
        if self.any_readouts and self.buffers:
            n = self.n_rows  # the graph wrote every row of the (maybe padded) batch; these are the real ones
            readouts = torch.stack([b[:n] for b in self.buffers], dim=1).to("cpu").numpy()  # [rows, layers, concepts]
        scored = self._prompt_logprobs(output) if self.stage.last else {}
        features = self._all_features()
        for plan in self.plans:
            ro = readouts[plan.lo : plan.hi] if (plan.readouts and readouts is not None) else None
            fe = None
            if features is not None and plan.features:
                top_ids, top_values, watched = features
                lo, hi, k, w = plan.lo, plan.hi, plan.fe_k, len(plan.fe_ids)
                fe = FeatureRows(top_ids[lo:hi, :, :k], top_values[lo:hi, :, :k], watched[lo:hi, :, :w] if w else None)
            packet.add(plan.key, plan.positions, ro, scored.get(id(plan)), fe)
        return packet

    def _prompt_logprobs(self, output: Any) -> dict[int, LogprobRows]:
        """Each plan's scored prompt positions (by ``id(plan)``): one product for the step's rows, then
        slices; the values stay arrays until the gateway reads them."""
        wanted = [(plan, picked) for plan in self.plans if (picked := plan.logprob_rows()) is not None]
        if not wanted:
            return {}
        hidden = output[0] if isinstance(output, tuple) else output
        index = torch.from_numpy(np.concatenate([picked[0] for _, picked in wanted])).to(hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        if logits is None:  # None on non-last pipeline ranks
            return {}
        logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
        tokens = torch.from_numpy(np.concatenate([picked[2] for _, picked in wanted])).to(logp.device)
        own = logp.gather(1, tokens[:, None])[:, 0].to("cpu").numpy()
        k = max(plan.lp_k for plan, _ in wanted)
        if k > 0:
            values, ids = torch.topk(logp, k, dim=-1)
            top_v, top_i = values.to("cpu").numpy(), ids.to(torch.int32).to("cpu").numpy()
        else:
            top_v, top_i = np.zeros((len(own), 0), np.float32), np.zeros((len(own), 0), np.int32)
        out, at = {}, 0
        for plan, (flat, targets, _) in wanted:
            n, kk = len(flat), plan.lp_k
            out[id(plan)] = LogprobRows(targets, own[at : at + n], top_i[at : at + n, :kk], top_v[at : at + n, :kk])
            at += n
        return out

    def _all_features(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The step's features, every row and SAE layer, in host memory: ids, values ``[rows, layers, K]`` and
        watched ``[rows, layers, W]``, copied once (each request's share is a slice; the frames copy it again)."""
        if self.features is None or not self.any_features:
            return None
        n, k = self.n_rows, max(plan.fe_k for plan in self.plans)
        w = max(len(plan.fe_ids) for plan in self.plans)
        layers = self.features[1]

        def host(parts: list[torch.Tensor]) -> np.ndarray:
            return (torch.stack(parts, dim=1) if len(parts) > 1 else parts[0].unsqueeze(1)).to("cpu").numpy()

        return (
            host([f.ids[:n, :k] for f in layers]),
            host([f.values[:n, :k] for f in layers]),
            host([f.watched[:n, :w] for f in layers]),
        )

    def remove(self) -> None:
        """Put the runner's own model call back."""
        if self.runner._model_forward == self._model_forward:
            self.runner._model_forward = self._forward


class PrismgateWorkerExtension:
    """Methods of prismgate's vLLM worker classes (:mod:`.workers`); the gateway calls them by name."""

    _prismgate_tap: _Tap | None = None
    _prismgate_buffers: list[torch.Tensor] | None = None
    _prismgate_steer: list[SteerBuffers] | None = None
    _prismgate_wanted: torch.Tensor | None = None  # host flag: does this step read readouts
    _prismgate_layers: list[int] | None = None
    _prismgate_slots: list[int] | None = None  # the pack's indices of those layers (None: no pack)
    _prismgate_features: tuple[FeatureBuffers, list[LayerFeatures]] | None = None  # the SAE ops' buffers
    _prismgate_sae_layers: list[int] | None = None
    _prismgate_steer_slots: list[int] | None = None  # the steering slots of this worker's steering layers

    def prismgate_install_readouts(self) -> None:
        """Put the concept pack and SAEs named in vLLM's config into the model's graph; call before its first run.

        The pack's layers get the readout op, and with steering (``steering_rounds`` > 0) they and every
        SAE's layer the steering op (an SAE layer steers by feature: :mod:`.sae_steer`); then each SAE's
        layer the feature op (:mod:`.sae_op`), after its steering and readout.
        """
        from prismgate.engines.readouts.pack import ConceptPack
        from prismgate.engines.vllm import capture
        from prismgate.engines.vllm.encoder import SaeWeights
        from prismgate.engines.vllm.steer import steering_layers

        settings = readout_settings(self.vllm_config)  # type: ignore[attr-defined]
        if settings is None:
            return
        if getattr(self.vllm_config.parallel_config, "use_ubatching", False):  # type: ignore[attr-defined]
            # each micro-batch would write its rows from row 0 of the same buffers
            raise ValueError(
                "prismgate readouts and features do not support vLLM's micro-batching (dual-batch overlap)"
            )
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        device = next(model.parameters()).device
        rows = max_rows(self.vllm_config)  # type: ignore[attr-defined]
        rounds = int(settings.get("steering_rounds", MAX_ROUNDS))
        saes = self._prismgate_load_saes([str(f) for f in settings.get("saes") or ()])
        weights = [SaeWeights(sae, device, decoder=rounds > 0) for sae in saes]
        pack_layers: list[int] = []
        layers: list[int] = []
        directions: list[Any] = []
        if settings.get("pack"):
            pack = ConceptPack.load(settings["pack"])
            pack.check_model(len(decoder_layers(model)), int(runner.model_config.get_hidden_size()))
            pack_layers = list(pack.layers)
            # with pipeline parallelism only this stage's layers are real; the others are placeholders
            slots = [i for i, layer in enumerate(pack.layers) if is_local(decoder_layers(model)[layer])]
            layers = [pack.layers[i] for i in slots]
            directions = [pack.directions[i] for i in slots]
            self._prismgate_layers = layers
            self._prismgate_slots = slots
        wanted = torch.ones(1, dtype=torch.int64)
        buffers, steer = capture.install(
            model, directions, layers, rows, steering_rounds=rounds, wanted=wanted, saes=weights
        )
        if settings.get("pack"):
            self._prismgate_buffers, self._prismgate_wanted = buffers, wanted
        sae_layers = [s.layer for s in saes]
        if steer:  # the slots of this worker's steering layers, numbered as the engine numbers them
            everywhere = steering_layers(pack_layers, sae_layers)
            self._prismgate_steer = steer
            self._prismgate_steer_slots = [everywhere.index(x) for x in steering_layers(layers, sae_layers)]
        if saes:  # after the pack: a layer's features read the stream after its steering
            self._prismgate_install_saes(saes, weights)

    def _prismgate_load_saes(self, folders: list[str]) -> list[Any]:
        """The SAEs named in the config, checked against this model (none: an empty list)."""
        if not folders:
            return []
        from prismgate.engines.sae.files import load_for_model

        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        hidden = int(runner.model_config.get_hidden_size())
        return list(load_for_model([(Path(f), None) for f in folders], len(decoder_layers(model)), hidden))

    def _prismgate_install_saes(self, saes: list[Any], weights: list[Any]) -> None:
        """Give each SAE's layer the in-graph encoder (:mod:`.sae_op`), on the tensors steering uses too."""
        from prismgate.engines.vllm import sae_op
        from prismgate.engines.vllm.features import top_width

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        rows = max_rows(self.vllm_config)  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        shared = sae_op.FeatureBuffers(rows, device)
        width = max(top_width(s.architecture, s.d_sae, s.k) for s in saes)
        self._prismgate_features = (shared, sae_op.install(model, saes, rows, shared, width, weights))
        self._prismgate_sae_layers = [s.layer for s in saes]

    def prismgate_setup(self, address: str, huge_pages: bool = True) -> dict[str, Any]:
        """Connect the side channel and start reading each step; returns the model's shape, and what this
        worker moved into huge pages (``huge_pages``: :mod:`prismgate.engines.huge_pages`, on CPU; called
        once vLLM has loaded, compiled and allocated its KV cache, so all of that is in place)."""
        from vllm.distributed import get_pp_group, get_tp_group

        from prismgate.engines.huge_pages import collapse
        from prismgate.engines.vllm.channel import Sender

        runner = self.model_runner  # type: ignore[attr-defined]
        self.prismgate_shutdown()
        model = runner.get_model()
        pages = collapse(enabled=huge_pages, device=next(model.parameters()).device.type)
        log.info("prismgate: %s", pages.reason)
        # Tensor-parallel ranks of a stage hold the same residual stream: the first one sends. Each
        # pipeline stage sends its own layers' readouts, the last one also the prompt logprobs.
        # Every rank steers its own copy of the stream.
        stage = Stage(self._prismgate_slots, last=bool(get_pp_group().is_last_rank))
        sends = get_tp_group().rank_in_group == 0 and (
            stage.last or bool(self._prismgate_layers) or bool(self._prismgate_sae_layers)
        )
        sender = Sender(address) if sends else _NullSender()
        buffers = self._prismgate_buffers or []
        self._prismgate_tap = _Tap(
            runner,
            buffers,
            sender,
            stage,
            self._prismgate_steer or [],
            self._prismgate_wanted,
            self._prismgate_features,
            self._prismgate_steer_slots,
        )
        return {
            "n_layers": len(decoder_layers(model)),
            "hidden_size": int(runner.model_config.get_hidden_size()),
            "rank": int(getattr(self, "rank", 0)),
            "sends": sends,
            "readout_layers": list(self._prismgate_layers or []),
            "feature_layers": list(self._prismgate_sae_layers or []),
            "steering_slots": list(self._prismgate_steer_slots or []),
            "huge_page_bytes": pages.bytes,
            "huge_pages_reason": pages.reason,
        }

    def prismgate_shutdown(self) -> None:
        tap = self._prismgate_tap
        if tap is not None:
            tap.remove()
            tap.sender.close()
            self._prismgate_tap = None


def readout_settings(vllm_config: Any) -> dict[str, Any] | None:
    """What the gateway put in ``additional_config`` for the worker (see :func:`.config.engine_args`)."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict):
        return None
    settings = extra.get(EXTRA_KEY)
    return settings if isinstance(settings, dict) and (settings.get("pack") or settings.get("saes")) else None


def max_rows(vllm_config: Any) -> int:
    """The most tokens one forward pass holds: the batched-token budget, or a padded CUDA-graph size."""
    budget = int(vllm_config.scheduler_config.max_num_batched_tokens)
    graphs = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None) or 0
    return max(budget, int(graphs))


def is_local(layer: torch.nn.Module) -> bool:
    """False for the placeholder vLLM puts where another pipeline stage holds the layer."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return not isinstance(layer, PPMissingLayer)


class _NullSender:
    def send(self, frames: list[bytes]) -> None:
        pass

    def close(self) -> None:
        pass
