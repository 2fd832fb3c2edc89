"""Fetching a URL's bytes with bounds: the server's answer (connecting, the status line and headers) within a
deadline, the body at a minimum average rate after it and up to a most number of bytes, each chunk handed on as it
arrives (callers report it as progress); the environment's proxies apply, as with urlopen.

urlopen(timeout=) and urllib3's Timeout(total=...) bound each socket read, not the request: against a local server
sending its status line a byte a second, urllib3 with total=2 answered after 39 s; fsspec's HTTP filesystem needs
aiohttp, a new dependency. So requests go through urllib.request as before (proxies, redirect handlers, HTTPError),
and a thread shuts the request's sockets down at its deadline: a blocked read then returns, and the fetch fails with
a TimeoutError that says the bound. Resolving the host name is outside it (the C library's lookup cannot be cut).
"""

import contextlib
import functools
import http.client
import socket
import threading
import time
import urllib.request

from utils.memory import size_text

CHUNK = 1 << 20  # the most bytes read at once; a read returns what has arrived


class Refused(Exception):
    """A transfer ruled out before its body is read (a length over the bound, a redirect to another host): trying
    again would not help."""


class TooLong(OSError):
    """The server sent more than the file may hold (a stream without end)."""


class ShortTransfer(OSError):
    """The server closed the connection before the body's announced length."""


class Deadline:
    """When a request must end (the end may move as the body arrives): a thread shuts the request's sockets down
    there, which ends a read blocked on them."""

    def __init__(self, seconds):
        self.start, self.seconds = time.monotonic(), seconds
        self.end, self.expired, self.done, self.sockets = self.start + seconds, False, False, []
        self.changed = threading.Condition()
        threading.Thread(target=self.watch, daemon=True).start()

    def watch(self):
        """Wait for the end, then shut the sockets down, unless the request is done first."""
        with self.changed:
            while not self.done:
                left = self.end - time.monotonic()
                if left <= 0:
                    self.expired = True
                    for sock in self.sockets:
                        shut(sock)
                    return
                self.changed.wait(left)

    def move(self, end):
        """The request now ends at end (time.monotonic's)."""
        with self.changed:
            self.end = end
            self.changed.notify()

    def holds(self, sock):
        """sock, shut down at the end (at once when it has passed). A duplicate of it is kept: shutting a socket
        down acts on the connection from any of its descriptors, and that one stays ours however http.client and ssl
        wrap, detach or close sock."""
        with self.changed:
            self.sockets.append(sock.dup())
            if self.expired:
                shut(self.sockets[-1])
        return sock

    def close(self):
        """The request is done: the thread ends, the duplicates are closed."""
        with self.changed:
            self.done = True
            self.changed.notify()
            for sock in self.sockets:
                sock.close()


def shut(sock):
    """Shut a TCP socket down: a read blocked on the connection returns, under TLS too."""
    with contextlib.suppress(OSError):  # not connected, or already closed by the peer
        sock.shutdown(socket.SHUT_RDWR)


def held_connection(http_class, deadline, host, **options):
    """An http.client connection whose sockets the deadline holds (http.client opens them with _create_connection,
    before any proxy tunnel and TLS handshake, which the deadline bounds too)."""
    connection = http_class(host, **options)
    connection._create_connection = lambda *args, **kw: deadline.holds(socket.create_connection(*args, **kw))
    return connection


def held(handler, deadline):
    """urllib's HTTPHandler or HTTPSHandler, its connections' sockets held by the deadline."""
    do_open = handler.do_open
    handler.do_open = lambda http_class, request, **kw: do_open(
        functools.partial(held_connection, http_class, deadline), request, **kw)
    return handler


def opener(deadline, redirects=None):
    """urllib's opener (the environment's proxies; redirects: a redirect handler, urllib's own by default) whose
    sockets the deadline holds."""
    handlers = [held(urllib.request.HTTPHandler(), deadline), held(urllib.request.HTTPSHandler(), deadline)]
    return urllib.request.build_opener(*handlers, *([redirects] if redirects else []))


def announced_length(response):
    """The body's Content-Length, or None where the server announces none (or no number)."""
    length = response.headers.get("Content-Length")
    return int(length) if length and length.isdigit() else None


def fetch(url, write, limit, timeout, min_rate, what="the file", expected=None, headers=None, redirects=None,
          answered=lambda announced: None):
    """Call write(chunk) with url's body as it arrives and return its length. The server's answer must come within
    timeout s of the start, then the body at min_rate bytes/s on average (the request ends timeout + expected or
    received bytes / min_rate s after its start), and no read waits more than timeout s. answered(its announced
    length or None) is called at the answer. The body holds limit bytes at most: a longer announced length is Refused
    unread, a longer body fails (TooLong), and one shorter than announced too (ShortTransfer). Failures: OSError
    (urllib's URLError and HTTPError, TimeoutError saying the bound), http.client.HTTPException, Refused."""
    request = urllib.request.Request(url, headers=headers or {})
    received = announced = None  # None: no answer yet
    with contextlib.closing(Deadline(timeout)) as deadline:
        try:
            with opener(deadline, redirects).open(request, timeout=timeout) as response:
                announced = announced_length(response)
                answered(announced)
                if announced is not None and announced > limit:
                    raise Refused(f"the server announces {announced} bytes: {what} is read up to {size_text(limit)}")
                expected, received = expected or announced or 0, 0  # 0: unknown
                deadline.move(deadline.start + timeout + expected / min_rate)
                while chunk := response.read1(min(CHUNK, limit + 1 - received)):
                    received += len(chunk)
                    if received > limit:
                        raise TooLong(f"the server sent more than {size_text(limit)}: {what} is read up to that")
                    write(chunk)
                    deadline.move(deadline.start + timeout + max(expected, received) / min_rate)
        except (OSError, http.client.HTTPException) as e:
            if not (deadline.expired or timed_out(e)):
                raise
            raise TimeoutError(missed(deadline, received, expected, min_rate)) from None
        if deadline.expired and (announced is None or received < announced):  # the shut socket read as an end
            raise TimeoutError(missed(deadline, received, expected, min_rate))
    if announced is not None and received != announced:
        raise ShortTransfer(f"the connection closed after {received} of {announced} bytes")
    return received


def timed_out(error):
    """Whether a socket read or connect waited its timeout (urllib wraps those of connecting in a URLError)."""
    return isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError)


def missed(deadline, received, expected, min_rate):
    """The bound a request missed: its answer's time, its body's rate (the deadline passed) or a read's timeout."""
    if received is None:
        return f"no answer for {deadline.seconds:g} s"
    if deadline.expired:
        return (f"{received} of {expected or 'unknown'} bytes in {time.monotonic() - deadline.start:.3g} s: slower "
                f"than {min_rate / 1e3:,.0f} kB/s on average")
    return f"no byte for {deadline.seconds:g} s after {received} of {expected or 'unknown'} bytes"
