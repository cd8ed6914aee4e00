"""`wcodec serve`: flags override the WCODEC_* settings and the app runs under uvicorn."""
from __future__ import annotations

from pathlib import Path

import pytest
import uvicorn

from wcodec import cli


def test_serve_runs_the_app_under_uvicorn(monkeypatch, tmp_path: Path) -> None:
    ran = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.update(app=app, **kw))
    monkeypatch.setenv("WCODEC_DEFAULT_MODEL", "m")
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "8123", "--store", str(tmp_path)]) == 0
    settings = ran["app"].state.settings
    assert (ran["host"], ran["port"]) == ("0.0.0.0", 8123)
    assert settings.model_store == tmp_path and settings.default_model == "m"


def test_bad_settings_are_one_line_errors(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WCODEC_MAX_BATCH_SIZE", "zero")
    assert cli.main(["serve"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("wcodec: error: bad server settings: WCODEC_MAX_BATCH_SIZE:") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["serve", "--help"]])
def test_help(argv, capsys) -> None:
    assert cli.main(argv) == 0
    assert "--store" in capsys.readouterr().out


def test_openmp_waits_passively_unless_chosen():
    from wcodec import serve
    env = {}
    serve.omp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    serve.omp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
