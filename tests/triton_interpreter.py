"""Runs a test module as a script under TRITON_INTERPRET=1, in its own process.

The interpreter must be switched on before triton is imported, and only for the kernel
checks, so they run in a subprocess; the script prints one JSON object as its last line.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def run_under_interpreter(script: str, *args: str) -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(TESTS), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
