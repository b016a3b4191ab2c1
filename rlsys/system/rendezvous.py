"""Rendezvous stores on a port that no other process can take between choosing it and serving it.

Choosing a free port by binding port 0, closing the socket and letting torch's TCPStore bind the
port again leaves a window in which any process on the node can take it: every outgoing TCP
connection draws its local port from the same ephemeral range that port 0 does. torch then fails
with "EADDRINUSE: address already in use" (a CI run lost a test that way). Here the process that
serves the store binds the port once and hands the bound socket itself to the store
(`TCPStore(master_listen_fd=...)`, supported by its libuv server), so the port is never free
between being chosen and being served. The other ranks join as clients, as torch's `tcp://`
rendezvous has them do, so SGLang's side of a weight-update group (a `tcp://` client) still fits.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta


class ReservedPort:
    """A TCP port bound (not yet listening) by this process, held until a store serves it."""

    def __init__(self, host: str = "") -> None:
        self._socket: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind((host, 0))
        self.port: int = self._socket.getsockname()[1]

    def serve_store(self, address: str, world_size: int, timeout: timedelta):
        """The store's server on this port; returns once `world_size - 1` others joined (or raises
        past `timeout`). `address`: where this process reaches its own server."""
        from torch.distributed import TCPStore

        if self._socket is None:
            raise RuntimeError(f"port {self.port} was already handed to a store")
        # The store takes ownership of the descriptor it is given (it closes it): give it a copy,
        # and close ours either way, so the port is released on failure too.
        listen_fd = os.dup(self._socket.fileno())
        try:
            return TCPStore(address, self.port, world_size, is_master=True, timeout=timeout,
                            master_listen_fd=listen_fd, use_libuv=True)
        finally:
            self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def rank_store(rank: int, address: str, port: int, world_size: int, timeout: timedelta,
               reserved: ReservedPort | None = None):
    """Rank `rank`'s store of a group that meets at address:port. Rank 0 serves it: on `reserved`
    when it reserved that port (no window), else by binding the port it was given (the caller chose
    it, as `tcp://` rendezvous does). Every other rank joins as a client."""
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    if reserved is not None and reserved.port == port:
        return reserved.serve_store(address, world_size, timeout)
    return TCPStore(address, port, world_size, is_master=True, timeout=timeout)
