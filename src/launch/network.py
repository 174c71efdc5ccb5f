"""Which network interface gloo binds to in a job that spans several machines.

gloo (the training's backend on CPU, and on GPUs the stop vote's: src/faults/preemption.py) binds to the address
this host's name resolves to. Where that is a loopback address (Debian's `127.0.1.1 node-a` in /etc/hosts, a
container on the host's network with only `127.0.0.1` there), every rank gives the others an address they cannot
reach, and setting up the group fails after a time-out ("Gloo connectFullMesh failed ... Connection refused,
remote=[127.0.0.1]"). NCCL chooses its interfaces itself, so without this a GPU job could fail where NCCL alone
works. There, before any process group exists, GLOO_SOCKET_IFNAME is set to the interface that routes to the
main node, else to the default route's; with neither, a warning names the variable. A GLOO_SOCKET_IFNAME of the
user's is left alone.
"""

import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address


def choose_gloo_interface() -> Optional[str]:
    """Sets GLOO_SOCKET_IFNAME where gloo's own choice cannot reach the other machines; the interface chosen,
    or None where gloo's choice stands (one machine, a host name with a network address, the user's choice)."""
    if "GLOO_SOCKET_IFNAME" in os.environ or not spans_machines():  # one machine: no name is looked up
        return None
    hostname = socket.gethostname()
    if not resolves_to_loopback(hostname):
        return None
    main = os.environ.get("MASTER_ADDR", "")
    interface = interface_towards(main) or default_route_interface()
    once_per_machine = os.environ.get("LOCAL_RANK", "0") == "0"
    if interface is None:  # left alone: "machines" that are all this one (a test, a laptop) still connect
        if once_per_machine:
            log.warning("this host's name (%s) resolves to a loopback address, which other machines cannot reach, "
                        "and no interface routes to the main node (MASTER_ADDR=%s) nor is there a default route: "
                        "if setting up gloo (the stop vote's group, the training's on CPU) times out, set "
                        "GLOO_SOCKET_IFNAME to the interface the machines reach each other on (`ip -o -4 addr` "
                        "lists them)", hostname, main or "unset")
        return None
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    if once_per_machine:  # each machine makes its own choice
        log.warning("this host's name (%s) resolves to a loopback address, which the other machines cannot "
                    "reach: gloo binds to %s (%s) instead (GLOO_SOCKET_IFNAME chooses another)",
                    hostname, interface, ipv4_address(interface))
    return interface


def spans_machines() -> bool:
    """Whether the launcher started this job's processes on more than one machine (torchrun's variables, which
    accelerate's launcher sets too)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def resolves_to_loopback(name: str) -> bool:
    """Whether gloo would bind to a loopback address for this host name: it takes the first address the name
    resolves to that it can bind to (a loopback address always can), and the loopback address itself when the
    name does not resolve."""
    try:
        first = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return True
    return ipaddress.ip_address(first.split("%")[0]).is_loopback


def interface_towards(host: str) -> Optional[str]:
    """The interface the kernel would send packets to `host` from, unless that is the loopback."""
    try:
        address = socket.gethostbyname(host)
        if ipaddress.ip_address(address).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # connecting a UDP socket sends nothing: the kernel only picks a route
            local = probe.getsockname()[0]
    except OSError:
        return None
    return next((name for _, name in socket.if_nameindex() if ipv4_address(name) == local), None)


def default_route_interface() -> Optional[str]:
    """The interface of the default route (Linux's /proc/net/route), if it has an address."""
    try:
        routes = [line.split() for line in Path("/proc/net/route").read_text().splitlines()[1:]]
    except OSError:
        return None
    return next((fields[0] for fields in routes
                 if len(fields) > 7 and fields[1] == fields[7] == "00000000" and ipv4_address(fields[0])), None)


def ipv4_address(interface: str) -> Optional[str]:
    try:
        import fcntl  # Unix only; multi-machine jobs run on Linux
    except ImportError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", interface.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)[20:24])
        except OSError:
            return None
