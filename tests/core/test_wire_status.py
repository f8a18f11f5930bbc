"""One table maps every core error code onto every wire: checked once per wire, here.

Each wire's encoder is asked for every code and must answer what ``WIRE_STATUS`` says:
HTTP (OpenAI's error bodies, GraphPipe's HTTP-status mode), the Evergreen close code
(4000 + HTTP status) and the gRPC status the shared guard aborts with.
"""

from __future__ import annotations

import grpc
import pytest

from prismgate.codecs.evergreen.errors import close_reason
from prismgate.codecs.graphpipe.http import BodyTooLarge
from prismgate.codecs.graphpipe.http import http_status as graphpipe_status
from prismgate.codecs.grpc_guard import grpc_status
from prismgate.codecs.openai.errors import from_gateway
from prismgate.codecs.status import WIRE_STATUS, close_code, code_of_close
from prismgate.core.errors import Code, GatewayError


def test_every_code_has_a_row() -> None:
    assert set(WIRE_STATUS) == set(Code)


@pytest.mark.parametrize("code", list(Code))
def test_http_wires_use_the_table(code: Code) -> None:
    error = GatewayError(code, "x")
    assert from_gateway(error).status == WIRE_STATUS[code].http
    assert graphpipe_status(error) == WIRE_STATUS[code].http


@pytest.mark.parametrize("code", list(Code))
def test_evergreen_close_codes_use_the_table(code: Code) -> None:
    assert close_code(code) == 4000 + WIRE_STATUS[code].http
    assert code_of_close(close_code(code)) is not None
    assert close_reason(GatewayError(code, "x")).startswith(code.name)


@pytest.mark.parametrize("code", list(Code))
def test_grpc_uses_the_codes_own_status(code: Code) -> None:
    status = grpc_status(code)
    assert status.name == WIRE_STATUS[code].grpc_name == code.name
    assert status.value[0] == int(code)


def test_failed_precondition_is_400_on_every_http_wire_and_4400_on_evergreen() -> None:
    error = GatewayError(Code.FAILED_PRECONDITION, "x")
    assert from_gateway(error).status == graphpipe_status(error) == 400
    assert close_code(Code.FAILED_PRECONDITION) == 4400
    assert grpc_status(Code.FAILED_PRECONDITION) is grpc.StatusCode.FAILED_PRECONDITION


def test_a_body_over_the_limit_refines_resource_exhausted_to_413() -> None:
    assert graphpipe_status(BodyTooLarge(10, 11)) == 413
    assert graphpipe_status(GatewayError(Code.RESOURCE_EXHAUSTED, "x")) == 429
