"""Issue 58: the suite left a `specdec-tests-cache-*` folder in the system temp directory on every run (even
`--collect-only`) and Ray's session folders. A pytest session with the suite's conftest (tests/conftest.py), run
in a subprocess whose temp directory is an empty folder, leaves nothing there but pytest's own
`pytest-of-<user>` (its tmp_path folders, reused and pruned by pytest): not after --collect-only, not after a
test that wrote the cost cache and torch.compile's cache, not after one that started and stopped Ray.
(.ci/run checks the same of the whole suite: no new entry in the temp directory after it.)"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PROBE = '''
import os


def test_writes_where_the_suite_writes():
    from specdec.startup import default_cache_path, write_entry

    write_entry(default_cache_path(), "probe", 1)  # auto k's cost cache, as a run writes it
    assert os.path.isfile(default_cache_path())
    os.makedirs(os.environ["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)
    if os.environ.get("PROBE_RAY"):
        import logging

        import ray

        ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=78 << 20,
                 logging_level=logging.ERROR)
        try:
            assert ray.get(ray.put(7)) == 7
        finally:
            ray.shutdown()
'''


def run_probe(tmp_path, *pytest_args, system_tmp=None, ray: bool = False) -> tuple[subprocess.CompletedProcess,
                                                                                      list[str]]:
    """The probe test run by pytest with the suite's conftest (`-p conftest`) and TMPDIR an empty folder
    (`system_tmp`, default one under tmp_path); returns the run and what it left in that folder."""
    probe = tmp_path / "probe"
    if system_tmp is None:
        system_tmp = tmp_path / "tmp"
        system_tmp.mkdir()
    probe.mkdir()
    (probe / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "RAY_TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(TMPDIR=str(system_tmp), PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]), OMP_NUM_THREADS="1")
    if ray:
        env["PROBE_RAY"] = "1"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                             *pytest_args, str(probe)], capture_output=True, text=True, timeout=300, env=env,
                            cwd=probe)
    left = sorted(name for name in os.listdir(system_tmp) if not name.startswith("pytest-of-"))
    return result, left


@pytest.mark.parametrize("args", [["--collect-only"], []], ids=["collect-only", "a-test"])
def test_the_suite_leaves_nothing_in_the_temp_directory(tmp_path, args):
    result, left = run_probe(tmp_path, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert left == [], f"left in the temp directory: {left}"


@pytest.mark.slow
@pytest.mark.ray
def test_ray_session_folders_go_with_the_suite(tmp_path):
    pytest.importorskip("ray")
    system_tmp = tempfile.mkdtemp(prefix="sd-")  # short: Ray's socket paths under it must stay under 107 bytes
    try:
        result, left = run_probe(tmp_path, system_tmp=system_tmp, ray=True)
    finally:
        shutil.rmtree(system_tmp, ignore_errors=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert left == [], f"left in the temp directory: {left}"
