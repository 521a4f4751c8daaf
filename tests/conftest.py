"""Fixtures shared by the test modules: pytest provides them to every module below this folder by name."""

import os

import pytest
import torch

# Triton kernels (modeling/far_field_triton.py) run in Triton's interpreter on a machine without CUDA: it reads this
# when the kernels are defined, at import
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Under pytest-xdist (scripts/test.sh runs the suite on every core), each worker runs torch on its share of the cores,
# and so do the processes its tests start: more threads than cores makes tiny tensors' work ~100x slower
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if WORKERS:
    threads = max(1, (os.cpu_count() or 1) // WORKERS)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
# the studies' longest smoke runs (tests/test_studies.py; about 25 to 60 s each on one thread), in that order
LONGEST_STUDIES = (
    "llm_linearization",
    "long_documents",
    "long_context_retrieval",
    "routing_granularity",
    "compat_sentiment",
    "approximation_quality",
    "model_speed",
)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where there is no CUDA device (``benchmarks/gpu_check.sh`` runs them on one).
    Under pytest-xdist the studies' smoke runs (a minute or more each) come first, the longest first, so that the
    workers share them and no long run is left for the end while the other workers idle."""
    if WORKERS:
        rank = {study: index for index, study in enumerate(LONGEST_STUDIES)}

        def order(item):
            callspec = getattr(item, "callspec", None)  # parametrized tests only
            study = callspec.params.get("study") if callspec and item.get_closest_marker("studies") else None
            return (0, rank.get(study, len(rank))) if study else (1, 0)

        items.sort(key=order)  # stable: the other tests keep their order
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
