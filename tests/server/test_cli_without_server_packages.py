"""The commands that serve nothing build and run without the HTTP packages (fastapi, uvicorn,
aiohttp): a machine without them (the GPU machine runs from source) can still evaluate and bench."""
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.server]

BLOCKED = ("fastapi", "uvicorn", "aiohttp", "starlette")
SCRIPT = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {BLOCKED!r}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
from oasiskv.entrypoints import cli
for argv in (["eval", "passkey", "--help"], ["bench", "throughput", "--help"], ["proxy", "--help"]):
    try:
        cli.main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
assert not any(m.split('.')[0] in {BLOCKED!r} for m in sys.modules)
print("ok")
"""


def test_parser_builds_without_the_http_packages():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
