"""The `wcodec` command line's usage errors, inputs of the wrong kind and its standard output
going away: one line on stderr or none, never argparse's multi-line usage or a traceback (README,
"Command line")."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wcodec import cli, entry

REPO = Path(__file__).resolve().parents[1]


def one_usage_line(capsys, argv: list[str], command: str) -> str:
    code = entry.main(argv)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"{command}: error: ") and f"`{command} --help`" in lines[0], err
    return lines[0]


@pytest.mark.parametrize(("argv", "command", "needle"), [
    (["compress"], "wcodec compress", "required: src, dst"),
    (["compress", "a", "b", "--workers", "0"], "wcodec compress", "'0' is not a positive integer"),
    (["inspect", "x.wcodec", "--bogus"], "wcodec inspect", "unrecognized arguments: --bogus"),
    (["verify", "x.wcodec", "--against"], "wcodec verify", "--against: expected one argument"),
    (["bench", "x", "--cast", "int4"], "wcodec bench", "invalid choice: 'int4'"),
    (["serve", "--port", "abc"], "wcodec serve", "invalid int value: 'abc'"),
    (["serve", "--bogus"], "wcodec serve", "unrecognized arguments: --bogus"),
    ([], "wcodec", "required: COMMAND"),
])
def test_usage_errors_are_one_line(capsys, argv: list[str], command: str, needle: str) -> None:
    """They were argparse's usage (five lines for compress) and its error; an unknown flag after a
    command was reported against `wcodec`'s usage, not the command's."""
    assert needle in one_usage_line(capsys, argv, command)


def test_an_unknown_command_names_serve_among_the_choices(capsys) -> None:
    line = one_usage_line(capsys, ["frobnicate"], "wcodec")
    assert "invalid choice: 'frobnicate'" in line and "'serve'" in line


def test_help_lists_serve_as_a_command(capsys) -> None:
    assert entry.main(["--help"]) == 0
    assert any(line.split()[:3] == ["serve", "serve", "models"] for line in capsys.readouterr().out.splitlines())


def test_a_closed_standard_output_is_no_error(tmp_path: Path) -> None:
    """`wcodec inspect x --json | head -1` printed `wcodec: error: [Errno 32] Broken pipe`."""
    src, dst = tmp_path / "t.safetensors", tmp_path / "t.wcodec"
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(src))
    assert cli.main(["compress", str(src), str(dst), "--workers", "1"]) == 0
    read, write = os.pipe()
    os.close(read)                              # the reader is gone before anything is written
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        proc = subprocess.run([sys.executable, "-m", "wcodec", "inspect", str(dst), "--json"], stdout=write,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=300, check=False)
    finally:
        os.close(write)
    assert proc.returncode == cli.EXIT_ERROR and proc.stderr == "", proc.stderr


def test_decompress_into_a_missing_folder_fails_before_decoding(tmp_path: Path, monkeypatch, capsys) -> None:
    """It decoded the whole model, then failed naming safetensors' own temporary file."""
    src = tmp_path / "t.safetensors"
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(src))
    assert cli.main(["compress", str(src), str(tmp_path / "t.wcodec"), "--workers", "1"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(cli, "_load_archive", lambda *a, **k: pytest.fail("decoded before checking the folder"))
    dst = tmp_path / "missing" / "t.safetensors"
    assert cli.main(["decompress", str(tmp_path / "t.wcodec"), str(dst)]) == cli.EXIT_ERROR
    assert capsys.readouterr().err == f"wcodec: error: {dst}: cannot create: No such file or directory\n"
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("command", ["compress", "verify"])
def test_an_archive_given_as_the_checkpoint_is_named_as_one(tmp_path: Path, capsys, command: str) -> None:
    """`wcodec compress a.wcodec b.wcodec` said 'not a safetensors or GGUF file'."""
    src = tmp_path / "t.safetensors"
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(src))
    archive = tmp_path / "t.wcodec"
    assert cli.main(["compress", str(src), str(archive), "--workers", "1"]) == 0
    capsys.readouterr()
    argv = ["compress", str(archive), str(tmp_path / "u.wcodec")] if command == "compress" else \
        ["verify", str(archive), "--against", str(archive)]
    assert cli.main(argv) == cli.EXIT_ERROR
    assert capsys.readouterr().err == (f"wcodec: error: {archive}: is a .wcodec archive, not a checkpoint "
                                       "(`wcodec decompress` makes a .safetensors of it)\n")
