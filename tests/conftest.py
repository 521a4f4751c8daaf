"""Fixtures shared by the test modules: pytest provides them to every module below this folder by name."""

import os

import pytest
import torch

from .study_runs import QuickRuns, selected_studies

# Triton kernels (modeling/far_field_triton.py) run in Triton's interpreter on a machine without CUDA: it reads this
# when the kernels are defined, at import
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where there is no CUDA device (``benchmarks/gpu_check.sh`` runs them on one)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (benchmarks/gpu_check.sh runs these tests)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


# helper modules that assert: pytest rewrites their asserts as it does the tests', for the same failure reports
pytest.register_assert_rewrite("tests.remote_code")


@pytest.fixture
def single_thread():
    """One torch thread for the test. Tiny tensors: thread start-up and contention with other jobs on the shared CPU
    cost far more than they save (a tiny forward takes ~100x longer with 2 busy threads than with 1).

    Modules of tiny-model tests apply it to every test with ``pytestmark = pytest.mark.usefixtures("single_thread")``;
    a test or fixture that needs it alone requests it by name."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def study_runs(request, tmp_path_factory):
    """The session's smoke runs of benchmarks/ (tests/test_studies.py), started before its first test so that they
    run beside the others on the core those leave idle (tests/study_runs.py); none when no study test is selected."""
    runs = QuickRuns(selected_studies(request.session.items), tmp_path_factory.mktemp)
    yield runs
    runs.close()
