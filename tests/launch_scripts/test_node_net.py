"""The node functions of launch_scripts/ray_on_slurm.sh (its NODE_FUNCS block), run under bash on
this machine: parsing (SLURM_JOB_CPUS_PER_NODE, `ip route get`, choosing an address), the choice of
interface and IP against this machine's own `ip -o -4 addr`, the refusal of a loopback address on
a multi-node job, the per-node NCCL/gloo interface and the raised limits. (Slurm-level: a job whose
node names resolve to loopback fails naming MEGARL_NET_IFACE, in test_ray_on_slurm.py.)"""

from __future__ import annotations

import re
import resource
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "launch_scripts" / "ray_on_slurm.sh"
NODE_FUNCS = re.search(r"^NODE_FUNCS='(.*?)^'$", SCRIPT.read_text(), re.S | re.M).group(1)


def _bash(code: str, **env: str) -> str:
    base = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    proc = subprocess.run(["bash", "-c", NODE_FUNCS + code], capture_output=True, text=True, env={**base, **env},
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _global_ipv4() -> tuple[str, str]:
    """(interface, address) of this machine's first global IPv4 address, from `ip -o -4 addr`."""
    for line in subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout.splitlines():
        fields = line.split()
        if "global" in fields:
            return fields[1], fields[3].split("/")[0]
    pytest.fail("this machine has no global IPv4 address")


def test_slurm_cpu_counts_expand_one_per_node():
    assert _bash('expand_counts "72(x2),36"') == "72 72 36"
    assert _bash('expand_counts "2(x2)"') == "2 2"
    assert _bash('expand_counts 16') == "16"


def test_the_route_and_address_choice():
    assert _bash('route_dev "10.1.0.2 dev ib0 src 10.1.0.1 uid 1000 \\    cache"') == "ib0"
    assert _bash('route_dev "local 10.1.0.1 dev lo table local src 10.1.0.1 uid 0 \\    cache <local>"') == "lo"
    # the node name's address when it is on the interface, else the interface's first address
    assert _bash('pick_ipv4 "10.0.0.5/24 10.1.0.5/16" "127.0.1.1 10.1.7.9"') == "10.1.7.9"
    assert _bash('pick_ipv4 "10.0.0.5/24" "127.0.1.1 10.1.7.9"') == "10.0.0.5"
    assert _bash('pick_ipv4 "127.0.0.1/8" "127.0.0.12"') == "127.0.0.12"
    assert _bash('pick_ipv4 "" "10.0.0.5"') == ""


def test_a_node_takes_the_interface_of_its_route_to_the_head():
    iface, address = _global_ipv4()
    # The head itself: its own address routes through lo ("local"), the interface holding it is meant.
    assert _bash(f"net_iface {address}") == iface
    host, got_iface, ip, memlock, _ = _bash(f"node_net {address} 2", SLURMD_NODENAME="n7").split()
    assert (host, got_iface, ip) == ("n7", iface, address)
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert memlock == ("unlimited" if soft == resource.RLIM_INFINITY else str(soft // 1024))


def test_a_loopback_address_is_refused_on_a_multi_node_job_naming_the_variable():
    out = _bash("node_net 127.0.0.1 2", SLURMD_NODENAME="n1")
    assert out.startswith("n1 error the route to the head address 127.0.0.1 is the loopback interface lo (127.0.0.1)")
    assert "set MEGARL_NET_IFACE to the interface the nodes share" in out
    assert _bash("node_net 127.0.0.1 1", SLURMD_NODENAME="n1").split()[:3] == ["n1", "lo", "127.0.0.1"]  # one node
    assert _bash("node_net - 2", SLURMD_NODENAME="n1", MEGARL_NET_IFACE="lo").split()[:2] == ["n1", "lo"]  # chosen
    assert _bash("node_net - 2", SLURMD_NODENAME="n1", MEGARL_NET_IFACE="ib9") == \
        "n1 error MEGARL_NET_IFACE=ib9: no such interface here (ip -o link lists them)"


def test_node_env_sets_this_nodes_interface_and_raises_the_open_files_limit():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    expected = 65535 if hard == resource.RLIM_INFINITY else min(65535, hard)
    out = _bash('ulimit -Sn 1024; node_env; echo "$NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME $(ulimit -Sn)"',
                SLURMD_NODENAME="n2", MEGARL_NODE_IFACES="n1=eth0 n2=ib0 ")
    assert out == f"ib0 ib0 {expected}"
    # a user's own setting wins
    out = _bash('node_env; echo "$NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME"', SLURMD_NODENAME="n2",
                MEGARL_NODE_IFACES="n2=ib0", NCCL_SOCKET_IFNAME="=ib1")
    assert out == "=ib1 ib0"
