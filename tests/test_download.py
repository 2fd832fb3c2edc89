"""The project's downloader (utils/download.py): a request ends by its deadline whatever the server sends, its
answer included; and byte_at_a_time, the slow local server the shard and weights tests use too."""

import contextlib
import socket
import threading
import time

import pytest

from utils.download import fetch

SLOW_ANSWER = b"HTTP/1.1 200 " + b"O" * 100  # a status line sent a byte at a time: 5 s at 0.05 s a byte


@contextlib.contextmanager
def byte_at_a_time(tail, head=b"", gap=0.05):
    """A loopback server that answers each request with head at once, then tail a byte every gap seconds (faster
    than the clients' per-read timeouts here, so only a deadline on the whole request ends them), then closes; yields
    its base URL."""
    listener, stop = socket.create_server(("127.0.0.1", 0)), threading.Event()

    def answer(connection):
        with connection, contextlib.suppress(OSError):  # the client gave up
            connection.recv(65536)  # the request (or a proxy's CONNECT)
            connection.sendall(head)
            for byte in tail:
                if stop.wait(gap):
                    return
                connection.sendall(bytes([byte]))

    def serve():
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                threading.Thread(target=answer, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


@pytest.mark.parametrize("through", ["server", "proxy"])
def test_an_answer_sent_a_byte_at_a_time_ends_at_the_deadline(through, monkeypatch):
    with byte_at_a_time(SLOW_ANSWER) as url:
        if through == "proxy":  # an https request, tunnelled through a proxy whose CONNECT answer comes slowly
            monkeypatch.setenv("https_proxy", url)
            monkeypatch.setenv("no_proxy", "")
            url = "https://weights.invalid"
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"^no answer for 0.3 s$"):
            fetch(f"{url}/w.pth", [].append, 100, timeout=0.3, min_rate=1e6)
        assert time.monotonic() - start < 3  # the answer would take 5 s
