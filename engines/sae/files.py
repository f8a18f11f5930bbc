"""SAEs in SAELens's on-disk format: a folder with ``cfg.json`` and ``sae_weights.safetensors``.

Read without SAELens (the reference implementation the tests check against, not a runtime
dependency). The ReLU, TopK and JumpReLU architectures on the residual stream
(``blocks.L.hook_resid_post``, or ``hook_resid_pre`` of layer L + 1) are understood, with
configs as SAELens 6 and earlier write them; anything else is refused with a message naming the
file and the field. An optional labels file (a Neuronpedia export, or ``labels.json`` in the
folder) names features. Every field and what it must hold: docs/sae.md, "Loading".
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors import safe_open

from prismgate.core.errors import invalid

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
LABELS_FILE = "labels.json"
ARCHITECTURES = ("standard", "topk", "jumprelu")
DTYPES = ("float32", "float16", "bfloat16", "float64")
_FLOAT_TENSORS = ("F16", "BF16", "F32", "F64")
_HOOK = re.compile(r"blocks\.(\d+)\.hook_resid_(post|pre)")

Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class SparseAutoencoder:
    """One SAE, float32 numpy weights, read after ``layer`` (the residual stream after that decoder layer)."""

    path: Path
    architecture: str
    layer: int
    hook_name: str
    W_enc: Array  # [d_in, d_sae]
    b_enc: Array  # [d_sae]
    W_dec: Array  # [d_sae, d_in]
    b_dec: Array  # [d_in]
    threshold: Array | None = None  # [d_sae], jumprelu only
    k: int | None = None  # topk only
    apply_b_dec_to_input: bool = True
    model_name: str = ""
    labels: dict[int, str] = field(default_factory=dict)
    labels_from: str = ""  # where the labels come from, in words ("" without labels)

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    def label(self, feature: int) -> str | None:
        return self.labels.get(feature)

    def check_model(self, n_layers: int, hidden_size: int) -> None:
        """Refuse an SAE that does not fit the served model: its input size, its layer."""
        where = self.path / CFG_FILE
        if self.d_in != hidden_size:
            raise invalid(f"{where}: d_in is {self.d_in}, but the model's hidden size is {hidden_size}")
        if not 0 <= self.layer < n_layers:
            raise invalid(
                f"{where}: hook {self.hook_name!r} reads after layer {self.layer}, "
                f"but the model has layers 0-{n_layers - 1}"
            )


def load_sae(folder: str | Path, labels: str | Path | None = None) -> SparseAutoencoder:
    """Read and check one SAE folder (and its labels); every refusal names the file and the field."""
    folder = Path(folder)
    cfg_path = folder / CFG_FILE
    weights_path = folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise invalid(f"SAE folder {folder} does not exist")
    for path in (cfg_path, weights_path):
        if not path.is_file():
            raise invalid(f"{path}: missing (an SAE folder in SAELens's format holds {CFG_FILE} and {WEIGHTS_FILE})")
    cfg = _read_cfg(cfg_path)
    architecture = _architecture(cfg, cfg_path)
    d_in, d_sae = (_positive_int(cfg, name, cfg_path) for name in ("d_in", "d_sae"))
    dtype = str(cfg.get("dtype", "float32")).removeprefix("torch.")
    if dtype not in DTYPES:
        raise invalid(f"{cfg_path}: dtype {cfg.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    if cfg.get("normalize_activations", "none") not in ("none", None):
        raise invalid(
            f"{cfg_path}: normalize_activations {cfg['normalize_activations']!r} is not supported (only 'none')"
        )
    if cfg.get("rescale_acts_by_decoder_norm"):
        raise invalid(f"{cfg_path}: rescale_acts_by_decoder_norm true is not supported")
    hook_name, layer = _hook(cfg, cfg_path)
    k = _positive_int(cfg, "k", cfg_path) if architecture == "topk" else None
    if k is not None and k > d_sae:
        raise invalid(f"{cfg_path}: k {k} is larger than d_sae {d_sae}")
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    if architecture == "jumprelu":
        shapes["threshold"] = (d_sae,)
    tensors = _read_tensors(weights_path, shapes)
    return SparseAutoencoder(
        path=folder,
        architecture=architecture,
        layer=layer,
        hook_name=hook_name,
        W_enc=tensors["W_enc"],
        b_enc=tensors["b_enc"],
        W_dec=tensors["W_dec"],
        b_dec=tensors["b_dec"],
        threshold=tensors.get("threshold"),
        k=k,
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
        model_name=str(_metadata(cfg).get("model_name") or cfg.get("model_name") or ""),
        labels=load_labels(_labels_path(folder, labels), d_sae),
        labels_from=_labels_from(folder, labels, _metadata(cfg)),
    )


def _read_cfg(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise invalid(f"{path}: must be a JSON object")
    return cfg


def _metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    meta = cfg.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _architecture(cfg: dict[str, Any], path: Path) -> str:
    """SAELens 6's ``architecture``; before 6, ``activation_fn`` topk with ``activation_fn_kwargs.k`` meant topk."""
    arch = cfg.get("architecture")
    if arch is None:
        fn = cfg.get("activation_fn", cfg.get("activation_fn_str", "relu"))
        kwargs = cfg.get("activation_fn_kwargs") or {}
        if fn == "topk" and isinstance(kwargs, dict) and kwargs.get("k") is not None:
            cfg["k"] = kwargs["k"]
            return "topk"
        arch = "standard"
    if arch not in ARCHITECTURES:
        raise invalid(f"{path}: architecture {arch!r} is not supported (one of {', '.join(ARCHITECTURES)})")
    return str(arch)


def _positive_int(cfg: dict[str, Any], name: str, path: Path) -> int:
    value = cfg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise invalid(f"{path}: {name} must be a positive integer, got {value!r}")
    return value


def _hook(cfg: dict[str, Any], path: Path) -> tuple[str, int]:
    """The hook's name and the decoder layer whose output it reads."""
    name = _metadata(cfg).get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    if not isinstance(name, str):
        raise invalid(f"{path}: hook_name is missing (metadata.hook_name, e.g. 'blocks.12.hook_resid_post')")
    match = _HOOK.fullmatch(name)
    if match is None:
        raise invalid(
            f"{path}: hook_name {name!r} is not supported: only the residual stream, "
            "'blocks.L.hook_resid_post' (or 'blocks.L.hook_resid_pre', L >= 1)"
        )
    layer = int(match[1]) - (match[2] == "pre")
    if layer < 0:
        raise invalid(f"{path}: hook_name {name!r} reads the embeddings, before every decoder layer: not supported")
    return name, layer


def _read_tensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, Array]:
    try:
        handle = safe_open(str(path), framework="numpy")
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise invalid(f"{path}: not a safetensors file ({exc})") from None
    out: dict[str, Array] = {}
    with handle as f:
        names = set(f.keys())
        for name, shape in shapes.items():
            if name not in names:
                raise invalid(f"{path}: tensor {name} is missing")
            sl = f.get_slice(name)
            dtype, got = sl.get_dtype(), tuple(sl.get_shape())
            if dtype not in _FLOAT_TENSORS:
                raise invalid(
                    f"{path}: tensor {name} has dtype {dtype}, expected a float ({', '.join(_FLOAT_TENSORS)})"
                )
            if got != shape:
                raise invalid(f"{path}: tensor {name} has shape {list(got)}, expected {list(shape)} (from cfg.json)")
    # numpy has no bfloat16: read through torch, which every engine has
    import torch
    from safetensors.torch import load_file

    loaded = load_file(str(path))
    for name in shapes:
        array = loaded[name].to(torch.float32).numpy()
        if not np.all(np.isfinite(array)):
            raise invalid(f"{path}: tensor {name} has values that are not finite")
        out[name] = array
    return out


def _labels_path(folder: Path, labels: str | Path | None) -> Path | None:
    if labels is not None:
        return Path(labels)
    own = folder / LABELS_FILE
    return own if own.is_file() else None


def _labels_from(folder: Path, labels: str | Path | None, metadata: dict[str, Any]) -> str:
    """Where the labels come from: the labels file given, or the folder's own (as its cfg.json says it was made)."""
    if labels is not None:
        return f"the labels file {Path(labels).name}"
    if not (folder / LABELS_FILE).is_file():
        return ""
    return str(metadata.get("labels_from") or f"{LABELS_FILE} in the SAE's folder")


def load_labels(path: Path | None, d_sae: int) -> dict[int, str]:
    """Feature id -> label from a JSON object (``{"12": "French"}``) or a Neuronpedia-style list."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise invalid(f"SAE labels file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"{path}: not readable JSON ({exc})") from None
    pairs: list[tuple[object, object]]
    if isinstance(data, dict):
        pairs = list(data.items())
    elif isinstance(data, list) and all(isinstance(x, dict) for x in data):
        pairs = [(x.get("index", x.get("feature")), x.get("description", x.get("label"))) for x in data]
    else:
        raise invalid(f"{path}: must be an object of feature id -> label, or a list of {{index, description}}")
    labels: dict[int, str] = {}
    for key, value in pairs:
        try:
            feature = int(str(key))
        except ValueError:
            raise invalid(f"{path}: feature id {key!r} is not an integer") from None
        if not 0 <= feature < d_sae:
            raise invalid(f"{path}: feature id {feature} is outside 0-{d_sae - 1}")
        if not isinstance(value, str):
            raise invalid(f"{path}: the label of feature {feature} must be a string")
        labels[feature] = value
    return labels


def load_for_model(
    specs: Sequence[tuple[Path, Path | None]], n_layers: int, hidden_size: int
) -> tuple[SparseAutoencoder, ...]:
    """Every SAE of ``specs`` (folder, labels file or None), checked against the model; at most one per layer."""
    saes = tuple(load_sae(folder, labels) for folder, labels in specs)
    seen: dict[int, Path] = {}
    for sae in saes:
        sae.check_model(n_layers, hidden_size)
        if sae.layer in seen:
            raise invalid(
                f"{sae.path / CFG_FILE}: hook_name reads after layer {sae.layer}, as {seen[sae.layer] / CFG_FILE} "
                "does: one SAE per layer"
            )
        seen[sae.layer] = sae.path
    return tuple(sorted(saes, key=lambda s: s.layer))
