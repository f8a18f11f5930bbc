"""``prismgate sae``: train a small TopK SAE for a model, label its features, or describe one.

Argument parsing and the three commands; the work is done by :mod:`.train`, :mod:`.labels`,
:mod:`.files` and :mod:`.encode`. Bad input ends with a one-line error and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prismgate.core.errors import invalid
from prismgate.engines.introspect import decoder_layers, hidden_size
from prismgate.engines.sae.encode import SaeEncoder
from prismgate.engines.sae.files import CFG_FILE, load_sae
from prismgate.instruments.packs.capture import deterministic_torch, load_model
from prismgate.instruments.packs.cli import resolve_model_arg, run_command
from prismgate.instruments.sae.auto import SHIPPED, cached_sae_root, layer_dir, sae_folders, train_settings
from prismgate.instruments.sae.corpus import corpus, split
from prismgate.instruments.sae.labels import label_features, write_labels
from prismgate.instruments.sae.train import TrainConfig, save, train_and_evaluate

DEFAULT_TOP = 5


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prismgate sae",
        description="Sparse autoencoders (SAEs) in SAELens's format: train a small TopK one for a served model "
        "on text found on this machine, label its features, or describe one.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,label,show}")
    defaults = TrainConfig(layer=0)
    t = sub.add_parser(
        "train",
        help="train a TopK SAE at one layer of a model and report its quality",
        description="Train a TopK SAE on the residual stream after one decoder layer, on the concept prompt sets "
        "and the documentation of Python's standard library (held-out tenth for the report). Deterministic for "
        "the same thread count. The result is cached by model digest: 'sae = \"auto\"' finds it.",
        epilog="example: prismgate sae train --model default",
    )
    t.add_argument("--model", metavar="PATH", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    t.add_argument("--layer", type=int, help="decoder layer to read after, 0-based (default: the middle one)")
    t.add_argument("--features", type=int, default=defaults.d_sae, help="d_sae (default %(default)s)")
    t.add_argument("--k", type=int, default=defaults.k, help="active features per token (default %(default)s)")
    t.add_argument("--epochs", type=int, default=defaults.epochs, help="passes over the text (default %(default)s)")
    t.add_argument("--out", metavar="DIR", help="where to write cfg.json and sae_weights.safetensors "
                   "(default: the cache, <sae-cache>/<digest>/layer<L>)")  # fmt: skip
    t.add_argument("--sae-cache", metavar="DIR", help="the cache folder (default ~/.cache/prismgate/saes)")
    t.add_argument("--force", action="store_true", help="train again when the cache already holds this SAE")
    t.add_argument("--report-json", metavar="FILE", help="also write the quality report and timings as JSON")
    t.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="model dtype, as the engine serves it (default %(default)s = bfloat16)",
    )
    t.add_argument("--threads", type=int, default=defaults.threads, help="torch threads (default %(default)s)")
    t.add_argument("--no-labels", action="store_true", help="skip labelling the features (labels.json)")

    lab = sub.add_parser(
        "label",
        help="label an SAE's features by the tokens that activate them most on its training corpus",
        description="Write labels.json beside an SAE trained here (train does this itself): each feature's "
        "label is the distinct tokens of its strongest activations on the training texts, most frequent first.",
    )
    _sae_and_model(lab, "model folder (default: the embedded one)")
    lab.add_argument("--threads", type=int, default=defaults.threads, help="torch threads (default %(default)s)")

    s = sub.add_parser(
        "show",
        help="describe an SAE folder (and the features of a text)",
        description="Print an SAE's architecture, layer and size; with --text, the most active features of each "
        "token of the text through the embedded (or --model) model.",
    )
    _sae_and_model(s, "model folder for --text (default: the embedded one)")
    s.add_argument("--labels", metavar="FILE", help="labels JSON (default: the folder's labels.json)")
    s.add_argument("--text", help="print the top features of each token of this text")
    s.add_argument("--top", type=int, default=DEFAULT_TOP, help="features per token (default %(default)s)")
    return parser


def _sae_and_model(parser: argparse.ArgumentParser, model_help: str) -> None:
    """The SAE folder (the shipped one by default) and the model of the commands that run one."""
    parser.add_argument("sae", metavar="DIR", nargs="?", help="SAE folder (default: the embedded model's shipped SAE)")
    parser.add_argument("--model", metavar="PATH", help=model_help)


def main(argv: Sequence[str] | None = None) -> int:
    """``prismgate sae {train,label,show} ...``; returns the exit status."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_command("prismgate sae", args, {"train": _cmd_train, "label": _cmd_label, "show": _cmd_show})


def _cmd_train(args: argparse.Namespace) -> int:
    for name in ("features", "k", "epochs", "threads"):
        if getattr(args, name) < 1:
            raise invalid(f"--{name} must be >= 1")
    if args.k > args.features:
        raise invalid(f"--k ({args.k}) must not exceed --features ({args.features})")
    folder, model_id, _ = resolve_model_arg(args.model)
    t0 = time.perf_counter()
    model, tokenizer = load_model(folder, dtype=args.dtype)
    n_layers = len(decoder_layers(model))
    layer = n_layers // 2 if args.layer is None else args.layer
    if not 0 <= layer < n_layers:
        raise invalid(f"--layer {layer}: the model has layers 0-{n_layers - 1}")
    config = TrainConfig(layer=layer, d_sae=args.features, k=args.k, epochs=args.epochs, threads=args.threads)
    out = Path(args.out) if args.out else layer_dir(cached_sae_root(args.sae_cache, folder, args.dtype), layer)
    if (out / CFG_FILE).is_file() and not args.force:
        held = json.loads((out / CFG_FILE).read_text()).get("metadata", {}).get("train_config")
        if held != train_settings(config):
            raise invalid(f"{out} holds an SAE trained with {held}, not {train_settings(config)}: --force replaces it")
        print(f"{out}: already trained (--force trains again)", file=sys.stderr)
        return 0
    train_texts, held_texts = split(corpus())
    load_s = time.perf_counter() - t0

    def say(text: str) -> None:
        print(f"  {text}", file=sys.stderr)

    weights, quality, times = train_and_evaluate(model, tokenizer, train_texts, held_texts, config, progress=say)
    times = {"load_s": load_s, **times}
    extra = {
        "quality": quality.to_json(),
        "texts": [len(train_texts), len(held_texts)],
        "train_config": train_settings(config),
    }
    save(out, weights, config, model_name=model_id, extra=extra)
    if not args.no_labels:
        say("labelling the features by their strongest tokens")
        _label(model, tokenizer, out, train_texts, config.threads)
    print(
        f"wrote {out}: {config.d_sae} features, k={config.k}, layer {layer} of {n_layers}, "
        f"{quality.train_tokens} training tokens ("
        + ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in times.items())
        + ")",
        file=sys.stderr,
    )
    print("\n".join(quality.lines()))
    if args.report_json:
        Path(args.report_json).write_text(json.dumps({**quality.to_json(), **times}, indent=1) + "\n")
    return 0


def _label(model: Any, tokenizer: Any, folder: Path, texts: Sequence[str], threads: int) -> None:
    with deterministic_torch(threads):
        labels = label_features(model, tokenizer, texts, SaeEncoder(load_sae(folder)))
    path = write_labels(folder, labels)
    print(f"wrote {path}: {len(labels)} features labelled", file=sys.stderr)


def _cmd_label(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise invalid("--threads must be >= 1")
    folder = Path(args.sae) if args.sae else _shipped()
    sae = load_sae(folder)
    model, tokenizer = load_model(resolve_model_arg(args.model)[0])
    sae.check_model(len(decoder_layers(model)), hidden_size(model))
    _label(model, tokenizer, folder, split(corpus())[0], args.threads)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    folder = Path(args.sae) if args.sae else _shipped()
    sae = load_sae(folder, args.labels)
    print(f"sae        {folder}")
    print(f"arch       {sae.architecture}" + (f" (k={sae.k})" if sae.k else ""))
    print(f"hook       {sae.hook_name} (the residual stream after decoder layer {sae.layer})")
    print(f"size       d_in {sae.d_in}, d_sae {sae.d_sae}")
    print(f"labels     {len(sae.labels)}")
    if sae.model_name:
        print(f"model      {sae.model_name}")
    if args.text:
        from prismgate.instruments.sae.show import print_features

        model, tokenizer = load_model(resolve_model_arg(args.model)[0])
        sae.check_model(len(decoder_layers(model)), hidden_size(model))
        print_features(model, tokenizer, sae, args.text, args.top)
    return 0


def _shipped() -> Path:
    found = sae_folders(SHIPPED)
    if not found:
        raise invalid(f"no SAE shipped in {SHIPPED}")
    return found[0]


if __name__ == "__main__":
    raise SystemExit(main())
