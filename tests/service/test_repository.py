"""Triton's model repository extension (/v2/repository): index, load, unload on the demo model,
with requests as tritonclient sends them (no content type; an empty body for the index)."""
from __future__ import annotations


import pytest
from service_helpers import DEMO, assert_error, with_broken_archive

from service.registry import ModelState

pytestmark = pytest.mark.anyio


async def post(server, path: str, body: bytes = b"", **headers: str):
    return await server.client.post(path, content=body, headers=headers)


async def test_index_load_unload_as_tritonclient_sends_them(serve, store) -> None:
    async with serve(store()) as server:
        r = await post(server, "/v2/repository/index")
        assert r.status_code == 200 and r.json() == [{"name": DEMO, "version": "1", "state": "UNAVAILABLE",
                                                      "reason": ""}]
        assert (await post(server, "/v2/repository/index", b'{"ready": true}')).json() == []
        r = await post(server, f"/v2/repository/models/{DEMO}/load", b"{}")
        assert (r.status_code, r.content) == (200, b"") and server.registry.get(DEMO).state is ModelState.READY
        assert (await post(server, "/v2/repository/index", b'{"ready": true}')).json()[0]["state"] == "READY"
        r = await post(server, f"/v2/repository/models/{DEMO}/unload", b'{"parameters": {"unload_dependents": false}}')
        assert (r.status_code, r.content) == (200, b"") and server.registry.get(DEMO).state is ModelState.AVAILABLE


async def test_errors_carry_the_message_tritons_clients_read(serve, store) -> None:
    async with serve(with_broken_archive(store())) as server:
        r = await post(server, "/v2/repository/models/nope/load")
        assert "'nope'" in assert_error(r, 404, "not_found")["error"]
        r = await post(server, f"/v2/repository/models/{DEMO}/load", b'{"parameters": {"config": "{}"}}')
        assert assert_error(r, 422, "validation")["error"] == "not supported by this server: parameters.config"
        assert_error(await post(server, "/v2/repository/index", b"[1"), 422, "validation")
        assert_error(await post(server, "/v2/repository/models/broken/load"), 500, "load_failed")
        broken = [m for m in (await post(server, "/v2/repository/index")).json() if m["name"] == "broken"]
        assert broken[0]["state"] == "UNAVAILABLE" and "broken" in broken[0]["reason"]


async def test_the_schema_shows_the_optional_body(serve, tmp_path) -> None:
    async with serve(tmp_path) as server:
        paths = (await server.client.get("/openapi.json")).json()["paths"]
    for path in ("/v2/repository/index", "/v2/repository/models/{name}/load", "/v2/repository/models/{name}/unload"):
        body = paths[path]["post"]["requestBody"]
        assert body["required"] is False
        assert body["content"]["application/json"]["schema"]["$ref"].endswith("/RepositoryRequest")


async def test_load_and_unload_need_the_admin_token_when_set(serve, store) -> None:
    async with serve(store(), admin_token="s3cret") as server:
        assert_error(await post(server, f"/v2/repository/models/{DEMO}/load"), 401, "unauthorized")
        assert_error(await post(server, f"/v2/repository/models/{DEMO}/unload", Authorization="Bearer x"), 403,
                     "forbidden")
        assert (await post(server, "/v2/repository/index")).status_code == 200


def test_tritonclient_itself(live) -> None:
    """The real client (a test extra): the index, load, the health and readiness calls."""
    import tritonclient.http as httpclient
    url, _ = live
    client = httpclient.InferenceServerClient(url=url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(DEMO)
    assert not client.is_model_ready("nope")
    assert {"name": DEMO, "version": "1", "state": "READY", "reason": ""} in client.get_model_repository_index()
    client.load_model(DEMO)                                   # ready already: a no-op, as Triton's reload
    with pytest.raises(httpclient.InferenceServerException, match="no model 'nope'"):
        client.load_model("nope")


async def test_kserve_health_routes_follow_the_preload(serve, store, monkeypatch) -> None:
    """tritonclient's is_server_live, is_server_ready and is_model_ready read these (they were 404s,
    so a Triton-style probe never passed): live at once, ready once /health/ready is, the model's
    once it is; an empty body, as Triton's."""
    import threading

    from service.load.job import Loader
    gate, real = threading.Event(), Loader.load
    monkeypatch.setattr(Loader, "load", lambda self, name, *args: (name != DEMO or gate.wait(60)) and
                        real(self, name, *args))
    async with serve(with_broken_archive(store()), preload=["broken", DEMO]) as server:
        c = server.client
        await server.wait_state(DEMO, ModelState.LOADING)                 # the preload is in flight
        assert ((r := await c.get("/v2/health/live")).status_code, r.content) == (200, b"")
        assert (await c.get("/health")).status_code == 200
        for path in ("/v2/health/ready", f"/v2/models/{DEMO}/ready", "/health/ready"):
            assert assert_error(r := await c.get(path), 503, "model_not_ready") and r.headers["retry-after"]
        assert "'broken'" in (await c.get("/v2/health/ready")).json()["error"]      # the failed preload's error
        assert_error(await c.get("/v2/models/nope/ready"), 404, "not_found")
        gate.set()
        await server.wait_state(DEMO, ModelState.READY)
        for path in ("/v2/health/ready", f"/v2/models/{DEMO}/ready"):
            assert ((r := await c.get(path)).status_code, r.content) == (200, b"")
        assert_error(await c.get("/v2/models/broken/ready"), 503, "model_not_ready")


async def test_a_body_nested_past_pythons_json_is_a_422(serve, store) -> None:
    """The repository's optional body is parsed by the route itself: one nested past json's
    recursion limit raised RecursionError, which its ValueError clause let through (a 500)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    async with serve(store()) as server:
        for path in ("/v2/repository/index", f"/v2/repository/models/{DEMO}/load",
                     f"/v2/repository/models/{DEMO}/unload"):
            assert "recursion" in assert_error(await post(server, path, deep), 422, "validation")["error"]
        assert server.registry.get(DEMO).state is ModelState.AVAILABLE
