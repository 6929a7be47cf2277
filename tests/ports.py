"""A TCP port free on this machine now, for the tests that start servers or rendezvous."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
