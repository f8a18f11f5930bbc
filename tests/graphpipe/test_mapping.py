"""The tensor mapping: inputs, config and outputs, on the tiny model's real tokenizer and manifest."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from prismgate.codecs.graphpipe import wire
from prismgate.codecs.graphpipe.infer import run_plan
from prismgate.codecs.graphpipe.metadata import describe
from prismgate.codecs.graphpipe.outputs import OUTPUTS, assemble
from prismgate.codecs.graphpipe.plan import Plan, make_plan
from prismgate.core.actions import PositionRange
from prismgate.core.errors import GatewayError
from prismgate.schemas.graphpipe.fb import graphpipe_generated as gp
from tests.graphpipe.helpers import infer_buffer


async def plan_for(service: Any, *args: Any, **kwargs: Any) -> Plan:
    call = wire.decode_request(infer_buffer(*args, **kwargs))
    assert call is not None
    return await make_plan(service, call, max_batch=8)


async def plan_error(service: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(GatewayError) as info:
        await plan_for(service, *args, **kwargs)
    assert info.value.message
    return info.value.message


def rows(plan: Plan) -> list[tuple[int, ...]]:
    """Each row's prompt tokens (an ephemeral turn appends its whole prompt)."""
    return [turn.action.append_tokens for turn in plan.turns]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("[1]", "must be a JSON object"),
        ("{not json", "must be a JSON object"),
        ('{"max_token": 3}', "unknown config key(s) 'max_token'"),
        ('{"max_tokens": "3"}', "config.max_tokens must be an integer"),
        ('{"max_tokens": true}', "config.max_tokens must be an integer"),
        ('{"max_tokens": -1}', "max_tokens must be >= 0"),
        ('{"temperature": -1}', "temperature must be a finite number >= 0"),
        ('{"top_p": 0}', "top_p must be in (0, 1]"),
        ('{"stop": [1]}', "config.stop must be a string or a list of strings"),
        ('{"stop_token_ids": [1, "a"]}', "config.stop_token_ids[1] must be an integer"),
        ('{"chat_template": "no"}', "config.chat_template must be true or false"),
        ('{"logprobs": 21}', "config.logprobs must be in [0, 20], got 21"),
        ('{"readout_layers": [7]}', "[7] not in the concept pack's layers"),
        ('{"readout_layers": [1, 1]}', "repeats a layer"),
    ],
)
async def test_bad_config_is_a_clear_error(tiny_service: Any, config: str, expected: str) -> None:
    assert expected in await plan_error(tiny_service, [np.array(["hi"])], config=config)


async def test_input_binding_errors(tiny_service: Any) -> None:
    s = tiny_service
    assert "unknown input 'image'" in await plan_error(s, [np.array(["hi"])], ["image"])
    assert "unknown output 'logits'" in await plan_error(s, [np.array(["hi"])], None, ["logits"])
    assert "not both" in await plan_error(s, [np.array(["hi"]), np.array([[1]])], ["prompt", "tokens"])
    assert "must be a String tensor" in await plan_error(s, [np.array([1.5])], ["prompt"])
    assert "must be an integer tensor" in await plan_error(s, [np.array([[1.5]])], ["tokens"])
    assert "shape [batch] or be a scalar" in await plan_error(s, [np.array([["a"]])], ["prompt"])
    assert "at most 8" in await plan_error(s, [np.array(["a"] * 9)])
    assert "need config.logprobs" in await plan_error(s, [np.array(["a"])], None, ["top_logprobs"])
    assert "no input tensors" in await plan_error(s, [])


async def test_prompt_rows_use_the_chat_template_unless_turned_off(tiny_service: Any) -> None:
    tok = tiny_service.info().tokenizer
    chat = await plan_for(tiny_service, [np.array(["hello", "yo"])])
    assert rows(chat) == [
        tuple(tok.render_chat([{"role": "user", "content": "hello"}])),
        tuple(tok.render_chat([{"role": "user", "content": "yo"}])),
    ]
    raw = await plan_for(tiny_service, [np.array("hello")], config='{"chat_template": false}')
    assert rows(raw) == [tuple(tok.encode("hello"))]


async def test_unnamed_integer_tensor_is_tokens_and_padding_is_dropped(tiny_service: Any) -> None:
    plan = await plan_for(tiny_service, [np.array([[5, 6, 7], [8, -1, -1]], dtype=np.int64)])
    assert rows(plan) == [(5, 6, 7), (8,)]
    assert plan.shape.outputs == ["text"] and plan.detokenize


async def test_config_becomes_the_generate_spec(tiny_service: Any) -> None:
    config = (
        '{"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3, "stop": "x", '
        '"stop_token_ids": [2], "logprobs": 2, "readout_layers": [1]}'
    )
    plan = await plan_for(
        tiny_service, [np.array([[1, 2, 3]])], ["tokens"], ["top_logprobs", "readouts"], config=config
    )
    spec = plan.turns[0].action.spec
    assert (spec.max_tokens, spec.temperature, spec.top_p, spec.top_k, spec.seed) == (5, 0.5, 0.9, 7, 3)
    assert spec.stop_strings == ("x",) and spec.stop_token_ids == (2,) and spec.logprob_top_k == 2
    assert [(r.start, r.end) for r in spec.logprob_ranges] == [(3, 8)]
    assert [(r.start, r.end) for r in spec.readout_ranges] == [(3, 8)]
    assert plan.shape.layers == (1,) and not plan.detokenize


async def test_rows_run_and_assemble_into_padded_tensors(tiny_service: Any) -> None:
    outputs = ["tokens", "lengths", "logprobs", "top_logprob_ids", "top_logprobs", "readouts", "text"]
    plan = await plan_for(
        tiny_service,
        [np.array([[1, 2, 3], [4, 5, 6]])],
        ["tokens"],
        outputs,
        config='{"max_tokens": 4, "logprobs": 3, "stop_token_ids": []}',
    )
    short = (PositionRange(3, 5),)  # row 1 stops after 2 tokens, so the tensors need padding
    action = plan.turns[1].action
    spec = dataclasses.replace(action.spec, max_tokens=2, logprob_ranges=short, readout_ranges=short)
    plan.turns[1] = dataclasses.replace(plan.turns[1], action=dataclasses.replace(action, spec=spec))
    results = await run_plan(tiny_service, plan)
    manifest = tiny_service.info().readouts
    tensors = dict(zip(outputs, assemble(plan.shape, results, manifest), strict=True))
    n0, n1 = len(results[0].ids), len(results[1].ids)
    assert n1 <= 2 and n0 <= 4
    m = max(n0, n1)
    assert tensors["lengths"].array is not None and tensors["lengths"].array.tolist() == [n0, n1]
    ids = tensors["tokens"].array
    assert ids is not None and ids.shape == (2, m) and ids.dtype == np.int32
    assert ids[0, :n0].tolist() == results[0].ids and (ids[1, n1:] == -1).all()
    lp = tensors["logprobs"].array
    assert lp is not None and np.isfinite(lp[1, :n1]).all() and np.isnan(lp[1, n1:]).all()
    top_ids, top_lp = tensors["top_logprob_ids"].array, tensors["top_logprobs"].array
    assert top_ids is not None and top_lp is not None and top_ids.shape == top_lp.shape == (2, m, 3)
    assert np.all(np.diff(top_lp[0, :n0], axis=-1) <= 0)  # best first
    ro = tensors["readouts"].array
    assert manifest is not None and ro is not None
    assert ro.shape == (2, m, len(manifest.layers), len(manifest.concepts)) and ro.dtype == np.float32
    assert np.isfinite(ro[0, :n0]).all()
    assert tensors["text"].type == gp.Type.String and len(tensors["text"].strings) == 2


async def test_metadata_describes_the_mapping(tiny_service: Any) -> None:
    info = tiny_service.info()
    meta = describe(info)
    assert meta.name == info.model_id and meta.server == "prismgate" and meta.version
    assert [io.name for io in meta.inputs] == ["prompt", "tokens"]
    assert [io.name for io in meta.outputs] == list(OUTPUTS)
    assert all(io.type != gp.Type.Null and io.description for io in meta.inputs + meta.outputs)
    readouts = meta.outputs[-1]
    assert readouts.shape == (-1, -1, -1, len(info.readouts.concepts))
    assert all(c in readouts.description for c in info.readouts.concepts)
    assert "max_tokens" in meta.description and "readout_layers" in meta.description
