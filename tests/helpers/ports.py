"""A free TCP port on the loopback interface, for tests that start their own process groups."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
