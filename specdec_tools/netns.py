"""Hosts on one machine: network namespaces joined by veth links, for the multi-host test
(tests/test_netns.py) and the round-trip benchmark (benchmarks/netns_rtt.py). Needs root (or
CAP_NET_ADMIN) and iproute2.

Topology, one /24 per run (10.77.K.0/24, K picked so no other run's routes collide):

    this host (root namespace) --- coordinator ---+--- draft      point-to-point veth links, /30 each;
       10.77.K.1           10.77.K.2  .5 |  .9    |  10.77.K.6   the coordinator's namespace forwards,
                                         |        +--- target     so this host also reaches the
                                         +------------ 10.77.K.10 draft and target, and they it
"""

from __future__ import annotations

import random
import shutil
import subprocess
import uuid


def sh(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=check, capture_output=True, text=True, timeout=30)


class Network:
    """The namespaces and links of one run; names carry a per-run tag so a crashed run cannot collide."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:6]
        used = sh("ip", "-4", "route", "show").stdout
        free = [k for k in range(1, 255) if f"10.77.{k}." not in used]
        self.subnet = f"10.77.{random.choice(free)}"
        self.ns = {role: f"sd{self.tag}{role[0]}" for role in ("coordinator", "draft", "target")}
        self.host_dev = f"sd{self.tag}h"
        # link name -> (namespace, device) of the coordinator's end: what a cut or a limit acts on
        self.links = {"draft": (self.ns["coordinator"], f"sd{self.tag}cd"), "target": (self.ns["coordinator"], f"sd{self.tag}ct")}
        self.far_ends = {"draft": (self.ns["draft"], f"sd{self.tag}dc"), "target": (self.ns["target"], f"sd{self.tag}tc")}
        self.created: list[str] = []

    def address(self, role: str) -> str:
        return {"coordinator": f"{self.subnet}.2", "draft": f"{self.subnet}.6", "target": f"{self.subnet}.10"}[role]

    def up(self) -> None:
        s, c = self.subnet, self.ns["coordinator"]
        for ns in self.ns.values():
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        # test host <-> coordinator
        sh("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", f"sd{self.tag}ch", "netns", c)
        sh("ip", "addr", "add", f"{s}.1/30", "dev", self.host_dev)
        sh("ip", "link", "set", self.host_dev, "up")
        sh("ip", "-n", c, "addr", "add", f"{s}.2/30", "dev", f"sd{self.tag}ch")
        sh("ip", "-n", c, "link", "set", f"sd{self.tag}ch", "up")
        # coordinator <-> draft and coordinator <-> target
        for role, first in (("draft", 4), ("target", 8)):
            (_, near), (far_ns, far) = self.links[role], self.far_ends[role]
            sh("ip", "-n", c, "link", "add", near, "type", "veth", "peer", "name", far, "netns", far_ns)
            sh("ip", "-n", c, "addr", "add", f"{s}.{first + 1}/30", "dev", near)
            sh("ip", "-n", c, "link", "set", near, "up")
            sh("ip", "-n", far_ns, "addr", "add", f"{s}.{first + 2}/30", "dev", far)
            sh("ip", "-n", far_ns, "link", "set", far, "up")
            sh("ip", "-n", far_ns, "route", "add", "default", "via", f"{s}.{first + 1}")
        sh("ip", "netns", "exec", c, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        sh("ip", "route", "add", f"{s}.0/24", "via", f"{s}.2")

    def cut(self, link: str) -> None:
        ns, dev = self.links[link]
        sh("ip", "-n", ns, "link", "set", dev, "down")

    def restore(self, link: str) -> None:
        ns, dev = self.links[link]
        sh("ip", "-n", ns, "link", "set", dev, "up")

    def limit(self, link: str, rate: str) -> None:
        """Token-bucket limit on both directions of the link."""
        for ns, dev in (self.links[link], self.far_ends[link]):
            sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "1600", "latency", "1s")

    def unlimit(self, link: str) -> None:
        for ns, dev in (self.links[link], self.far_ends[link]):
            sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)

    def down(self) -> None:
        # Deleting a namespace frees its devices asynchronously: drop the host's end (and its route) now.
        sh("ip", "link", "del", self.host_dev, check=False)
        for ns in self.created:
            sh("ip", "netns", "del", ns, check=False)


def namespaces_allowed() -> str | None:
    """None when `ip netns add` works here, else why not."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"sdprobe{uuid.uuid4().hex[:6]}"
    result = sh("ip", "netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"`ip netns add` is not permitted here (needs root / CAP_NET_ADMIN): {result.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None
