"""Which links a transfer crosses on a machine preset, and what happens when two transfers cross the same one.

A copy between two GPUs, or between a GPU and the host, runs over a route of link directions: the GPU's own
PCIe link up or down, the uplink of the PCIe switch it sits behind (shared by the GPUs under that switch), the
NVLink bricks between a pair, or a GPU's NVLink port into an NVSwitch. PCIe and NVLink are full duplex, so the
two directions of a link are separate resources, with one exception: a copy engine reading host memory slows down
while its GPU writes to the host (PCIE_READ_UNDER_WRITE). Copies that share a resource at the same time share its
bandwidth: `LinkLedger` gives each copy what earlier copies left over, first come first served, so bytes through
a shared uplink are conserved and the last copy ends when the link would have carried them all.

Collectives take NCCL's view of the same topology (`collective_link`): on a hybrid cube mesh the ring all-reduce
runs over as many brick-disjoint rings through the chosen GPUs as the mesh has, each in both directions; where
no ring of NVLinks joins them, or the GPUs cannot reach each other's memory at all (GeForce cards), the ring goes
through host memory over PCIe (at the host link's rate, which may differ from the peer link's).
"""
from __future__ import annotations

import dataclasses
import math
import threading

from course.machine.hardware import (NCCL_HOP_LATENCY_US, NVLINK2_BRICK_GBPS, NVLINK_P2P_COPY_EFFICIENCY,
                             PCIE_READ_UNDER_WRITE, Link, Machine)


def switch_of(machine: Machine | None, gpu: int) -> int | None:
    """Index of the PCIe switch the GPU sits behind (its uplink is shared), None if it has a root port alone (or no
    machine preset says)."""
    for index, group in enumerate(machine.pcie_switches if machine is not None else ()):
        if gpu in group:
            return index
    return None


def _pcie(machine: Machine | None, gpu: int, direction: str) -> list[tuple]:
    """The GPU's own PCIe link in one direction ("up" to the host, "down" from it), then its switch's uplink."""
    route = [("pcie", gpu, direction)]
    switch = switch_of(machine, gpu)
    if switch is not None:
        route.append(("uplink", switch, direction))
    return route


def host_route(machine: Machine | None, gpu: int, to_gpu: bool) -> list[tuple]:
    """Link directions a copy between the host and `gpu` crosses."""
    return _pcie(machine, gpu, "down" if to_gpu else "up")


def peer_route(machine: Machine, src: int, dst: int) -> list[tuple]:
    """Link directions a copy from GPU src to GPU dst crosses (what `costs.peer_copy_ns` prices when it is alone)."""
    if machine.every_pair_direct and machine.link.startswith("nvlink"):  # an NVSwitch: each GPU's port, out and in
        return [("nvlink-port", src, "out"), ("nvlink-port", dst, "in")]
    if machine.nvlink_bricks and machine.bricks_between(src, dst):
        return [("bricks", min(src, dst), max(src, dst), "forward" if src < dst else "backward")]
    if machine.every_pair_direct:  # PCIe peer-to-peer: behind one switch it never reaches the uplink
        if switch_of(machine, src) is not None and switch_of(machine, src) == switch_of(machine, dst):
            return [("pcie", src, "up"), ("pcie", dst, "down")]
    return _pcie(machine, src, "up") + _pcie(machine, dst, "down")  # through the host (or across switches)


def reads_host_memory(machine: Machine, src: int, dst: int) -> bool:
    """Whether a copy from GPU src to GPU dst is staged through host memory, so dst's copy engine reads it there."""
    return not machine.every_pair_direct and not machine.bricks_between(src, dst)


class LinkLedger:
    """When each link direction is busy, and at what rate, so that a new copy gets the bandwidth left over.

    One ledger per host thread: copies issued by different threads (rank threads) do not see each other's share,
    because their order is the operating system's and the clock must not depend on it. A copy already booked is
    never slowed by a later one: two GPUs copying to each other through host memory, each reading while the other
    writes, are priced as one slowed copy and one not. Slowing both was measured on the two held-out staged
    bidirectional rows of benchmarks/fidelity.py (an experiment that slowed every staged read there): 23.2 GB/s
    against 25.76 measured on 3x RTX 4090 (-10%, from +22% today) but against 30.53 on nccl#814's PCIe 4 box (-24%,
    from +3% today), so the published rows do not say that both slow by PCIE_READ_UNDER_WRITE; and slowing the
    earlier copy means re-pricing a copy the clock has already placed (course/machine/clock.py). Neither is done.
    """

    def __init__(self):
        self._local = threading.local()

    def _busy(self) -> dict:
        if not hasattr(self._local, "busy"):
            self._local.busy = {}
        return self._local.busy

    def schedule(self, route: list[tuple], capacity: float, start_ns: int, nbytes: int, rate: float,
                 forget_before_ns: int, reads_host: bool = False) -> float:
        """End time (ns, float) of nbytes starting at start_ns at up to `rate` bytes/ns over `route`, each of whose
        link directions carries `capacity` bytes/ns in all; the copy's segments are booked on every one.

        A copy that `reads_host` (a copy engine pulling host memory down a GPU's PCIe link) runs at
        PCIE_READ_UNDER_WRITE of its rate while that GPU's link up to the host is booked. Reservations that ended
        before `forget_before_ns` (the host's time: no later copy of this thread starts earlier) are dropped first.
        """
        busy = self._busy()
        segments = [busy.setdefault(key, []) for key in route]
        writes_up = [busy.setdefault(("pcie", key[1], "up"), []) for key in route
                     if reads_host and key[0] == "pcie" and key[2] == "down"]
        for booked in segments + writes_up:
            booked[:] = [s for s in booked if s[1] > forget_before_ns]
        t, remaining, mine = float(start_ns), float(nbytes), []
        while remaining > 0:
            edges = sorted({e for booked in segments + writes_up for s in booked for e in s[:2] if e > t})
            horizon = edges[0] if edges else math.inf
            used = max((sum(r for a, b, r in booked if a <= t < b) for booked in segments), default=0.0)
            slowed = any(a <= t < b for booked in writes_up for a, b, _ in booked)
            available = min(rate * PCIE_READ_UNDER_WRITE if slowed else rate, capacity - used)
            if available <= rate * 1e-9:  # the links are full until the next booking ends
                t = horizon
                continue
            if remaining / available <= horizon - t:  # done before anything else on these links changes
                mine.append((t, t + remaining / available, available))
                t += remaining / available
                break
            mine.append((t, horizon, available))
            remaining -= available * (horizon - t)
            t = horizon
        for booked in segments:
            booked.extend(mine)
        return t


def ring_count(machine: Machine, devices: list[int]) -> int:
    """How many rings through all `devices` NCCL can build from NVLink bricks, no brick used twice.

    A depth-first search for Hamiltonian cycles, taking the bricks each ring uses away before looking for the
    next; the largest count over the choices wins (a DGX-1V's eight GPUs give three, the whitepaper's "three
    interwoven rings"). Two GPUs make one ring per brick between them.
    """
    if len(devices) == 2:
        return machine.bricks_between(*devices)
    free = {(a, b): machine.bricks_between(a, b) for a in devices for b in devices if a < b}

    def edge(a, b):
        return (a, b) if a < b else (b, a)

    def rings_from(free_bricks) -> int:
        best = 0
        for cycle in _cycles(devices, free_bricks, edge):
            remaining = dict(free_bricks)
            for a, b in zip(cycle, cycle[1:] + cycle[:1]):
                remaining[edge(a, b)] -= 1
            best = max(best, 1 + rings_from(remaining))
            if best >= bound(free_bricks):
                break
        return best

    def bound(free_bricks) -> int:  # each ring takes two bricks at every GPU
        return min(sum(v for k, v in free_bricks.items() if d in k) // 2 for d in devices)

    return rings_from(free)


def _cycles(devices, free, edge):
    """Hamiltonian cycles over edges with a free brick, each found once (starting at devices[0])."""
    first, others = devices[0], devices[1:]

    def extend(path, left):
        if not left:
            if free[edge(path[-1], first)] > 0 and path[1] < path[-1]:  # one direction of each cycle
                yield list(path)
            return
        for nxt in sorted(left):
            if free[edge(path[-1], nxt)] > 0:
                yield from extend(path + [nxt], left - {nxt})

    yield from extend([first], set(others))


def collective_link(machine: Machine | None, link: Link, host_link: Link, devices: list[int]) -> Link:
    """The link NCCL's ring over `devices` effectively runs on: bandwidth per direction, efficiency, hop latency.

    A switch (NVSwitch, or PCIe with peer-to-peer) gives the ring the whole link. On NVLink bricks, each
    brick-disjoint ring runs in both directions, so it carries 2 x NVLINK2_BRICK_GBPS (one brick per direction
    for two GPUs). With no NVLink ring, or no peer access, every step goes up one GPU's PCIe link into host memory
    and down the next one's (NCCL's shared-memory transport): the host link's rate per direction, and a PCI hop's
    latency per step, as NCCL's own tuning model prices a PCI path (NCCL_HOP_LATENCY_US).
    """
    if machine is None or machine.every_pair_direct or len(devices) < 2:
        return link
    rings = ring_count(machine, devices) if machine.nvlink_bricks else 0
    if rings:
        per_direction = rings * NVLINK2_BRICK_GBPS * (1 if len(devices) == 2 else 2)
        return dataclasses.replace(link, name=f"{link.name}, {rings} ring(s) over the cube mesh",
                                   bandwidth_gbps=per_direction, nvls_busbw_gbps=0.0)
    return dataclasses.replace(host_link, name=f"{host_link.name} through host memory",
                               hop_latency_us=NCCL_HOP_LATENCY_US["pci"], nvls_busbw_gbps=0.0)


def route_capacity(machine: Machine, link: Link, host_link: Link, route: list[tuple]) -> float:
    """Bytes/ns one direction of the route's links carries in all (the first link sets it: all are alike)."""
    kind = route[0][0]
    if kind == "nvlink-port":
        return link.bandwidth_gbps * NVLINK_P2P_COPY_EFFICIENCY
    if kind == "bricks":
        a, b = route[0][1], route[0][2]
        return machine.bricks_between(a, b) * NVLINK2_BRICK_GBPS * NVLINK_P2P_COPY_EFFICIENCY
    return host_link.bandwidth_gbps * host_link.efficiency
