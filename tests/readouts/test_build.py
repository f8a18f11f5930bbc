"""Concept-pack building on the tiny random Llama: shapes, determinism, the arithmetic, errors, CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prismgate.core.errors import GatewayError
from prismgate.engines.readouts.pack import ConceptPack, view_layer
from prismgate.instruments.packs.build import build_pack, build_pack_and_report
from prismgate.instruments.packs.capture import collect_prompt_means, load_model, token_keep
from prismgate.instruments.packs.cli import main
from prismgate.instruments.packs.prompt_sets import PromptSet, load_prompt_sets
from prismgate.instruments.packs.show import readouts

# Byte-level tokenizer: one token per byte, so lengths are easy to reason about.
COLORS = PromptSet(
    name="colors",
    description="+ red things, - blue things",
    positive=("red apples and red roses", "a red car", "red, red wine", "the red door was open", "red sky at night"),
    negative=(
        "blue apples and blue roses",
        "a blue car",
        "blue, blue sea",
        "the blue door was open",
        "blue sky at noon",
    ),
)
LETTERS = PromptSet(
    name="letters",
    description="+ runs of a, - runs of z",
    positive=("aaaa aaa", "a aa aaaaa", "aaa aaa aaa", "aaaaaaaaa", "aa aa aa aa", "a a a a a a"),
    negative=("zzzz zzz", "z zz zzzzz", "zzz zzz zzz", "zzzzzzzzz", "zz zz zz zz", "z z z z z z"),
)
SETS = [LETTERS, COLORS]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    return load_model(tiny_model_dir, dtype="float32")


def _build(tiny_model_dir: Path, tiny: tuple[Any, Any], layers: list[int], **kw: object) -> ConceptPack:
    model, tokenizer = tiny
    return build_pack(tiny_model_dir, SETS, layers, model=model, tokenizer=tokenizer, dtype="float32", **kw)


def test_pack_has_unit_rows_shapes_and_metadata(tiny_model_dir: Path, tiny: tuple[Any, Any], tmp_path: Path) -> None:
    pack = _build(tiny_model_dir, tiny, [1, 0])
    assert pack.directions.shape == (2, 2, 128)
    assert pack.directions.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(pack.directions, axis=-1), 1.0, atol=1e-6)
    assert pack.layers == (0, 1)  # sorted
    assert pack.concepts == ("colors", "letters")  # sorted by name, whatever the input order
    assert pack.model_id == tiny_model_dir.resolve().name
    assert pack.descriptions == {"colors": COLORS.description, "letters": LETTERS.description}
    assert "difference of means" in pack.method and "sha256:" in pack.method
    pack.save(tmp_path / "p.safetensors")
    again = ConceptPack.load(tmp_path / "p.safetensors")
    assert np.array_equal(again.directions, pack.directions)
    assert again.centers is not None and pack.centers is not None
    assert np.array_equal(again.centers, pack.centers)
    assert (again.layers, again.concepts, again.method) == (pack.layers, pack.concepts, pack.method)


def test_build_is_bit_identical(tiny_model_dir: Path) -> None:
    # Loads the model afresh each time: nothing carried over between the two builds.
    a = build_pack(tiny_model_dir, SETS, [0, 1, 2], dtype="float32")
    b = build_pack(tiny_model_dir, list(reversed(SETS)), [2, 0, 1], dtype="float32")
    assert a.directions.tobytes() == b.directions.tobytes()
    assert a.centers is not None and b.centers is not None and a.centers.tobytes() == b.centers.tobytes()
    assert a.method == b.method


def _reference(model: Any, tokenizer: Any, prompts: tuple[str, ...], layer: int, factor: float = 3.0) -> np.ndarray:
    """Mean of a prompt's tokens 1..n-1 (less massive-norm ones) from HF hidden_states, in numpy."""
    rows = []
    for text in prompts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        h = hs[layer + 1][0].numpy().astype(np.float64)[1:]  # hidden_states[L+1] = output of layer L
        norms = np.linalg.norm(h, axis=-1)
        median = np.sort(norms)[(len(norms) - 1) // 2]  # lower median, as torch.nanmedian
        rows.append(h[norms <= factor * median].mean(axis=0))
    return np.stack(rows)


def test_difference_of_means_matches_numpy_reference(tiny_model_dir: Path, tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    pack = _build(tiny_model_dir, tiny, [0, 1])
    for li, layer in enumerate(pack.layers):
        for ci, ps in enumerate(sorted(SETS, key=lambda s: s.name)):
            diff = _reference(model, tokenizer, ps.positive, layer).mean(0) - _reference(
                model, tokenizer, ps.negative, layer
            ).mean(0)
            expected = diff / np.linalg.norm(diff)
            np.testing.assert_allclose(pack.directions[li, ci], expected, atol=2e-5)


def test_centers_match_numpy_reference(tiny_model_dir: Path, tiny: tuple[Any, Any]) -> None:
    """center = midpoint of the mean (over prompts) of each prompt's mean token readout, per class."""
    model, tokenizer = tiny
    pack = _build(tiny_model_dir, tiny, [0, 1])  # not the last layer: HF's last hidden state is normed
    assert pack.centers is not None and pack.centers.shape == (2, 2) and pack.centers.dtype == np.float32
    assert "centers: center = 0.5 * (mean over positive prompts + mean over negative prompts)" in pack.method
    for li, layer in enumerate(pack.layers):
        for ci, ps in enumerate(sorted(SETS, key=lambda s: s.name)):
            d = pack.directions[li, ci].astype(np.float64)
            pos = _reference(model, tokenizer, ps.positive, layer) @ d  # each prompt's mean token readout
            neg = _reference(model, tokenizer, ps.negative, layer) @ d
            expected = 0.5 * (pos.mean() + neg.mean())
            np.testing.assert_allclose(pack.centers[li, ci], expected, rtol=1e-5, atol=1e-4)
            # The center separates the classes it was built from: positives above, negatives below.
            assert pos.mean() > pack.centers[li, ci] > neg.mean()


def test_last_layer_is_the_layer_output_not_the_normed_hidden_state(
    tiny_model_dir: Path, tiny: tuple[Any, Any]
) -> None:
    model, tokenizer = tiny
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in LETTERS.positive]
    means = collect_prompt_means(model, ids, [2], batch_size=4, outlier_factor=None).means[:, 0]
    captured: list[torch.Tensor] = []
    handle = model.model.layers[2].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        for row, tokens in zip(means, ids, strict=True):
            with torch.no_grad():
                normed = model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1]
            raw = captured.pop()[0, 1:].double().mean(0).numpy()
            np.testing.assert_allclose(row, raw, atol=1e-5)
            assert not np.allclose(row, normed[0, 1:].double().mean(0).numpy(), atol=1e-2)
    finally:
        handle.remove()


def test_batching_and_padding_do_not_change_the_means(tiny_model_dir: Path, tiny: tuple[Any, Any]) -> None:
    one = _build(tiny_model_dir, tiny, [0, 2], batch_size=1)
    many = _build(tiny_model_dir, tiny, [0, 2], batch_size=7)
    np.testing.assert_allclose(one.directions, many.directions, atol=1e-5)


def test_served_readouts_agree_with_the_built_means(tiny_model_dir: Path, tiny: tuple[Any, Any]) -> None:
    """The engine's ReadoutProbe, averaged like the builder averages, gives direction . mean."""
    model, tokenizer = tiny
    pack = _build(tiny_model_dir, tiny, [0, 1], outlier_factor=None)
    text = COLORS.positive[0]
    ids, values = readouts(model, tokenizer, pack, text)
    means = collect_prompt_means(model, [ids], list(pack.layers), outlier_factor=None).means[0]  # [layers, hidden]
    expected = np.einsum("lch,lh->lc", pack.directions.astype(np.float64), means)
    np.testing.assert_allclose(values[1:].mean(axis=0), expected, rtol=1e-4, atol=1e-4)


def test_token_keep_drops_massive_tokens_only() -> None:
    norms = torch.tensor([[900.0, 10.0, 11.0, 200.0, 9.0, 0.0], [5.0, 5.0, 6.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    valid = torch.tensor([[False, True, True, True, True, False], [False, True, True, False, False, False]])
    keep = token_keep(norms, valid, 3.0)
    assert keep.tolist() == [[False, True, True, False, True, False], [False, True, True, False, False, False]]
    assert token_keep(norms, valid, None).tolist() == valid.tolist()


def test_separation_report_scores_an_easy_concept(tiny_model_dir: Path, tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    pack, report = build_pack_and_report(
        tiny_model_dir, SETS, [1], report_layers=[0, 1, 2], folds=3, dtype="float32", model=model, tokenizer=tokenizer
    )
    assert report is not None
    assert report.concepts == ("colors", "letters") and report.layers == (0, 1, 2)
    for r in report.rows:
        assert 0.0 <= r.accuracy <= 1.0 and 0.0 <= r.token_accuracy <= 1.0
        assert r.prompts == (10 if r.concept == "colors" else 12)
        assert r.tokens > r.prompts
    # 'a' runs versus 'z' runs differ in every token: trivially separable even by random weights.
    assert report.get("letters", 0).accuracy == 1.0
    assert report.get("letters", 0).token_accuracy > 0.9
    assert "token accuracy" in report.table()
    assert len(report.to_json()["rows"]) == 6
    assert pack.layers == (1,)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([3], "do not exist: the model has 3 decoder layers"),
        ([-1], "do not exist"),
        ([], "no layers"),
        ([0, 0], "repeat"),
    ],
)
def test_bad_layers_are_refused(tiny_model_dir: Path, tiny: tuple[Any, Any], layers: list[int], message: str) -> None:
    with pytest.raises(GatewayError, match=message):
        _build(tiny_model_dir, tiny, layers)


def test_bad_prompt_sets_are_refused(tiny_model_dir: Path, tiny: tuple[Any, Any], tmp_path: Path) -> None:
    with pytest.raises(GatewayError, match="no positive prompts"):
        PromptSet("x", "", (), ("b",))
    with pytest.raises(GatewayError, match="empty or not strings"):
        PromptSet("x", "", ("a", "  "), ("b",))
    with pytest.raises(GatewayError, match="name"):
        PromptSet("bad name", "", ("a",), ("b",))
    with pytest.raises(GatewayError, match="missing negative"):
        PromptSet.from_dict({"name": "x", "positive": ["a"]})
    with pytest.raises(GatewayError, match="no prompt sets"):
        build_pack(tiny_model_dir, [], [0])
    with pytest.raises(GatewayError, match="unique"):
        build_pack(tiny_model_dir, [COLORS, COLORS], [0], model=tiny[0], tokenizer=tiny[1])
    with pytest.raises(GatewayError, match="same mean"):
        same = PromptSet("same", "", ("hello there",), ("hello there",))
        build_pack(tiny_model_dir, [same], [0], model=tiny[0], tokenizer=tiny[1])
    with pytest.raises(GatewayError, match="nothing left to average"):
        build_pack(tiny_model_dir, [PromptSet("short", "", ("a",), ("bb",))], [0], model=tiny[0], tokenizer=tiny[1])
    (tmp_path / "empty").mkdir()
    with pytest.raises(GatewayError, match=r"no \*\.json"):
        load_prompt_sets([tmp_path / "empty"])
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(GatewayError, match="not valid JSON"):
        load_prompt_sets([tmp_path / "broken.json"])
    with pytest.raises(GatewayError, match="does not exist"):
        load_prompt_sets([tmp_path / "nowhere.json"])


def test_wrong_hidden_size_is_refused(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = np.random.default_rng(0).standard_normal((1, 1, 64)).astype(np.float32)
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    path = tmp_path / "other.safetensors"
    ConceptPack(d, (0,), ("c",), "other-model").save(path)
    assert main(["show", str(path), "--model", str(tiny_model_dir)]) == 2
    assert "hidden size 64 does not match the model's 128" in capsys.readouterr().err


# -- command line ------------------------------------------------------------------------------


def _write_sets(folder: Path) -> Path:
    folder.mkdir()
    for ps in SETS:
        data = {
            "name": ps.name,
            "description": ps.description,
            "positive": list(ps.positive),
            "negative": list(ps.negative),
        }
        (folder / f"{ps.name}.json").write_text(json.dumps(data))
    return folder


def test_cli_build_and_show(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = _write_sets(tmp_path / "sets")
    out, report = tmp_path / "pack.safetensors", tmp_path / "report.json"
    argv = ["build", "--model", str(tiny_model_dir), "--prompt-sets", str(sets), "--layers", "0,1"]
    argv += [
        "--out",
        str(out),
        "--report",
        "--report-layers",
        "all",
        "--report-json",
        str(report),
        "--dtype",
        "float32",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "token accuracy" in captured.out and "wrote" in captured.err
    pack = ConceptPack.load(out)
    assert pack.layers == (0, 1) and pack.concepts == ("colors", "letters")
    assert pack.steering is not None and "steering measured in" in captured.err  # measured by default
    assert {(r["concept"], r["layer"]) for r in json.loads(report.read_text())["rows"]} == {
        (c, layer) for c in ("colors", "letters") for layer in (0, 1, 2)
    }
    assert main(["show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["concepts"] == {"colors": COLORS.description, "letters": LETTERS.description}
    assert shown["shape"] == [2, 2, 128]
    assert np.array_equal(np.array(shown["centers"], dtype=np.float32), pack.centers)
    assert pack.scales is not None
    assert np.array_equal(np.array(shown["scales"], dtype=np.float32), pack.scales)
    assert main(["show", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "centers    midpoint" in summary
    assert f"{float(pack.centers[0, 0]):.2f}" in summary.split("centers")[1]
    # the scales table: a row per concept, a column per layer, each the pack's own number
    scales = summary.split("\nscales")[1].split("\nsteering")[0].splitlines()
    assert scales[0].startswith("     half the gap") and scales[1].split() == ["L0", "L1"]
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in scales[2:]}
    expected = {c: [round(float(v), 2) for v in pack.scales[:, ci]] for ci, c in enumerate(pack.concepts)}
    assert rows == expected
    assert main(["show", str(out), "--similarity", "--model", str(tiny_model_dir), "--text", "red blue red"]) == 0
    text = capsys.readouterr().out
    assert "cosine similarity at layer 1" in text and "fits" in text
    # generate's table: value - center at the view layer, every concept's whole name, position 0 left out
    table = text.split("readouts, value - center:\n")[1].splitlines()
    assert table[0].split() == ["layer", str(pack.layers[view_layer(pack.layers)])]
    assert table[1].split() == ["pos", "token", "logprob", "|", *pack.concepts]
    assert [int(row.split()[0]) for row in table[2:]] == list(range(1, len(table) - 1))
    assert main(["show", str(out), "--model", str(tiny_model_dir), "--text", "red blue", "--layers", "all"]) == 0
    header = capsys.readouterr().out.split("readouts, value - center:\n")[1].splitlines()[0]
    assert header.split() == [w for layer in pack.layers for w in ("layer", str(layer))]


def test_cli_errors_are_clear(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = _write_sets(tmp_path / "sets")
    base = [
        "build",
        "--model",
        str(tiny_model_dir),
        "--prompt-sets",
        str(sets),
        "--out",
        str(tmp_path / "p.safetensors"),
    ]
    assert main([*base, "--layers", "0,7"]) == 2
    assert "layers [7] do not exist" in capsys.readouterr().err
    assert main(base) == 2
    assert "--layers is required" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "missing.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # --text without --model, or a misspelt concept: refused before anything is printed or loaded
    assert main(["show", "--text", "red"]) == 2
    refused = capsys.readouterr()
    assert refused.out == "" and "--text needs --model" in refused.err
    assert main(["show", "--model", str(tiny_model_dir), "--text", "red", "--concepts", "frnch"]) == 2
    refused = capsys.readouterr()
    assert refused.out == "" and "no concept 'frnch'" in refused.err
    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--help"])
    assert exit_info.value.code == 0
    assert "--prompt-sets" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--out", "x", "--layers", "a,b"])
    assert exit_info.value.code == 2
