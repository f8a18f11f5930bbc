"""The part of the vLLM engine that runs inside vLLM's worker process.

vLLM mixes :class:`PrismgateWorkerExtension` into its worker class (``worker_extension_cls``);
the gateway calls :meth:`PrismgateWorkerExtension.prismgate_setup` once by name through
``collective_rpc``. Setup installs forward hooks on the model:

* on each decoder layer a concept pack names: the residual stream after the layer is
  ``out[0] + out[1]`` (vLLM layers return ``(hidden_states, residual)`` and the next layer
  overwrites both buffers in place), so it is dotted with the concept directions right
  there, in float32, keeping only ``[tokens, n_concepts]``;
* on the whole model: its output is the final-normed hidden state of every scheduled
  token. Rows that score a prompt position a request asked logprobs for go through the
  model's own ``compute_logits`` here, so prompt logprobs never need vLLM's
  ``prompt_logprobs`` (which turns prefix-cache reads off).

Rows of the flattened batch map to requests through the runner's ``query_start_loc`` and
``input_batch.req_ids``, and to absolute positions as the runner itself computes them
(``num_computed_tokens`` + offset in the query: plain positions even for M-RoPE models). What a request wants is read
from its ``SamplingParams.extra_args["prismgate"]``, so no extra RPC per request is needed.
Once per engine step, rank 0 sends everything it computed to the gateway process over a
ZMQ PUSH socket (:mod:`prismgate.engines.vllm.channel` defines the frames).

This module imports only torch, numpy and zmq at the top: it is loaded by vLLM's worker
process, long before any model exists.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from prismgate.engines.readouts.probe import decoder_layers
from prismgate.engines.vllm.channel import StepPacket, encode_step

log = logging.getLogger(__name__)

EXTRA_KEY = "prismgate"


class _RequestPlan:
    """What one request in this step wants, and where its rows lie in the flat batch."""

    __slots__ = ("hi", "key", "lo", "lp_k", "lp_ranges", "positions", "prompt", "readouts")

    def __init__(self, key: str, lo: int, hi: int, positions: np.ndarray, want: dict[str, Any], prompt: Any) -> None:
        self.key = key
        self.lo = lo
        self.hi = hi
        self.positions = positions
        self.readouts = bool(want.get("ro"))
        self.lp_ranges = [(int(a), int(b)) for a, b in want.get("lp", ())]
        self.lp_k = int(want.get("k", 0))
        self.prompt = prompt

    def logprob_rows(self) -> list[tuple[int, int, int]]:
        """(flat row, target position, target token) for prompt positions to score."""
        if not self.lp_ranges or self.prompt is None:
            return []
        n_prompt = len(self.prompt)
        out = []
        for i, pos in enumerate(self.positions.tolist()):
            target = pos + 1
            if target < n_prompt and any(a <= target < b for a, b in self.lp_ranges):
                out.append((self.lo + i, target, int(self.prompt[target])))
        return out


class _Tap:
    """Hooks on one model instance; builds and sends one packet per forward pass."""

    def __init__(self, runner: Any, directions: np.ndarray | None, layers: list[int], sender: Any, rank: int) -> None:
        self.runner = runner
        self.model = runner.get_model()
        self.sender = sender
        self.rank = rank
        self.layer_ids = layers
        self.plans: list[_RequestPlan] = []
        self.n_rows = 0
        self.any_readouts = False
        self.captured: list[torch.Tensor | None] = [None] * len(layers)
        self.handles: list[Any] = []
        self.step = 0
        decoder = decoder_layers(self.model)
        self.directions: list[torch.Tensor] = []
        if directions is not None:
            device = next(self.model.parameters()).device
            self.directions = [
                torch.from_numpy(np.ascontiguousarray(d)).to(device=device, dtype=torch.float32).T.contiguous()
                for d in directions
            ]  # each [hidden, n_concepts]
            for i, layer in enumerate(layers):
                self.handles.append(decoder[layer].register_forward_hook(self._layer_hook(i)))
        self.handles.append(self.model.register_forward_pre_hook(self._before))
        self.handles.append(self.model.register_forward_hook(self._after))

    # -- hooks -----------------------------------------------------------------------

    def _before(self, _module: Any, _args: Any) -> None:
        self.plans = []
        self.n_rows = 0
        self.any_readouts = False
        self.captured = [None] * len(self.layer_ids)
        try:
            self._plan()
        except Exception:  # never break the engine over a readout
            log.exception("prismgate: could not plan readouts for this step")
            self.plans = []

    def _plan(self) -> None:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        if num_reqs == 0:
            return
        qsl = np.asarray(runner.query_start_loc.np[: num_reqs + 1]).copy()
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
            positions = computed[i] + np.arange(hi - lo, dtype=np.int64)
            prompt = getattr(state, "prompt_token_ids", None)
            plan = _RequestPlan(str(want["key"]), lo, hi, positions, want, prompt)
            self.plans.append(plan)
            self.any_readouts = self.any_readouts or plan.readouts
        self.n_rows = int(qsl[-1])

    def _layer_hook(self, index: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            if not self.any_readouts:
                return
            n = self.n_rows
            if isinstance(output, tuple):
                hidden = output[0][:n]
                if len(output) > 1 and output[1] is not None:
                    hidden = hidden + output[1][:n]
            else:
                hidden = output[:n]
            self.captured[index] = hidden.to(torch.float32) @ self.directions[index]

        return hook

    def _after(self, _module: Any, _args: Any, output: Any) -> None:
        if not self.plans:
            return
        try:
            packet = self._collect(output)
        except Exception:
            log.exception("prismgate: could not compute readouts for this step")
            return
        self.step += 1
        if self.rank == 0 and packet.requests:
            self.sender.send(encode_step(packet))

    def _collect(self, output: Any) -> StepPacket:
        packet = StepPacket(step=self.step)
        readouts: np.ndarray | None = None
        if self.any_readouts and self.directions:
            parts = [c for c in self.captured if c is not None]
            if len(parts) == len(self.directions):
                readouts = torch.stack(parts, dim=1).to("cpu").numpy()  # [rows, layers, concepts]
        rows = [(plan, r) for plan in self.plans for r in plan.logprob_rows()]
        scored: dict[str, list[tuple[int, float, list[int], list[float]]]] = {}
        if rows:
            hidden = output[0] if isinstance(output, tuple) else output
            index = torch.tensor([r[0] for _, r in rows], dtype=torch.long, device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, index))
            if logits is not None:  # None on non-last pipeline ranks
                logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
                targets = torch.tensor([r[2] for _, r in rows], dtype=torch.long, device=logp.device)
                own = logp.gather(1, targets[:, None])[:, 0].to("cpu").tolist()
                k = max(plan.lp_k for plan, _ in rows)
                top_v: list[list[float]] = [[] for _ in rows]
                top_i: list[list[int]] = [[] for _ in rows]
                if k > 0:
                    values, ids = torch.topk(logp, k, dim=-1)
                    top_v, top_i = values.to("cpu").tolist(), ids.to("cpu").tolist()
                for j, (plan, (_, target, _token)) in enumerate(rows):
                    kk = plan.lp_k
                    scored.setdefault(plan.key, []).append((target, float(own[j]), top_i[j][:kk], top_v[j][:kk]))
        for plan in self.plans:
            ro = readouts[plan.lo : plan.hi] if (plan.readouts and readouts is not None) else None
            packet.add(plan.key, plan.positions, ro, scored.get(plan.key, []))
        return packet

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class PrismgateWorkerExtension:
    """Methods vLLM adds to its worker class; the gateway calls them by name."""

    _prismgate_tap: _Tap | None = None

    def prismgate_setup(self, address: str, pack_path: str | None) -> dict[str, Any]:
        """Install the hooks and connect the side channel; returns the model's shape."""
        from prismgate.engines.vllm.channel import Sender

        runner = self.model_runner  # type: ignore[attr-defined]
        old = getattr(self, "_prismgate_tap", None)
        if old is not None:
            old.remove()
            old.sender.close()
        model = runner.get_model()
        n_layers = len(decoder_layers(model))
        hidden = int(runner.model_config.get_hidden_size())
        directions = None
        layers: list[int] = []
        if pack_path:
            from prismgate.engines.readouts.pack import ConceptPack

            pack = ConceptPack.load(pack_path)
            pack.check_model(n_layers, hidden)
            directions, layers = pack.directions, list(pack.layers)
        rank = int(getattr(self, "rank", 0))
        sender = Sender(address) if rank == 0 else _NullSender()
        self._prismgate_tap = _Tap(runner, directions, layers, sender, rank)
        return {"n_layers": n_layers, "hidden_size": hidden, "rank": rank}

    def prismgate_shutdown(self) -> None:
        tap = getattr(self, "_prismgate_tap", None)
        if tap is not None:
            tap.remove()
            tap.sender.close()
            self._prismgate_tap = None


class _NullSender:
    def send(self, frames: list[bytes]) -> None:
        pass

    def close(self) -> None:
        pass
