"""Hostile GraphPipe requests on a real socket: refused from their counts, before decoding,
while another client's request is answered."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import requests
from graphpipe import remote

from prismgate.core.budget import RequestBudget
from prismgate.core.errors import Code
from tests.graphpipe.helpers import infer_buffer, read_response


def refused_while_another_is_served(url: str, body: bytes) -> tuple[dict[str, Any], float]:
    served: list[list[int]] = []
    other = threading.Thread(
        target=lambda: served.append(
            remote.execute_multi(url, [np.array(["hi"])], [], ["lengths"], '{"max_tokens": 2}')[0].tolist()
        )
    )
    other.start()
    started = time.monotonic()
    reply = requests.post(url + "/graphpipe", data=body, timeout=60)
    took = time.monotonic() - started
    other.join(60)
    assert served and served[0][0] >= 1
    assert reply.status_code == 200
    outputs, errors = read_response(reply.content)
    assert outputs == [] and len(errors) == 1
    return errors[0], took


def test_a_string_tensor_of_many_elements_is_refused_before_decoding(live_server: Any) -> None:
    max_batch = live_server.gateway.settings.graphpipe.max_batch
    body = infer_buffer([np.array([""] * 200_000)], ["prompt"])
    error, took = refused_while_another_is_served(live_server.http_url, body)
    assert error["code"] == Code.INVALID_ARGUMENT
    assert f"200000 strings; this server takes at most {max_batch} rows" in error["message"].decode()
    assert took < 10


def test_too_many_stop_strings_are_refused_by_the_core(live_server: Any) -> None:
    limit = RequestBudget().max_stop_strings
    stops = ", ".join(f'"s{i}"' for i in range(limit + 1))
    body = infer_buffer([np.array(["hi"])], config=f'{{"max_tokens": 2, "stop": [{stops}]}}')
    error, _ = refused_while_another_is_served(live_server.http_url, body)
    assert error["code"] == Code.INVALID_ARGUMENT
    assert f"{limit + 1} stop strings; the limit is {limit}" in error["message"].decode()
