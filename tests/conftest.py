"""Test-wide settings: Triton kernels run under the interpreter on CPU, invariant checks are on, caches in a
temporary directory.

The suite's own switches (read here only: the runtime reads no SPECDEC_* variable that duplicates an option):
every `LLM` a test builds without saying otherwise checks invariants after each step
(`SPECDEC_TEST_CHECK_INVARIANTS=0` turns that off), and `SPECDEC_TEST_COMPILE=1` builds them all with
`compile=True` (a whole suite compiled: docs/api.md, `compile`)."""
import os
import shutil
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
# One folder for everything the session writes outside tmp_path, removed when the session ends (pytest_unconfigure,
# also after --collect-only): auto k's cost cache (the cache home: out of the user's home directory), Ray's session
# folders (ray.init writes $RAY_TMPDIR/ray/session_*, else /tmp/ray) and torch.compile's caches. The subprocesses
# the tests start inherit the variables, so they write there too. (pytest's own tmp_path folders live under
# pytest-of-<user> in the temp directory, which pytest reuses and prunes itself.)
SESSION_DIR = tempfile.mkdtemp(prefix="specdec-tests-")
os.environ["XDG_CACHE_HOME"] = os.path.join(SESSION_DIR, "cache")
os.environ["RAY_TMPDIR"] = SESSION_DIR  # short: Ray's socket paths under it must stay under 107 bytes
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(SESSION_DIR, "torchinductor")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# hypothesis profiles for tests that take their example count from the profile (tests/test_properties.py):
# "ci" (default) is small and deterministic; `pytest --hypothesis-profile long` for a long random run
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=400, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")



def _suite_defaults() -> dict:
    on = lambda name, default: os.environ.get(name, default) not in ("", "0")  # noqa: E731
    return {"check_invariants": on("SPECDEC_TEST_CHECK_INVARIANTS", "1"), "compile": on("SPECDEC_TEST_COMPILE", "0")}


def _with_suite_defaults(llm_class) -> None:
    """`LLM(...)` with the suite's defaults for the options a test does not give (nor an `options` object)."""
    import functools

    init, defaults = llm_class.__init__, _suite_defaults()

    @functools.wraps(init)
    def suite_init(self, target=None, draft=None, options=None, **kwargs):
        if options is None:
            kwargs = {**defaults, **kwargs}
        init(self, target, draft, options, **kwargs)

    llm_class.__init__ = suite_init


import specdec.llm  # noqa: E402

_with_suite_defaults(specdec.llm.LLM)

# tiny models gain nothing from threads, and oversubscribed OpenMP threads crawl on a shared 2-core box
torch.set_num_threads(1)


import pytest  # noqa: E402


def pytest_unconfigure(config):
    """The session's folder goes with the session (whatever ran: a test that started Ray shuts it down first)."""
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


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
