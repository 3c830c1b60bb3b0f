"""The command-line programs default OpenMP to passive waits before torch loads it (specdec/openmp.py)."""
import os
import subprocess
import sys

import pytest

PROBE = ("import sys, os, importlib; importlib.import_module(sys.argv[1]); "
         "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")


def probe(module: str, env_value: str | None):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE, module], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("module", ["specdec.run", "specdec.serve.__main__", "specdec.train.__main__"])
def test_a_program_defaults_to_passive_waits_and_keeps_the_environments(module):
    assert probe(module, None)[0] == "PASSIVE"
    assert probe(module, "ACTIVE")[0] == "ACTIVE"


def test_the_setting_module_loads_no_torch():
    assert probe("specdec.openmp", None) == ["None", "False"]  # importing it alone changes nothing, loads no torch
