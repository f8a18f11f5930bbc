"""Train a small TopK SAE on one layer of a served model, and measure it the way SAE papers do.

The recipe is Gao et al. 2024 ("Scaling and evaluating sparse autoencoders") at toy scale: the
residual stream after layer L of the :mod:`.corpus` texts (position 0 and massive-norm tokens
left out), a TopK autoencoder with unit-norm decoder rows, MSE plus the AuxK term, Adam, fixed
seed and threads: the same inputs give the same weights. :class:`Quality` is measured on the
held-out texts. The recipe in full: docs/instruments.md, "Training an SAE".
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from prismgate.engines.introspect import decoder_layers
from prismgate.engines.sae.encode import SaeEncoder
from prismgate.engines.sae.files import CFG_FILE, WEIGHTS_FILE, SparseAutoencoder
from prismgate.instruments.packs.capture import deterministic_torch

OUTLIER_FACTOR = 3.0
DEAD_STEPS = 8  # a feature silent for this many steps counts as dead for the AuxK loss
AUX_K = 256
AUX_WEIGHT = 1 / 32
MAX_TOKENS = 128  # a text's tokens read (longer ones are cut)
# The weights are stored as float16 (half the file): every
# quality figure is measured on the rounded weights, which are exactly what a load reads back.
STORED_DTYPE = torch.float16

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TrainConfig:
    layer: int
    d_sae: int = 4096
    k: int = 32
    epochs: int = 6
    batch_tokens: int = 2048
    lr: float = 1e-3
    seed: int = 0
    threads: int = 2


@dataclass(frozen=True)
class Quality:
    fve: float  # fraction of variance explained, held-out tokens
    l0: float  # mean active features per held-out token
    dead: int  # features active on no token at all
    d_sae: int
    loss_clean: float  # next-token loss, held-out texts
    loss_spliced: float  # ... with the reconstruction in place of layer L's output
    loss_zero: float  # ... with layer L's output zero-ablated
    train_tokens: int
    held_out_tokens: int

    @property
    def loss_recovered(self) -> float:
        gap = self.loss_zero - self.loss_clean
        return float("nan") if gap == 0 else (self.loss_zero - self.loss_spliced) / gap

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "loss_recovered": self.loss_recovered}

    def lines(self) -> list[str]:
        return [
            f"fraction of variance explained {self.fve:.3f} (held-out, {self.held_out_tokens} tokens)",
            f"L0 {self.l0:.1f} active features per token",
            f"dead features {self.dead} of {self.d_sae} (active on no token)",
            f"next-token loss {self.loss_clean:.3f} clean, {self.loss_spliced:.3f} with the SAE spliced in, "
            f"{self.loss_zero:.3f} with the layer zero-ablated (loss recovered {self.loss_recovered:.3f})",
        ]


def _encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=True)["input_ids"][:MAX_TOKENS] for t in texts]


def _batches(rows: list[list[int]], size: int = 16) -> list[list[list[int]]]:
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]), i))
    return [[rows[i] for i in order[s : s + size]] for s in range(0, len(order), size)]


def _padded(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    valid = torch.zeros((len(batch), width), dtype=torch.bool)
    for i, r in enumerate(batch):
        ids[i, : len(r)] = torch.tensor(r)
        valid[i, : len(r)] = True
    return ids, valid


def _kept(hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Tokens an SAE is trained and judged on: not position 0, not a massive-norm outlier."""
    norms = hidden.float().norm(dim=-1)
    keep = valid.clone()
    keep[:, 0] = False
    masked = torch.where(keep, norms, torch.full_like(norms, float("nan")))
    median = torch.nanmedian(masked, dim=1).values
    return keep & (norms <= OUTLIER_FACTOR * median[:, None])


class _Stop(Exception):
    """Raised by a tap that has what it needs: the layers above it, and the logits, are never computed."""


class LayerTap:
    """A forward hook on decoder layer L that keeps its output, or replaces it (splice, zero).

    With ``stop`` the pass ends right after layer L (:meth:`run` catches it): a capture of a
    middle layer costs half a forward pass, not a whole one with its logits.
    """

    def __init__(self, model: Any, layer: int, *, stop: bool = False) -> None:
        self.captured: torch.Tensor | None = None
        self.replace: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.stop = stop
        self._handle = decoder_layers(model)[layer].register_forward_hook(self._hook)

    def run(self, model: Any, **inputs: Any) -> torch.Tensor:
        """The layer's output for one forward pass of ``inputs``."""
        self.captured = None
        with contextlib.suppress(_Stop):
            model(**inputs)
        assert self.captured is not None
        return self.captured

    def _hook(self, _module: Any, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        self.captured = hidden
        if self.stop:
            raise _Stop
        if self.replace is None:
            return None
        new = self.replace(hidden)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    def remove(self) -> None:
        self._handle.remove()


def capture(model: Any, tokenizer: Any, texts: Sequence[str], layer: int) -> torch.Tensor:
    """The kept tokens' residual stream after ``layer``: float32 ``[tokens, hidden]``, in a fixed order."""
    tap = LayerTap(model, layer, stop=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    parts = []
    try:
        for batch in _batches(_encode_texts(tokenizer, texts)):
            ids, valid = _padded(batch, pad)
            hidden = tap.run(model, input_ids=ids, attention_mask=valid.long())
            parts.append(hidden[_kept(hidden, valid)].float())
    finally:
        tap.remove()
    return torch.cat(parts)


def train(acts: torch.Tensor, config: TrainConfig, progress: Progress | None = None) -> SaeWeights:
    """A TopK SAE fitted to ``acts [tokens, d_in]`` (float32), deterministic for the same inputs."""
    say = progress or (lambda _t: None)
    gen = torch.Generator().manual_seed(config.seed)
    acts = acts.clone()  # captured under inference mode: a plain tensor for autograd
    n, d_in = acts.shape
    mean = acts.mean(dim=0)
    scale = float(((acts - mean) ** 2).sum(dim=1).mean().sqrt())  # inputs / scale: mean squared norm ~1
    x_all = acts / scale
    W_dec = torch.randn(config.d_sae, d_in, generator=gen)
    W_dec /= W_dec.norm(dim=1, keepdim=True)
    params = {
        "W_enc": torch.nn.Parameter(W_dec.T.clone()),
        "b_enc": torch.nn.Parameter(torch.zeros(config.d_sae)),
        "W_dec": torch.nn.Parameter(W_dec),
        "b_dec": torch.nn.Parameter(mean / scale),
    }
    opt = torch.optim.Adam(params.values(), lr=config.lr, betas=(0.9, 0.999))
    since_fired = torch.zeros(config.d_sae, dtype=torch.long)
    steps_per_epoch = math.ceil(n / config.batch_tokens)
    total = steps_per_epoch * config.epochs
    step = 0
    for epoch in range(config.epochs):
        order = torch.randperm(n, generator=gen)
        for s in range(steps_per_epoch):
            x = x_all[order[s * config.batch_tokens : (s + 1) * config.batch_tokens]]
            pre = (x - params["b_dec"]) @ params["W_enc"] + params["b_enc"]
            values, ids = torch.topk(pre, config.k, dim=-1)
            recon = _sparse_decode(ids, values.relu(), params["W_dec"]) + params["b_dec"]
            error = x - recon
            loss = (error**2).sum(dim=-1).mean()
            fired = torch.zeros(config.d_sae, dtype=torch.bool)
            fired[ids[values > 0]] = True
            since_fired = torch.where(fired, 0, since_fired + 1)
            dead = since_fired >= DEAD_STEPS
            if bool(dead.any()):
                k_aux = min(AUX_K, int(dead.sum()))
                aux_values, aux_ids = torch.topk(pre.masked_fill(~dead, float("-inf")), k_aux, dim=-1)
                aux_recon = _sparse_decode(aux_ids, aux_values.relu(), params["W_dec"])
                loss = loss + AUX_WEIGHT * ((error.detach() - aux_recon) ** 2).sum(dim=-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                params["W_dec"].div_(params["W_dec"].norm(dim=1, keepdim=True))
            step += 1
            if step % 20 == 0 or step == total:
                say(f"step {step}/{total} (epoch {epoch + 1}): mse {float(loss.detach()):.4f}")
    with torch.no_grad():  # fold the input scale back in: the saved SAE reads the raw stream
        return SaeWeights(
            W_enc=params["W_enc"].detach().clone(),
            b_enc=params["b_enc"].detach() * scale,
            W_dec=params["W_dec"].detach().clone(),
            b_dec=params["b_dec"].detach() * scale,
        )


def _sparse_decode(ids: torch.Tensor, values: torch.Tensor, W_dec: torch.Tensor) -> torch.Tensor:
    """``sum_j values[:, j] * W_dec[ids[:, j]]``: the k rows each token uses, not all d_sae (k/d_sae the work)."""
    return torch.nn.functional.embedding_bag(ids, W_dec, per_sample_weights=values, mode="sum")


@dataclass(frozen=True)
class SaeWeights:
    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor

    def rounded(self, dtype: torch.dtype) -> SaeWeights:
        """The weights as they come back from a file of ``dtype`` (float32 again, each value rounded once)."""
        return SaeWeights(*(getattr(self, n).to(dtype).to(torch.float32) for n in ("W_enc", "b_enc", "W_dec", "b_dec")))

    def as_sae(self, layer: int, k: int, path: Path = Path(".")) -> SparseAutoencoder:
        return SparseAutoencoder(
            path=path,
            architecture="topk",
            layer=layer,
            hook_name=f"blocks.{layer}.hook_resid_post",
            W_enc=self.W_enc.numpy(),
            b_enc=self.b_enc.numpy(),
            W_dec=self.W_dec.numpy(),
            b_dec=self.b_dec.numpy(),
            k=k,
        )


def evaluate(
    model: Any,
    tokenizer: Any,
    encoder: SaeEncoder,
    train_acts: torch.Tensor,
    held_texts: Sequence[str],
) -> Quality:
    """Held-out FVE, L0, dead features (over training and held-out tokens) and the three losses."""
    held_acts = capture(model, tokenizer, held_texts, encoder.layer)
    feats = encoder.encode(held_acts)
    recon = encoder.decode(feats)
    fve = 1 - float(((held_acts - recon) ** 2).sum()) / float(((held_acts - held_acts.mean(0)) ** 2).sum())
    l0 = float((feats > 0).sum(-1).float().mean())
    ever = (feats > 0).any(0)
    for chunk in train_acts.split(8192):
        ever |= (encoder.encode(chunk) > 0).any(0)
    losses = [_loss(model, tokenizer, held_texts, encoder, mode) for mode in ("clean", "splice", "zero")]
    return Quality(
        fve=fve,
        l0=l0,
        dead=int((~ever).sum()),
        d_sae=int(feats.shape[-1]),
        loss_clean=losses[0],
        loss_spliced=losses[1],
        loss_zero=losses[2],
        train_tokens=int(train_acts.shape[0]),
        held_out_tokens=int(held_acts.shape[0]),
    )


def _loss(model: Any, tokenizer: Any, texts: Sequence[str], encoder: SaeEncoder, mode: str) -> float:
    """Mean next-token cross-entropy over every predicted token of ``texts``."""
    tap = LayerTap(model, encoder.layer)
    if mode != "clean":

        def replace(hidden: torch.Tensor) -> torch.Tensor:
            new = (
                torch.zeros_like(hidden) if mode == "zero" else encoder.decode(encoder.encode(hidden)).to(hidden.dtype)
            )
            new[:, 0] = hidden[:, 0]  # the attention sink stays (the SAE is not trained on it)
            return new

        tap.replace = replace
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    total, count = 0.0, 0
    try:
        for batch in _batches(_encode_texts(tokenizer, texts)):
            ids, valid = _padded(batch, pad)
            logits = model(input_ids=ids, attention_mask=valid.long()).logits.float()
            target = ids[:, 1:].masked_fill(~valid[:, 1:], -100)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
            )
            total += float(loss)
            count += int(valid[:, 1:].sum())
    finally:
        tap.remove()
    return total / count


def save(folder: Path, weights: SaeWeights, config: TrainConfig, *, model_name: str, extra: dict[str, Any]) -> None:
    """Write the SAE in SAELens's format, with what made it and how good it is in ``metadata``.

    The tensors are :data:`STORED_DTYPE`; ``dtype`` (what SAELens computes in, casting the
    tensors on load) is float32, as this engine computes.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architecture": "topk",
        "d_in": int(weights.W_enc.shape[0]),
        "d_sae": config.d_sae,
        "k": config.k,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "none",
        "rescale_acts_by_decoder_norm": False,
        "metadata": {
            "model_name": model_name,
            "hook_name": f"blocks.{config.layer}.hook_resid_post",
            "hook_head_index": None,
            "prepend_bos": True,
            "sae_lens_version": "6.0.0",
            "sae_lens_training_version": None,
            "context_size": MAX_TOKENS,
            "trained_by": "prismgate sae train",
            **extra,
        },
    }
    tensors = {
        name: getattr(weights, name).contiguous().to(STORED_DTYPE) for name in ("W_enc", "b_enc", "W_dec", "b_dec")
    }
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / CFG_FILE).write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")


def train_and_evaluate(
    model: Any,
    tokenizer: Any,
    train_texts: Sequence[str],
    held_texts: Sequence[str],
    config: TrainConfig,
    progress: Progress | None = None,
) -> tuple[SaeWeights, Quality, dict[str, float]]:
    """Capture, train, evaluate: the weights, their quality and the seconds each phase took."""
    say = progress or (lambda _t: None)
    times: dict[str, float] = {}
    with deterministic_torch(config.threads):
        t0 = time.perf_counter()
        say(f"capturing layer {config.layer} on {len(train_texts)} texts")
        acts = capture(model, tokenizer, train_texts, config.layer)
        times["capture_s"] = time.perf_counter() - t0
    torch.manual_seed(config.seed)
    previous = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        t1 = time.perf_counter()
        say(f"training {config.d_sae} features, k={config.k}, on {acts.shape[0]} tokens")
        with torch.enable_grad():
            weights = train(acts, config, progress).rounded(STORED_DTYPE)
        times["train_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        say("evaluating on the held-out texts")
        with torch.inference_mode():
            encoder = SaeEncoder(weights.as_sae(config.layer, config.k))
            quality = evaluate(model, tokenizer, encoder, acts, held_texts)
        times["evaluate_s"] = time.perf_counter() - t2
    finally:
        torch.set_num_threads(previous)
    return weights, quality, times
