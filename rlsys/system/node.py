"""This node as the rest of the cluster sees it: the address Ray reports for it, and the network
interface that carries that address (what gloo must bind to).

Why the interface matters: gloo picks its address by resolving the hostname. On many machines
that gives loopback (Debian and Ubuntu map the hostname to 127.0.1.1; containers often to
127.0.0.1), so a gloo group whose members sit on different nodes tells them to connect to
127.0.0.1 and never forms ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). Every process
of a run that joins a gloo group (trainer ranks; SGLang engines in the weight-update group) binds
to the interface that holds its node's Ray address instead, through GLOO_SOCKET_IFNAME: a
ProcessGroupGloo created without explicit devices (torch's `_new_process_group_helper`, which
SGLang's `init_custom_process_group` uses too) reads it in c10d's C++ (libtorch_cpu) and binds to
that interface instead of the hostname's address. A value the user set is kept.
"""

from __future__ import annotations

import os
import socket

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"


def connected_ray():
    """Ray's module when this process is connected to a Ray cluster, else None, also where Ray is
    not installed: the trainer runs without it in the GPU proof kit (bench/gpu_proof.py), on a
    machine that has torch and no Ray."""
    try:
        import ray
    except ImportError:
        return None
    return ray if ray.is_initialized() else None


def node_address() -> str:
    """This node's address as Ray reports it (what other nodes reach it at); loopback outside Ray."""
    ray = connected_ray()
    return ray.util.get_node_ip_address() if ray is not None else "127.0.0.1"


def interface_with_address(address: str) -> str | None:
    """The name of the network interface that holds IPv4 `address`, if any."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.family == socket.AF_INET and entry.address == address for entry in addresses):
            return name
    return None


def gloo_interface_env(address: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """{GLOO_SOCKET_IFNAME: the interface holding `address`}, or {} when `environ` already sets it
    or no interface holds the address (behind NAT: then gloo's own choice stands)."""
    environ = os.environ if environ is None else environ
    if environ.get(GLOO_INTERFACE_ENV):
        return {}
    interface = interface_with_address(address)
    return {GLOO_INTERFACE_ENV: interface} if interface else {}


def bind_gloo_to_node_address(address: str) -> None:
    """Make gloo groups created by this process from now on use `address`'s interface."""
    os.environ.update(gloo_interface_env(address))
