"""Small HTTP helpers the server tests share: a free port, JSON calls, SSE reading, /metrics, a
disaggregation proxy."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_started(base: str, proc, log, timeout: float = 300) -> None:
    """Returns once the server answers /health; else raises with the tail of its log (a file
    opened "w+")."""
    from oasiskv.entrypoints.openai.server_process import wait_for_health

    try:
        wait_for_health(base, timeout, proc)
    except Exception:
        log.seek(0)
        raise RuntimeError("server did not start:\n" + log.read()[-3000:]) from None


def call(base: str, path: str, body: dict | bytes | None = None, timeout: float = 60,
         headers: dict | None = None) -> tuple[int, dict | str]:
    """(status, parsed JSON or text) of a GET (no body) or POST."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def stream_events(base: str, path: str, body: dict, timeout: float = 60,
                  headers: dict | None = None) -> list[dict | str]:
    """Every `data:` payload of a streamed response: parsed chunks, and the final "[DONE]"."""
    req = urllib.request.Request(base + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metrics(base: str) -> dict[str, float]:
    """/metrics as {sample name (with labels but model_name): value}."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r',?model_name="[^"]*",?', ",", name).replace("{,", "{").replace(",}", "}").replace("{}", "")
            values[name] = float(value)
    return values


def wait_idle(base: str, timeout: float = 120) -> None:
    """Until the server runs and queues no request (an earlier test's may still be finishing)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        if m.get("oasiskv:num_requests_running", 0) == 0 and m.get("oasiskv:num_requests_waiting", 0) == 0:
            return
        assert time.monotonic() < deadline, "the server stayed busy"
        time.sleep(0.2)


def start_proxy(prefill: str, decode: str, port: int, *flags: str) -> subprocess.Popen:
    """`oasiskv proxy` over one prefill and one decode server (URLs), in a session of its own."""
    return subprocess.Popen([sys.executable, "-m", "oasiskv.entrypoints.cli", "proxy", "--prefill", prefill,
                             "--decode", decode, "--port", str(port), "--log-level", "warning", *flags],
                            start_new_session=True)
