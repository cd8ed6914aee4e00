"""Property-based run of the whole API against its own OpenAPI schema (schemathesis), against a
real `wcodec serve` process on the loopback with the demo preloaded: a bounded number of generated
requests per operation; no 5xx but the documented 503 (model not ready), and no response that
breaks the schema (status, content type, headers, body). Token limits are kept small so that
any generated request finishes in seconds on a CPU."""
from __future__ import annotations

import asyncio
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from service_helpers import DEMO

from tests.faults.server import ServerProcess
from tests.faults.storm import wait_ready

EXAMPLES = int(os.environ.get("WCODEC_SCHEMA_EXAMPLES", "12"))      # per operation; the long form: 50
LIMITS = {"WCODEC_MAX_INPUT_TOKENS": "40", "WCODEC_MAX_TOTAL_TOKENS": "48", "WCODEC_DEFAULT_MAX_NEW_TOKENS": "4"}


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    env = {"WCODEC_DEVICE": "cpu", "WCODEC_PRELOAD": f'["{DEMO}"]', **LIMITS}
    with ServerProcess(store(), env=env, log=tmp_path_factory.mktemp("schema") / "server.log") as s:
        asyncio.run(wait_ready(s.url))
        yield s


@pytest.fixture(scope="module")
def store(demo_archive, tmp_path_factory):          # module scope: one server for every example
    root = tmp_path_factory.mktemp("schema-store")
    (root / f"{DEMO}.wcodec").hardlink_to(demo_archive)
    return lambda: root


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api")
CHECKS = [status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@pytest.mark.timeout(600)
def test_api_keeps_its_schema(case, server) -> None:
    response = case.call(base_url=server.url, timeout=120)
    if record := os.environ.get("WCODEC_SCHEMA_RECORD"):          # the long form counts the statuses
        with open(record, "a") as f:
            f.write(f"{case.method} {case.path} {response.status_code}\n")
    assert response.status_code < 500 or response.status_code == 503, (response.status_code, response.text[:300])
    case.validate_response(response, checks=CHECKS)


@pytest.mark.anyio
@pytest.mark.parametrize("body", [b'{"inputs": "\xff\xfe"}', b"\x80{", b"{not json"], ids=["bad-utf8", "binary", "not-json"])
async def test_unparsable_bodies_are_documented_422s(serve, tmp_path, body: bytes) -> None:
    """Found by the schema run: a body that is not UTF-8 answered an undocumented 400."""
    async with serve(tmp_path) as server:
        r = await server.client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
