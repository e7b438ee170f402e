"""A TCP proxy a test can cut: a broker or database node that dies and comes back.

The shared servers of a test run must never be stopped. A test that needs one to
die puts a :class:`Proxy` in front of it and points its client at the proxy::

    with Proxy("127.0.0.1", 5672) as node:
        url = f"amqp://guest:guest@127.0.0.1:{node.port}//"
        ...                # the client talks to RabbitMQ through the proxy
        node.cut()         # every connection through it closes; new ones are refused
        ...
        node.restore()     # it accepts connections again, on the same port

The proxy listens on a free port of 127.0.0.1 (port 0), forwards bytes both ways
unchanged and knows nothing of the protocol, so it stands for any TCP server.
Threads do the work; each connection has two (one per direction). While cut, the
port is closed: a client's connect is refused at once, as for a node that is down.
:func:`closed_port` gives a port where nothing listens, for a node that never was.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

#: Bytes moved per read.
CHUNK = 64 * 1024


def closed_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 that does not listen.

    Connecting to its port is refused, and while the socket stays open no other
    process can take the port: keep it for as long as the port must stay closed,
    and close it afterwards. Its port is ``sock.getsockname()[1]``.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


class Proxy:
    """Forwards TCP connections from a port of 127.0.0.1 to ``host:port`` until cut."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.host = "127.0.0.1"
        #: The port clients connect to; the same after :meth:`restore`.
        self.port = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        #: Connections accepted so far (a test can wait for its client to connect).
        self.accepted = 0

    def __enter__(self) -> Proxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def address(self) -> str:
        """``host:port`` for a URL."""
        return f"{self.host}:{self.port}"

    @property
    def is_cut(self) -> bool:
        """Whether the proxy refuses connections now."""
        return self._listener is None

    def start(self) -> None:
        """Listen on a free port (the first time) or on the same port again."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind((self.host, self.port))
            except OSError:
                listener.close()
                raise
            listener.listen(64)
            self.port = listener.getsockname()[1]
            self._listener = listener
        self._spawn(self._accept, listener)

    def cut(self) -> None:
        """Close every connection through the proxy and refuse new ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            open_sockets, self._sockets = self._sockets, set()
        if listener is not None:
            _shut(listener)
        for sock in open_sockets:
            _shut(sock)

    def restore(self) -> None:
        """Accept connections again, on the same port."""
        self.start()

    def close(self) -> None:
        """Cut, and wait for the proxy's threads to end."""
        self.cut()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()

    # -- internals -------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # the listener was closed: cut
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()  # the server behind is down: so is this node
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
                self.accepted += 1
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(CHUNK)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        # One side ended: end both, as a dying node would.
        with self._lock:
            self._sockets.discard(source)
            self._sockets.discard(sink)
        _shut(source)
        _shut(sink)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
