"""The sandbox's network: one bridge on the login node, one network namespace + veth per host.

A host's default route points into a veth whose peer stays down: "which IP am I" tricks (UDP connect
to 8.8.8.8, used by Ray and vLLM) return the host's address while no packet leaves the machine.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from hpcserve.core.errors import StageError, UsageError
from hpcserve.sandbox.procs import STOP_TIMEOUT_S, run, wait_for


def check_subnet_free(net: str, bridge: str) -> None:
    """Refuse to overlap another test cluster (e.g. the reference one on the same /24)."""
    ours = ipaddress.IPv4Network(f"{net}.0/24")
    done = run(["ip", "-o", "-4", "addr", "show"], timeout=10)
    for line in done.stdout.splitlines():
        fields = line.split()
        iface, address = fields[1], ipaddress.IPv4Interface(fields[3])
        if iface != bridge and address.network.overlaps(ours):
            raise UsageError(f"{ours} is already used by interface {iface} (another test "
                             f"cluster?); stop it or choose another net (e.g. `up --net 198.18.1`)")


def network_up(bridge: str, gateway: str, addresses: dict[str, str]) -> None:
    """Bridge at `gateway`/24 on the login node, one veth per host (host name -> its address), and
    the dead-end default route inside each host."""
    batch = [f"link add {bridge} type bridge",
             f"addr replace {gateway}/24 dev {bridge}",
             f"link set {bridge} up"]
    for host in addresses:
        batch += [f"netns add {host}",
                  f"link add v{host} type veth peer name eth0 netns {host}",
                  f"link set v{host} master {bridge} up"]
    run(["ip", "-batch", "-"], input="\n".join(batch) + "\n")
    for iface in [bridge, *(f"v{h}" for h in addresses)]:
        disable_ipv6_on(iface)
    for host, address in addresses.items():
        # The default route's veth peer stays DOWN: packets to non-test addresses are dropped
        # inside the node. (No dummy module on these kernels; a blackhole route makes UDP
        # connect() fail, which breaks Ray's and vLLM's own-address detection.)
        inside = [f"addr add {address}/24 dev eth0", "link set eth0 up", "link set lo up",
                  "link add nullrt type veth peer name nullrt-peer", "link set nullrt up",
                  f"route add default dev nullrt src {address}"]
        run(["ip", "-n", host, "-batch", "-"], input="\n".join(inside) + "\n")


def network_down(bridge: str, hosts: list[str]) -> None:
    """Delete the hosts' namespaces, their veths and the bridge; wait until the veths are gone."""
    for host in hosts:
        if Path(f"/run/netns/{host}").exists():
            run(["ip", "netns", "delete", host], check=False, timeout=10)
    veths = [f"v{h}" for h in hosts]
    for iface in [*veths, bridge]:
        if Path(f"/sys/class/net/{iface}").exists():
            run(["ip", "link", "delete", iface], check=False, timeout=10)
    # Namespaces are freed asynchronously; the host-side veths vanish with them.
    if not wait_for(lambda: not any(Path(f"/sys/class/net/{v}").exists() for v in veths),
                    STOP_TIMEOUT_S):
        left = [v for v in veths if Path(f"/sys/class/net/{v}").exists()]
        raise StageError("sandbox down", f"interfaces still present: {', '.join(left)}")


def netns_exists(host: str) -> bool:
    return Path(f"/run/netns/{host}").exists()


def netns_names() -> list[str]:
    """Names of all named network namespaces (`ip netns add`)."""
    netns_dir = Path("/run/netns")
    return [p.name for p in netns_dir.iterdir()] if netns_dir.is_dir() else []


def netns_pids(host: str) -> list[int]:
    """Host PIDs of the processes in a host's network namespace."""
    if not netns_exists(host):
        return []
    done = run(["ip", "netns", "pids", host], check=False, timeout=10)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def disable_ipv6_on(iface: str) -> None:
    path = Path(f"/proc/sys/net/ipv6/conf/{iface}/disable_ipv6")
    if path.exists():
        path.write_text("1\n")
