"""`wcodec serve`: flags override the WCODEC_* settings and the app runs under uvicorn."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import uvicorn

from wcodec import cli, entry


def test_serve_runs_the_app_under_uvicorn(monkeypatch, tmp_path: Path) -> None:
    ran = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.update(app=app, **kw))
    monkeypatch.setenv("WCODEC_DEFAULT_MODEL", "m")
    assert entry.main(["serve", "--host", "0.0.0.0", "--port", "8123", "--store", str(tmp_path)]) == 0
    settings = ran["app"].state.settings
    assert (ran["host"], ran["port"]) == ("0.0.0.0", 8123)
    assert settings.model_store == tmp_path and settings.default_model == "m"


def test_bad_settings_are_one_line_errors(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WCODEC_MAX_BATCH_SIZE", "zero")
    assert entry.main(["serve"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("wcodec: error: bad server settings: WCODEC_MAX_BATCH_SIZE:") and err.count("\n") == 1


def test_a_bad_flag_value_names_the_flag(monkeypatch, capsys) -> None:
    """`wcodec serve --port 70000` said 'WCODEC_PORT: ...', a variable the user had not set."""
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("the server started"))
    assert entry.main(["serve", "--port", "70000"]) == cli.EXIT_ERROR
    assert capsys.readouterr().err == ("wcodec: error: bad server settings: --port: Input should be less than or "
                                       "equal to 65535\n")
    monkeypatch.setenv("WCODEC_PORT", "-1")
    assert entry.main(["serve"]) == cli.EXIT_ERROR
    assert capsys.readouterr().err.startswith("wcodec: error: bad server settings: WCODEC_PORT: ")


@pytest.mark.parametrize(("name", "value"), [("WCODEC_LOG_LEVEL", "verbose"), ("WCODEC_DEVICE", "gpu"),
                                           ("WCODEC_DEFAULT_MODEL", "../x")])
def test_bad_names_in_settings_are_one_line_errors_at_start(monkeypatch, capsys, name, value) -> None:
    """They were a traceback from logging or torch, or a server whose every request got a 422."""
    monkeypatch.setenv(name, value)
    assert entry.main(["serve"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"wcodec: error: bad server settings: {name}:") and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_asked_for_without_a_gpu_is_a_one_line_error(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WCODEC_DEVICE", "cuda")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("the server started"))
    assert entry.main(["serve"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "WCODEC_DEVICE=cuda" in err and err.count("\n") == 1


def test_an_upper_case_log_level_reaches_uvicorn_as_it_reads_them(monkeypatch, tmp_path: Path) -> None:
    ran = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.update(kw))
    monkeypatch.setenv("WCODEC_LOG_LEVEL", "DEBUG")
    assert entry.main(["serve", "--store", str(tmp_path)]) == 0 and ran["log_level"] == "debug"


def test_help(capsys) -> None:
    assert entry.main(["serve", "--help"]) == 0
    assert "--store" in capsys.readouterr().out
    assert entry.main(["--help"]) == 0
    assert "wcodec serve" in capsys.readouterr().out          # the one entry point names it


def test_an_old_settings_name_is_named_in_its_error(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WCODEC_RESIDENT", "halfway")         # the old name of WCODEC_WEIGHTS
    assert entry.main(["serve"]) == cli.EXIT_ERROR
    assert capsys.readouterr().err.startswith("wcodec: error: bad server settings: WCODEC_RESIDENT:")


def test_old_settings_names_are_aliases(monkeypatch) -> None:
    from service.settings import Settings
    monkeypatch.setenv("WCODEC_RESIDENT", "compressed")
    monkeypatch.setenv("WCODEC_RESIDENT_SLOTS", "3")
    assert (Settings().weights, Settings().compressed_scratch) == ("compressed", 3)
    monkeypatch.setenv("WCODEC_WEIGHTS", "decoded")
    assert Settings().weights == "decoded"


def test_openmp_waits_passively_unless_chosen():
    from wcodec import serve
    env = {}
    serve.omp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    serve.omp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
