"""Test-wide settings: Triton kernels run under the interpreter on CPU, invariant checks are on, caches in a
temporary directory."""
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
# auto k's cost cache (and anything else under the cache home) stays out of the user's home directory
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="specdec-tests-cache-")
os.environ.setdefault("SPECDEC_CHECK_INVARIANTS", "1")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# hypothesis profiles for tests that take their example count from the profile (tests/test_properties.py):
# "ci" (default) is small and deterministic; `pytest --hypothesis-profile long` for a long random run
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=400, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")

# tiny models gain nothing from threads, and oversubscribed OpenMP threads crawl on a shared 2-core box
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_pairs(tmp_path_factory):
    """`checkpoint_pairs(family)`: a tiny random target/draft pair of that family (tests/checkpoints.py
    `make_pair`, default arguments), built once per session and shared by every module that only reads it."""
    from checkpoints import make_pair

    built = {}

    def get(family: str = "llama"):
        if family not in built:
            built[family] = make_pair(family, tmp_path_factory.mktemp(f"pair-{family}"))
        return built[family]

    return get


@pytest.fixture(scope="session")
def llama_pair(checkpoint_pairs):
    """The llama pair most tests decode with (read-only: copy it before changing a file)."""
    return checkpoint_pairs("llama")
