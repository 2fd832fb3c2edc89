"""A real HTTP server for the shard tests: Python's http.server serving a folder, in a process of its own.

    python tests/http_server.py ROOT [--stop-after N] [--cut-first N] [--trickle [--no-length]] [--log FILE]
                                     [--endless SUFFIX] [--announce N] [--redirect-to HOST]

Prints `port N` once listening. --stop-after N: the process exits at once (as a killed server does: connections
refused from then on) when a request after the first N GETs arrives, before answering it. --cut-first N: the first N
GETs of .tar files announce the whole file's length but close the connection after half of it. --trickle: every
.tar file is sent a byte every 50 ms (with --no-length, without a Content-Length: until the connection closes).
--log FILE: a line `PATH BYTES` for each GET answered, BYTES being what was sent (headers and body).
--endless SUFFIX: files whose path ends with SUFFIX are sent without a Content-Length, followed by spaces without end
(64 MiB of them, so that a client without a bound still ends). --announce N: every .tar file announces a
Content-Length of N bytes, then sends nothing. --redirect-to HOST: a .tar file asked for under another host name is
redirected (302) to the same port and path on HOST.
"""

import argparse
import contextlib
import functools
import os
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

served = {"gets": 0, "cut": 0}
log_lock = threading.Lock()


class CountedWrites:
    """A file object that counts the bytes written through it."""

    def __init__(self, out):
        self.out, self.count = out, 0

    def write(self, data):
        self.count += len(data)
        return self.out.write(data)

    def __getattr__(self, name):
        return getattr(self.out, name)


class Handler(SimpleHTTPRequestHandler):
    args = None

    def do_GET(self):
        served["gets"] += 1
        if self.args.stop_after is not None and served["gets"] > self.args.stop_after:
            os._exit(0)
        self.wfile = CountedWrites(self.wfile)
        try:
            if self.args.endless and self.path.endswith(self.args.endless):
                return self.send_endless()
            if self.path.endswith(".tar") and self.args.announce is not None:
                return self.send_announced()
            if self.path.endswith(".tar") and self.args.redirect_to and \
                    self.headers["Host"].split(":")[0] != self.args.redirect_to:
                return self.send_redirect()
            if self.path.endswith(".tar") and (self.args.trickle or served["cut"] < self.args.cut_first):
                return self.send_faulty(self.args.trickle)
            super().do_GET()
        finally:
            self.log_get()

    def log_get(self):
        """With --log, append the path and the bytes sent."""
        if self.args.log:
            with log_lock, open(self.args.log, "a") as log:
                log.write(f"{self.path} {self.wfile.count}\n")

    def send_faulty(self, trickle):
        with open(self.translate_path(self.path), "rb") as f:
            body = f.read()
        self.send_response(200)
        if not self.args.no_length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.close_connection = True
        if not trickle:
            served["cut"] += 1
            self.wfile.write(body[: len(body) // 2])
            return
        with contextlib.suppress(ConnectionError):  # the client gave up
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                time.sleep(0.05)

    def send_endless(self):
        """The file, then spaces until the client stops reading (or 64 MiB)."""
        with open(self.translate_path(self.path), "rb") as f:
            body = f.read()
        self.send_response(200)
        self.end_headers()
        self.close_connection = True
        with contextlib.suppress(ConnectionError):  # the client gave up
            self.wfile.write(body)
            for _ in range(64):
                self.wfile.write(b" " * 2**20)

    def send_announced(self):
        self.send_response(200)
        self.send_header("Content-Length", str(self.args.announce))
        self.end_headers()
        self.close_connection = True

    def send_redirect(self):
        self.send_response(302)
        self.send_header("Location", f"http://{self.args.redirect_to}:{self.server.server_address[1]}{self.path}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--cut-first", type=int, default=0)
    parser.add_argument("--trickle", action="store_true")
    parser.add_argument("--no-length", action="store_true")
    parser.add_argument("--log")
    parser.add_argument("--endless")
    parser.add_argument("--announce", type=int)
    parser.add_argument("--redirect-to")
    Handler.args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=Handler.args.root))
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
