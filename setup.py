"""Builds cuda_ext._C ahead of time when torch is importable at install time (pip install
--no-build-isolation): the CUDA kernels + C++ twin where a CUDA torch and nvcc exist, else the
C++ twin alone. WCODEC_BUILD_EXT=0 skips it; cuda_ext then JIT-builds or falls back to NumPy."""
import os
import shutil

from setuptools import setup

CSRC = os.path.join("cuda_ext", "csrc")
CXX = ["-O3", "-fopenmp", "-ffp-contract=off", "-DWCODEC_PYTHON_MODULE"]   # no FMA: gguf_blocks.h
NVCC = ["-O3", "--use_fast_math", "-lineinfo"]
DEFAULT_ARCH_LIST = "8.0;8.6;8.9;9.0;10.0;12.0"     # as cuda_ext/build.py


def extensions():
    if os.environ.get("WCODEC_BUILD_EXT", "1") == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, is_ninja_available
    except ImportError:
        return {}
    cpu = sources(".cpp")
    common = dict(include_dirs=[os.path.abspath(CSRC)], extra_link_args=["-fopenmp"])
    if torch.version.cuda and shutil.which("nvcc"):
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        ext = CUDAExtension("cuda_ext._C", cpu + sources(".cu"),
                            extra_compile_args={"cxx": CXX, "nvcc": NVCC}, **common)
    else:
        ext = CppExtension("cuda_ext._C", cpu, extra_compile_args={"cxx": CXX}, **common)
    # ninja (scripts/setup.sh installs it) compiles the sources in parallel: the C++ twin on 2 cores
    # 2 min 36 s -> 1 min 52 s (AMD EPYC, 2026-11-30); without it setuptools compiles them one by one.
    build = twin_objects(BuildExtension).with_options(use_ninja=is_ninja_available())
    return {"ext_modules": [ext], "cmdclass": {"build_ext": build}}


def sources(suffix: str) -> list[str]:
    """Every file of cuda_ext/csrc that ends in `suffix` (".cpp": the C++ twin, ".cu": the kernels),
    as cuda_ext/build.py's JIT build takes them."""
    return sorted(os.path.join(CSRC, name) for name in os.listdir(CSRC) if name.endswith(suffix))


def twin_objects(base):
    """The .cpp and .cu twins share a stem: setuptools would write both to <stem>.o and link the
    CUDA one twice ("multiple definition"). The CUDA objects get <stem>.cuda.o, as torch's JIT build
    names them."""
    class Build(base):
        def build_extensions(self):
            names = self.compiler.object_filenames

            def object_filenames(sources, *args, **kwargs):
                objects = names(sources, *args, **kwargs)
                return [o[:-len(".o")] + ".cuda.o" if s.endswith(".cu") else o for s, o in zip(sources, objects)]
            self.compiler.object_filenames = object_filenames
            super().build_extensions()
    return Build


setup(**extensions())
