"""The decode side's lease traffic (oasiskv/disagg/heartbeats.py) against a stand-in for a
prefill server's two routes: one batched heartbeat per peer, releases, lost and unreachable."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from oasiskv.disagg.heartbeats import LeaseHeartbeats, Lost


class Prefill(BaseHTTPRequestHandler):
    beats: list = []
    releases: list = []
    gone: set = set()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/disagg/heartbeat":
            self.beats.append((body["peer"], sorted(body["request_ids"])))
            answer = {"lost": [r for r in body["request_ids"] if r in self.gone]}
        else:
            self.releases.append(sorted(body["request_ids"]))
            answer = {"released": len(body["request_ids"])}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def wait_for(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_batched_heartbeats_releases_and_an_unreachable_prefill():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Prefill)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    hb = LeaseHeartbeats("decode-x", timeout_s=1.0)
    try:
        Prefill.gone.add("b")
        hb.hold(url, "a", 0.3)
        hb.hold(url, "b", 0.3)
        wait_for(lambda: Prefill.beats)
        assert Prefill.beats[0] == ("decode-x", ["a", "b"])  # one heartbeat for both
        lost = []
        wait_for(lambda: lost.extend(hb.lost()) or lost)
        assert lost == [Lost(url, "b", False)] and hb.held() == 1
        hb.release(url, "a")
        wait_for(lambda: Prefill.releases == [["a"]])
        assert hb.held() == 0
        server.shutdown()
        server.server_close()
        hb.hold(url, "c", 0.3)
        held, lost = time.monotonic(), []
        wait_for(lambda: lost.extend(hb.lost()) or lost)
        assert time.monotonic() - held < 0.3 + 1.0  # a third of the TTL, and the refused connection
        assert lost == [Lost(url, "c", True)] and hb.held() == 0
    finally:
        hb.close()
