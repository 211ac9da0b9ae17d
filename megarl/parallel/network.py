"""Which network interface gloo uses: the one that routes to the rendezvous (master) address.

vLLM, Megatron and megarl all build gloo groups over the whole world. Unless
``GLOO_SOCKET_IFNAME`` is set, gloo picks the interface the host name resolves to, often one the
other nodes cannot reach: the classic multi-node hang at the first gloo group.
:func:`set_gloo_socket_ifname` (every rank, before the default process group) sets it, for
multi-node jobs only, to the interface holding the address the kernel would use to reach
``MASTER_ADDR``; it leaves a user's value alone and sets nothing when it cannot tell (IPv6, no
route). Linux only (``SIOCGIFADDR``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

__all__ = ["interface_of_address", "route_interface", "set_gloo_socket_ifname"]

_SIOCGIFADDR = 0x8915


def interface_of_address(address: str) -> str | None:
    """The interface holding IPv4 ``address``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def route_interface(master_addr: str, port: int = 29500) -> str | None:
    """The interface whose address this host uses to reach ``master_addr``; None if unknown."""
    try:
        target = socket.gethostbyname(master_addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, port))  # picks a route and a source address; sends nothing
            local = s.getsockname()[0]
    except OSError:
        return None
    return interface_of_address(local)


def set_gloo_socket_ifname(master_addr: str, env: dict[str, str] | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` for a multi-node job unless set; return the value in effect."""
    env = os.environ if env is None else env
    if env.get("GLOO_SOCKET_IFNAME"):
        return env["GLOO_SOCKET_IFNAME"]
    world = int(env.get("WORLD_SIZE", "1"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    if local_world >= world:
        return None  # one node: gloo's default works over loopback
    name = route_interface(master_addr)
    if name is not None:
        env["GLOO_SOCKET_IFNAME"] = name
    return name
