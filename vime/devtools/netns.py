"""Hosts on one machine, for tests and benchmarks: Linux network namespaces on one private subnet, made by the
caller and removed after it.

A hub namespace holds a bridge; this process's namespace (the head, where the driver runs) and each host
namespace join it through a veth pair. Every address is in 10.213.K.0/24 (K drawn per use among those no
route of this host covers yet), so traffic stays on this machine and two users at once do not share a subnet.
Needs root and the ``ip`` command; without them, or where namespaces cannot be made (a container without
CAP_NET_ADMIN), :class:`NoNamespaces` says why (tests skip on it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import subprocess
from typing import Iterator


class NoNamespaces(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Hosts:
    head_ip: str  # this process's address on the subnet: where the driver listens
    namespaces: dict[str, str]  # host name -> namespace
    ips: dict[str, str]  # host name -> address

    def command(self, host: str, *argv: str) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def interface(self, host: str) -> str:
        """``host``'s link to the subnet, inside its namespace (what GLOO_SOCKET_IFNAME names)."""
        return _veth(self, host)

    def cut(self, host: str) -> None:
        """Cut ``host`` off the subnet (its link down), as a pulled cable or a dead switch port would."""
        _ip("-n", self.namespaces[host], "link", "set", _veth(self, host), "down")

    def restore(self, host: str) -> None:
        """Put ``host`` back on the subnet."""
        _ip("-n", self.namespaces[host], "link", "set", _veth(self, host), "up")


def _veth(hosts: Hosts, host: str) -> str:
    return f"vn{sorted(hosts.namespaces).index(host)}{hosts.namespaces[host][-6:]}"


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def make_hosts(*names: str) -> Iterator[Hosts]:
    """Namespaces ``names`` beside this one, all on one bridge; removed on exit, whatever happened."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise NoNamespaces("network namespaces as hosts need root and the ip command (iproute2)")
    tag = os.urandom(3).hex()
    subnet = _free_subnet(random.Random(tag))
    hub, head_veth = f"vime-hub-{tag}", f"vh{tag}"
    hosts = Hosts(f"{subnet}.1", {name: f"vime-{i}-{tag}" for i, name in enumerate(names)},
                  {name: f"{subnet}.{i + 2}" for i, name in enumerate(names)})
    made: list[str] = []
    try:
        try:
            _ip("netns", "add", hub)
        except subprocess.CalledProcessError as err:
            raise NoNamespaces(f"cannot make a network namespace here ({err.stderr.strip()})") from err
        made.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        _ip("link", "add", head_veth, "type", "veth", "peer", "name", f"{head_veth}p", "netns", hub)
        _ip("-n", hub, "link", "set", f"{head_veth}p", "master", "br0", "up")
        _ip("addr", "add", f"{hosts.head_ip}/24", "dev", head_veth)
        _ip("link", "set", head_veth, "up")
        for name, namespace in hosts.namespaces.items():
            _ip("netns", "add", namespace)
            made.append(namespace)
            veth = _veth(hosts, name)
            _ip("link", "add", veth, "netns", namespace, "type", "veth", "peer", "name", f"{veth}p", "netns", hub)
            _ip("-n", hub, "link", "set", f"{veth}p", "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{hosts.ips[name]}/24", "dev", veth)
            _ip("-n", namespace, "link", "set", veth, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        subprocess.run(["ip", "link", "del", head_veth], capture_output=True)
        for namespace in reversed(made):
            _kill_inside(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _free_subnet(draw: random.Random) -> str:
    """A 10.213.K prefix that no route of this host covers (another user's hosts, or a real network)."""
    routes = subprocess.run(["ip", "route", "show"], capture_output=True, text=True).stdout
    free = [k for k in range(1, 250) if f"10.213.{k}." not in routes]
    if not free:
        raise NoNamespaces("every 10.213.K.0/24 subnet is in use on this host")
    return f"10.213.{draw.choice(free)}"


def _kill_inside(namespace: str) -> None:
    """SIGKILL what still runs in ``namespace``: a process left there would keep it (and its addresses) alive."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
    for pid in listed.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
