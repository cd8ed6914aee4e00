"""GPU tests: skipped without a CUDA device; run on the lent GPU (scripts/gpu/run.sh)."""
import pytest
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def cuda_kernels(request):
    """Load the extension before any test touches torch.ops.wcodec (its ops register on import),
    whatever order the tests run in; without its CUDA kernels there is nothing here to test.
    Tests marked `triton` (the decode step's Triton kernels) need no extension."""
    import os
    if request.node.get_closest_marker("triton") or os.environ.get("WCODEC_ENCODER_ONLY") == "1":      # scripts/gpu/run.sh (stages encode-build, tests, sanitize-encode, encode-bench, encode-7b): the encoder's ops alone
        return
    import cuda_ext
    avail = cuda_ext.available()
    if not avail.cuda:
        pytest.skip(f"CUDA decoder unavailable: {avail.reason}")
