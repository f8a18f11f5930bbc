"""``prismgate concepts``: build a concept pack from prompt sets, or describe one.

Argument parsing and the two commands; the work is done by :mod:`.build` and :mod:`.show`.
Bad input ends with a one-line error and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from prismgate.core.errors import GatewayError, invalid
from prismgate.engines.introspect import decoder_layers, hidden_size
from prismgate.engines.readouts.pack import PREFERRED_VIEW_LAYER, ConceptPack
from prismgate.engines.readouts.table import Columns
from prismgate.instruments.packs.auto import pack_at_layers, select_layers
from prismgate.instruments.packs.build import (
    DEFAULT_LAYERS,
    DEFAULT_LAYERS_NOTE,
    DEFAULT_PACK,
    PROMPT_SETS_DIR,
    build_pack_and_report,
)
from prismgate.instruments.packs.capture import DEFAULT_BATCH, load_model
from prismgate.instruments.packs.prompt_sets import load_prompt_sets
from prismgate.instruments.packs.report import DEFAULT_FOLDS
from prismgate.instruments.packs.show import describe, print_readouts, print_similarity, print_summary
from prismgate.instruments.packs.steering_range import Rung, describe_rungs, measure_steering


def _layer_list(text: str) -> list[int] | str:
    if text.strip() in ("all", "auto"):
        return text.strip()
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers (or 'all'), got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prismgate concepts",
        description="Build and inspect concept packs: unit directions in the residual stream that the gateway "
        "projects each token's hidden state onto (its 'readouts').",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{build,show}")

    b = sub.add_parser(
        "build",
        help="build a pack from contrastive prompt sets (difference of means)",
        description="Build a concept pack: for each prompt set and layer, the normalised difference between the "
        "mean residual stream of its positive and its negative prompts. Deterministic; runs on CPU.",
        epilog="example: OMP_NUM_THREADS=1 prismgate concepts build --out pack.safetensors --report",
    )
    b.add_argument(
        "--model", metavar="PATH", help="Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)"
    )
    b.add_argument(
        "--model-id", metavar="ID", help="model id recorded in the pack (default: the model's id or folder name)"
    )
    b.add_argument(
        "--prompt-sets",
        nargs="+",
        metavar="DIR_OR_FILE",
        default=[str(PROMPT_SETS_DIR)],
        help="prompt set JSON files and/or folders of them (default: the sets shipped with prismgate)",
    )
    b.add_argument(
        "--layers",
        type=_layer_list,
        metavar="L1,L2,...",
        help="decoder layers to read after, 0-based; 'auto': up to 8 chosen by the held-out separation report "
        "over every layer, as --concept-pack auto does (default for the embedded model: "
        f"{','.join(map(str, DEFAULT_LAYERS))})",
    )
    b.add_argument("--out", required=True, metavar="PACK", help="where to write the pack (.safetensors)")
    b.add_argument("--report", action="store_true", help="print the held-out separation of each concept at each layer")
    b.add_argument(
        "--no-steering",
        action="store_true",
        help="skip measuring where each concept steers and how hard (the layer, starting scale and fluent range "
        "that prismgate concepts show prints and the playground starts from)",
    )
    b.add_argument(
        "--steering-report", action="store_true", help="print every steering rung measured: effect, fluency, answers"
    )
    b.add_argument(
        "--report-layers",
        type=_layer_list,
        metavar="all|L1,L2,...",
        help="layers to report on (default: the pack's layers; 'all' to choose layers)",
    )
    b.add_argument("--report-json", metavar="FILE", help="also write the separation report as JSON")
    b.add_argument(
        "--folds", type=int, default=DEFAULT_FOLDS, help="held-out folds for the report (default %(default)s)"
    )
    b.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="model dtype, as the engine serves it (default %(default)s = bfloat16)",
    )
    b.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    b.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH, help="prompts per forward pass (default %(default)s)"
    )
    b.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s; 1 is reproducible)")

    s = sub.add_parser(
        "show",
        help="describe a pack (and check it against a model)",
        description="Print a pack's model, layers, concepts and method; with --model, check that it fits that "
        "model; with --text, print the readouts of each token of a text.",
    )
    s.add_argument(
        "pack", metavar="PACK", nargs="?", default=str(DEFAULT_PACK), help="pack file (default: the shipped pack)"
    )
    s.add_argument("--json", action="store_true", help="print the description as JSON")
    s.add_argument("--similarity", action="store_true", help="print cosine similarity between concepts, per layer")
    s.add_argument(
        "--model", metavar="PATH", help="check the pack against this model folder ('default': the embedded one)"
    )
    s.add_argument(
        "--text",
        help="with --model: print the readouts of each token of this text after the first, value - center, "
        "as prismgate generate --readouts prints them",
    )
    s.add_argument(
        "--layers",
        metavar="L,L",
        help=f"with --text: layers to show, from the pack, or 'all' (default: {PREFERRED_VIEW_LAYER} when the pack "
        "has it, else its middle layer)",
    )
    s.add_argument("--concepts", metavar="NAME,NAME", help="with --text: concepts to show, by name (default: all)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``prismgate concepts {build,show} ...``; returns the exit status."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_command("prismgate concepts", args, {"build": _cmd_build, "show": _cmd_show})


def run_command(prog: str, args: argparse.Namespace, commands: dict[str, Callable[[argparse.Namespace], int]]) -> int:
    """Run ``args.command``; a :class:`GatewayError` is one line on stderr and exit status 2."""
    try:
        return commands[args.command](args)
    except GatewayError as e:
        print(f"{prog} {args.command}: error: {e.message}", file=sys.stderr)
        return 2


def resolve_model_arg(path: str | None) -> tuple[Path, str, bool]:
    """A ``--model`` argument (absent or 'default': the embedded model): folder, model id, whether the default."""
    from prismgate.engines.models import DEFAULT_MODEL_ID, resolve_model

    if path in (None, "", "default"):
        folder, model_id = resolve_model(None)
        return folder, DEFAULT_MODEL_ID, True
    folder, model_id = resolve_model(path)
    return folder, model_id, False


def _cmd_build(args: argparse.Namespace) -> int:
    folder, model_id, is_default = resolve_model_arg(args.model)
    layers = args.layers
    if layers is None:
        if not is_default:
            raise invalid(
                "--layers is required for a model other than the embedded default "
                "(layer numbers, or 'auto' to choose them by the held-out separation report)"
            )
        layers = list(DEFAULT_LAYERS)
    sets = load_prompt_sets(args.prompt_sets)
    t0 = time.perf_counter()
    model, tokenizer = load_model(folder, dtype=args.dtype, device=args.device)
    n_layers = len(decoder_layers(model))
    choose = layers == "auto"
    if layers in ("all", "auto"):
        layers = list(range(n_layers))
    report_layers = None
    if args.report or args.report_json:
        rl = args.report_layers or layers
        report_layers = list(range(n_layers)) if rl == "all" else rl
    if choose:
        report_layers = sorted(set(report_layers or ()) | set(layers))
    t1 = time.perf_counter()
    note = DEFAULT_LAYERS_NOTE if is_default and tuple(layers) == DEFAULT_LAYERS else ""
    pack, report = build_pack_and_report(
        folder,
        sets,
        layers,
        model_id=args.model_id or model_id,
        report_layers=report_layers,
        folds=args.folds,
        dtype=args.dtype,
        batch_size=args.batch_size,
        threads=args.threads,
        layer_note=note,
        model=model,
        tokenizer=tokenizer,
    )
    if choose:
        assert report is not None
        pack = pack_at_layers(pack, *select_layers(report, n_layers))
    t2 = time.perf_counter()
    rungs: list[Rung] = []
    if not args.no_steering:
        del model
        pack, rungs = measure_steering(folder, pack, dtype=args.dtype, device=args.device, threads=args.threads)
    t3 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pack.save(out)
    n_prompts = sum(len(s.positive) + len(s.negative) for s in sets)
    print(
        f"wrote {out}: {len(pack.concepts)} concepts x {len(pack.layers)} layers {list(pack.layers)}, hidden "
        f"{pack.hidden_size}, from {n_prompts} prompts (load {t1 - t0:.1f} s, build {t2 - t1:.1f} s, "
        f"steering {'not measured' if args.no_steering else f'measured in {t3 - t2:.1f} s'})",
        file=sys.stderr,
    )
    if args.steering_report and rungs:
        print(describe_rungs(rungs, tokenizer.decode))
    if report is not None:
        if args.report:
            print(report.table())
        if args.report_json:
            Path(args.report_json).write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    if args.text and args.model is None:  # before anything is printed
        raise invalid("--text needs --model (a model folder, or 'default' for the embedded one)")
    if (args.layers or args.concepts) and not args.text:
        raise invalid("--layers and --concepts choose the columns of --text's table: give --text too")
    pack = ConceptPack.load(args.pack)
    columns = Columns.choose(pack.manifest, args.layers, args.concepts) if args.text else None
    if args.json:
        print(json.dumps(describe(pack), indent=2, ensure_ascii=False))
    else:
        print_summary(pack, args.pack)
    if args.similarity:
        print_similarity(pack)
    if args.model is not None:
        folder, _, _ = resolve_model_arg(args.model)
        model, tokenizer = load_model(folder)
        pack.check_model(len(decoder_layers(model)), hidden_size(model))
        print(f"fits       {folder}")
        if args.text and columns is not None:
            print_readouts(model, tokenizer, pack, args.text, columns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
