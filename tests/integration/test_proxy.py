"""The tests' TCP proxy (``tests/proxy.py``) forwards, cuts and comes back.

An echo server of the test's own stands for the server behind it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.proxy import Proxy, closed_port


@pytest.fixture
def echo() -> Iterator[int]:
    """A TCP echo server on a free port of 127.0.0.1; yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    def answer(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()


def talk(port: int, text: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(text)
        return conn.recv(1024)


def test_the_proxy_forwards_then_cut_refuses_and_restore_comes_back(
    echo: int,
) -> None:
    with Proxy("127.0.0.1", echo) as proxy:
        assert talk(proxy.port, b"one") == b"one"
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        held.sendall(b"two")
        assert held.recv(1024) == b"two"

        proxy.cut()
        assert proxy.is_cut
        # The open connection ends (EOF or a reset), a new one is refused.
        with contextlib.suppress(ConnectionResetError):
            assert held.recv(1024) == b""
        held.close()
        with pytest.raises(ConnectionRefusedError):
            talk(proxy.port, b"three")

        port = proxy.port
        proxy.restore()
        assert proxy.port == port
        assert talk(proxy.port, b"four") == b"four"
        assert proxy.accepted == 3


def test_a_closed_port_refuses_connections() -> None:
    with closed_port() as sock, pytest.raises(ConnectionRefusedError):
        talk(sock.getsockname()[1], b"hello")
