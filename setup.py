"""Builds cuda_ext._C ahead of time when torch is importable at install time (pip install
--no-build-isolation): the CUDA kernels + C++ twin where a CUDA torch and nvcc exist, else the
C++ twin alone. WCODEC_BUILD_EXT=0 skips it; cuda_ext then JIT-builds or falls back to NumPy."""
import os
import shutil

from setuptools import setup

CSRC = os.path.join("cuda_ext", "csrc")
CXX = ["-O3", "-fopenmp", "-ffp-contract=off", "-DWCODEC_PYTHON_MODULE"]   # no FMA: gguf_blocks.h
NVCC = ["-O3", "--use_fast_math", "-lineinfo"]
DEFAULT_ARCH_LIST = "8.0;8.6;8.9;9.0;12.0"          # sources and arch list: as cuda_ext/build.py


def extensions():
    if os.environ.get("WCODEC_BUILD_EXT", "1") == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        return {}
    cpu = [os.path.join(CSRC, name) for name in ("decode_float.cpp", "decode_quant.cpp", "crc32.cpp",
                                                 "fixedrate.cpp", "encode_float.cpp")]
    common = dict(include_dirs=[os.path.abspath(CSRC)], extra_link_args=["-fopenmp"])
    if torch.version.cuda and shutil.which("nvcc"):
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        cuda = [os.path.join(CSRC, name) for name in ("decode_float.cu", "decode_quant.cu", "crc32.cu", "fixedrate.cu",
                                                      "fixedrate_gemv.cu", "fixedrate_mma.cu", "encode_float.cu")]
        ext = CUDAExtension("cuda_ext._C", cpu + cuda,
                            extra_compile_args={"cxx": CXX, "nvcc": NVCC}, **common)
    else:
        ext = CppExtension("cuda_ext._C", cpu, extra_compile_args={"cxx": CXX}, **common)
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=False)}}


setup(**extensions())
