"""A real HTTP server for the shard tests: Python's http.server serving a folder, in a process of its own.

    python tests/http_server.py ROOT [STOP_AFTER]

Prints `port N` once listening; with STOP_AFTER, the process exits at once (as a killed server does: connections
refused from then on) when a request after the first STOP_AFTER GETs arrives, before answering it.
"""

import functools
import os
import sys
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

served = {"gets": 0}


class Handler(SimpleHTTPRequestHandler):
    stop_after = None

    def do_GET(self):
        served["gets"] += 1
        if self.stop_after is not None and served["gets"] > self.stop_after:
            os._exit(0)
        super().do_GET()

    def log_message(self, *args):
        pass


def main(root, stop_after=None):
    Handler.stop_after = None if stop_after is None else int(stop_after)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=root))
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(*sys.argv[1:])
