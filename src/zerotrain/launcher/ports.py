"""Checks on the master address and port before the rendezvous store binds them."""

from __future__ import annotations

import errno
import socket

from zerotrain.launcher.errors import LaunchError


def _bind(addr: str, port: int) -> int:
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise LaunchError("--master_addr", f"cannot resolve {addr!r} ({err.strerror})") from err
    with socket.socket(family, kind, proto) as sock:
        # Same option as the TCPStore server, so a port left in TIME_WAIT by a
        # previous run still counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        return sock.getsockname()[1]


def is_port_free(addr: str, port: int) -> bool:
    """True if a server socket could bind ``addr:port`` right now.

    Raises LaunchError if ``addr`` is not an address of this machine, since a
    single-node launch hosts the rendezvous store itself.
    """
    try:
        _bind(addr, port)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            return False
        if err.errno == errno.EACCES:
            raise LaunchError("--master_port", f"no permission to bind port {port}; use a port above 1023") from err
        raise LaunchError(
            "--master_addr",
            f"cannot listen on {addr}:{port} ({err.strerror}); single-node launch needs an "
            "address of this machine, e.g. --master_addr 127.0.0.1",
        ) from err
    return True


def free_port(addr: str) -> int:
    """A port on ``addr`` that was free a moment ago (chosen by the OS)."""
    return _bind(addr, 0)
