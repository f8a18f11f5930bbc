"""One gateway serving two real models at once, from ``[[models]]``: every protocol routes by model.

The two tiny models differ where it shows: the Qwen2-VL one takes images and has token
ids the Llama one does not (its vocabulary is 259 ids), so a request routed to the
wrong engine fails instead of passing by accident.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import websockets

from prismgate.schemas import salience_images_pb2 as ipb
from prismgate.schemas import salience_models_pb2 as mpb
from prismgate.schemas import salience_models_pb2_grpc
from prismgate.schemas import salience_pb2 as pb
from tests.evergreen.wire import Collector, closed_with, generate, msg, parent, text_leaf
from tests.ops.helpers import Served, scrape, value
from tests.salience.conftest import Client, connect, rpc_error
from tests.scale.conftest import serve_config
from tests.vision_model import build_tiny_qwen2_vl, image_bytes

pytestmark = pytest.mark.slow

LLAMA, VL = "tiny-llama", "tiny-qwen2-vl"
IM_START = 259  # in the Qwen2-VL vocabulary, past the end of the Llama one
PNG = image_bytes(56, 84)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_pack: Path) -> Iterator[Served]:
    vl = build_tiny_qwen2_vl(tmp_path_factory.mktemp("models-vl") / VL)
    config = f"""
max_sessions = 64

[[models]]
name = "{LLAMA}"
model = "{tiny_model_dir}"
concept_pack = "{tiny_pack}"

[[models]]
name = "{VL}"
model = "{vl}"
concept_pack = "none"
dtype = "float32"
max_model_len = 1024
"""
    with serve_config(tmp_path_factory.mktemp("two-models"), config) as server:
        yield server


@pytest.fixture
def salience(served: Served) -> Iterator[Client]:
    client = connect(served.grpc_target)
    yield client
    client.channel.close()


def test_readyz_models_and_metrics_show_each_model(served: Served) -> None:
    ready = httpx.get(served.http_url + "/readyz").json()
    assert ready["ready"] is True and ready["model"] == LLAMA  # the first entry is the default
    assert {name: state["ready"] for name, state in ready["models"].items()} == {LLAMA: True, VL: True}
    listed = httpx.get(served.http_url + "/v1/models").json()
    assert [m["id"] for m in listed["data"]] == [LLAMA, VL]
    metrics = httpx.get(served.http_url + "/metrics").text
    for name in (LLAMA, VL):
        assert f'prismgate_model_ready{{model="{name}"}} 1.0' in metrics


def test_openai_routes_by_model_images_included(served: Served) -> None:
    png = "data:image/png;base64," + base64.b64encode(PNG).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": png}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3}
    answer = httpx.post(served.http_url + "/v1/chat/completions", json={**body, "model": VL}, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == VL and answer.json()["usage"]["completion_tokens"] == 3
    refused = httpx.post(served.http_url + "/v1/chat/completions", json={**body, "model": LLAMA}, timeout=60)
    assert refused.status_code == 400 and "no images" in refused.json()["error"]["message"]
    unknown = httpx.post(served.http_url + "/v1/chat/completions", json={**body, "model": "gpt-4"}, timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_salience_sessions_stay_on_their_model(salience: Client) -> None:
    on_vl, on_llama = salience.open(VL), salience.open(LLAMA)
    _, done = salience.generate(session_id=on_vl, append_tokens=[IM_START, 65], offset=0, max_tokens=2, top_k=1)
    assert done.completion_tokens == 2
    error = rpc_error(salience.generate, session_id=on_llama, append_tokens=[IM_START], offset=0, max_tokens=1)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in (error.details() or "")
    counted = salience.images.CountImageTokens(ipb.CountImageTokensRequest(image=PNG, mime="image/png", model=VL))
    assert counted.n_pad_tokens == 6  # 56x84 -> 2x3 merged patches
    error = rpc_error(
        salience.images.CountImageTokens, ipb.CountImageTokensRequest(image=PNG, mime="image/png", model=LLAMA)
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    error = rpc_error(salience.salience.OpenSession, pb.OpenSessionRequest(model="gpt-4"))
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_graphpipe_serves_each_model_on_its_own_path(served: Served) -> None:
    default = httpx.get(served.http_url + "/graphpipe").json()
    assert default["Name"] == LLAMA
    for name in (LLAMA, VL):
        assert httpx.get(f"{served.http_url}/graphpipe/{name}").json()["Name"] == name
    assert httpx.get(f"{served.http_url}/graphpipe/{VL}/control/is_ready").text == "ok\n"


async def test_evergreen_picks_the_model_from_the_first_generate(served: Served) -> None:
    ws_url = served.http_url.replace("http://", "ws://") + "/evergreen"
    image = {
        "id": "img",
        "chunkFragment": {"metadata": {"mimetype": "image/png"}, "data": base64.b64encode(PNG).decode()},
    }
    on_vl = generate("p", "r", config={"maxTokens": 2}, extra_outputs={"usage": "u"})
    on_vl["targetSpec"] = {"id": VL}
    async with websockets.connect(ws_url, max_size=None) as ws:
        await ws.send(msg(actions=[on_vl], fragments=[parent("p", "q", "img"), text_leaf("q", "Look"), image]))
        out = await Collector(ws).until_complete("r", "u")
        assert out["u"].lines[0]["completionTokens"] == 2
        # the connection is bound now: another model is refused
        other = generate("p2", "r2", config={"maxTokens": 1})
        other["targetSpec"] = {"id": LLAMA}
        await ws.send(msg(actions=[other], fragments=[parent("p2", "q2"), text_leaf("q2", "hi")]))
        code, reason = await closed_with(ws)
        assert code == 4400 and "not this session's model" in reason
    async with websockets.connect(ws_url, max_size=None) as ws:  # no targetSpec: the default, text-only
        await ws.send(
            msg(actions=[generate("p", "r")], fragments=[parent("p", "q", "img"), text_leaf("q", "x"), image])
        )
        code, reason = await closed_with(ws)
        assert code == 4400 and "no images" in reason, json.dumps([code, reason])


def test_salience_models_lists_both_and_serves_each_manifest(salience: Client) -> None:
    stub = salience_models_pb2_grpc.ModelsStub(salience.channel)
    listed = stub.ListModels(mpb.ListModelsRequest(), timeout=10).models
    assert [(m.name, m.is_default, m.state, m.engine) for m in listed] == [
        (LLAMA, True, mpb.MODEL_STATE_READY, "transformers"),
        (VL, False, mpb.MODEL_STATE_READY, "transformers"),
    ]
    llama, vl = listed
    assert (llama.has_concept_pack, llama.has_steering, llama.takes_images) == (True, True, False)
    assert (vl.has_concept_pack, vl.has_steering, vl.takes_images) == (False, False, True)
    assert vl.max_model_len == 1024 and llama.max_model_len != vl.max_model_len
    # OpenSession answers with the same context length ListModels gives
    for model in listed:
        assert (
            salience.salience.OpenSession(pb.OpenSessionRequest(model=model.name)).max_model_len == model.max_model_len
        )

    default = salience.salience.GetReadoutManifest(pb.GetReadoutManifestRequest(), timeout=10)
    assert len(default.concepts) > 0
    assert stub.GetReadoutManifest(mpb.GetReadoutManifestRequest(model=LLAMA), timeout=10) == default
    assert stub.GetReadoutManifest(mpb.GetReadoutManifestRequest(model=VL), timeout=10) == pb.ReadoutManifest()
    error = rpc_error(stub.GetReadoutManifest, mpb.GetReadoutManifestRequest(model="gpt-4"), timeout=10)
    assert error.code() == grpc.StatusCode.NOT_FOUND and f"'{LLAMA}', '{VL}'" in (error.details() or "")


def test_request_metrics_carry_each_model(served: Served, salience: Client) -> None:
    """Each model's own series move, and only by its own requests; a client's model name makes no series."""
    before = scrape(served.http_url)
    session = salience.open(LLAMA)
    _, on_llama = salience.generate(session_id=session, append_tokens=[5, 17, 42], offset=0, max_tokens=3, top_k=1)
    length = on_llama.prompt_tokens + on_llama.completion_tokens
    _, again = salience.generate(session_id=session, append_tokens=[7], offset=length, max_tokens=1, top_k=1)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    answer = httpx.post(served.http_url + "/v1/chat/completions", json={**body, "model": VL}, timeout=120)
    assert answer.status_code == 200, answer.text
    on_vl = answer.json()["usage"]
    error = rpc_error(salience.generate, session_id=salience.open(LLAMA), append_tokens=[IM_START], offset=0)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # refused by the Llama model: its vocabulary
    unknown = httpx.post(served.http_url + "/v1/chat/completions", json={**body, "model": "gpt-4"}, timeout=60)
    assert unknown.status_code == 404
    after = scrape(served.http_url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    salience_llama, openai_vl = {"protocol": "salience", "model": LLAMA}, {"protocol": "openai", "model": VL}
    assert moved("prismgate_requests_total", **salience_llama) == 3
    assert moved("prismgate_requests_total", **openai_vl) == 1
    assert moved("prismgate_requests_total", protocol="salience", model=VL) == 0
    assert moved("prismgate_requests_total", protocol="openai", model=LLAMA) == 0
    streamed = on_llama.completion_tokens + again.completion_tokens
    assert moved("prismgate_streamed_tokens_total", **salience_llama) == streamed > 0
    assert moved("prismgate_streamed_tokens_total", **openai_vl) == on_vl["completion_tokens"] == 2
    prompts = on_llama.prompt_tokens + again.prompt_tokens
    assert moved("prismgate_prompt_tokens_total", **salience_llama) == prompts == 3 + length + 1
    assert moved("prismgate_prompt_tokens_total", **openai_vl) == on_vl["prompt_tokens"]
    # the second Salience turn reused the first one's cache; the one OpenAI turn on the other model had none
    cached = moved("prismgate_prompt_cached_tokens_total", **salience_llama)
    assert cached > 0 and cached + moved("prismgate_prompt_prefilled_tokens_total", **salience_llama) == prompts
    assert moved("prismgate_prompt_cached_tokens_total", **openai_vl) == 0
    assert moved("prismgate_prompt_prefilled_tokens_total", **openai_vl) == on_vl["prompt_tokens"]
    # durations: every generation that reached its model, the refused one too
    for model, turns, durations in ((salience_llama, 2, 3), (openai_vl, 1, 1)):
        assert moved("prismgate_generations_finished_total", finish_reason="length", **model) == turns
        assert moved("prismgate_time_to_first_token_seconds_count", **model) == turns
        assert moved("prismgate_generation_duration_seconds_count", **model) == durations
    assert moved("prismgate_inter_token_latency_seconds_count", **openai_vl) == 1
    assert moved("prismgate_request_errors_total", code="INVALID_ARGUMENT", **salience_llama) == 1
    assert moved("prismgate_request_errors_total", protocol="openai", code="NOT_FOUND", model="") == 1
    models = {dict(labels).get("model") for _, labels in after} - {None}
    assert models == {"", LLAMA, VL}
    assert "gpt-4" not in httpx.get(served.http_url + "/metrics").text
