"""uvicorn's h11 protocol with a header timeout: a connection whose request line and headers do
not arrive within the limit (after it opens, or after the previous response) is closed. uvicorn
bounds the header size (h11_max_incomplete_event_size) and the idle time of a kept-alive
connection, but not how slowly headers may trickle in; without this, slow clients could hold
every connection the server has."""
from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(seconds: float) -> type:
    class H11WithHeaderTimeout(H11Protocol):
        _timer = None
        _answered = None  # the request cycle answered last; a new cycle means new headers came

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _headers_too_slow(self) -> None:
            self._timer = None
            if self.cycle is self._answered and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._answered:
                self._disarm()

        def on_response_complete(self) -> None:
            self._answered = self.cycle
            self._arm()  # before the parent: it may start a pipelined request, which disarms
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return H11WithHeaderTimeout
