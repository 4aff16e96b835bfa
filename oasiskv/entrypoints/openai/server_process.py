"""`oasiskv serve` as a child process: start it, wait until /health answers, stop it with SIGTERM.
Used by `bench serve --server-args` and by the tests."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request


def wait_for_health(base_url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/health did not answer within {timeout:.0f} s")


def start_server(serve_args: list[str], host: str, port: int, timeout: float = 600.0, wait: bool = True,
                 **popen_kwargs) -> subprocess.Popen:
    """`python -m oasiskv.entrypoints.cli serve ...` in its own session; returns once it is healthy
    (or at once with wait=False: then call wait_for_health yourself)."""
    cmd = [sys.executable, "-m", "oasiskv.entrypoints.cli", "serve", *serve_args,
           "--host", host, "--port", str(port)]
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    if not wait:
        return proc
    try:
        wait_for_health(f"http://{host}:{port}", timeout, proc)
    except BaseException:
        stop_server(proc)
        raise
    return proc


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM (graceful: in-flight requests finish), then SIGKILL if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
