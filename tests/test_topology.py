"""Machine topology: copies that share a PCIe uplink share its bandwidth, and NCCL's rings follow the cube mesh."""
import pytest
import torch

import course
from course.machine import costs, hardware, topology


def _copy_times_ms(machine: str, gpus, to_gpu: bool = True, nbytes: int = 2**28) -> list[float]:
    """Durations of one pinned host copy per GPU in `gpus`, each issued at once on its own stream."""
    with course.emulate(machine=machine, materialize=False, force=True) as emu:
        host = [torch.empty(nbytes, dtype=torch.uint8).pin_memory() for _ in gpus]
        dev = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{g}") for g in gpus]
        torch.cuda.synchronize()
        for g, h, d in zip(gpus, host, dev):
            with torch.cuda.stream(torch.cuda.Stream(g)):
                h.to(f"cuda:{g}", non_blocking=True) if to_gpu else d.to("cpu", non_blocking=True)
        copies = [e for e in emu.trace if e.kind == "copy"]
        return [(e.end_ns - e.start_ns) / 1e6 for e in copies]


def test_two_gpus_behind_one_pcie_switch_share_its_uplink():
    alone_ms = costs.copy_ns(hardware.link("pcie4"), 2**28, pinned=True) / 1e6
    first, second = _copy_times_ms("DGX-A100", (0, 1))
    assert first == pytest.approx(alone_ms, rel=1e-6)
    assert second == pytest.approx(2 * alone_ms, rel=1e-3)  # the uplink carried both: bytes are conserved
    assert _copy_times_ms("DGX-A100", (0, 2)) == pytest.approx([alone_ms, alone_ms], rel=1e-6)  # two switches


def test_opposite_directions_of_a_link_do_not_contend():
    """PCIe is full duplex: a copy up and a copy down through the same uplink both run at full speed."""
    with course.emulate(machine="DGX-A100", materialize=False, force=True) as emu:
        host = torch.empty(2**28, dtype=torch.uint8).pin_memory()
        dev = torch.empty(2**28, dtype=torch.uint8, device="cuda:1")
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream(0)):
            host.to("cuda:0", non_blocking=True)
        with torch.cuda.stream(torch.cuda.Stream(1)):
            dev.to("cpu", non_blocking=True)
        durations = {(e.end_ns - e.start_ns) for e in emu.trace if e.kind == "copy"}
    assert durations == {costs.copy_ns(hardware.link("pcie4"), 2**28, pinned=True)}


def test_a_copy_alone_costs_what_the_cost_model_says():
    nbytes = 123_456_789
    for machine, src, dst in (("DGX-1V", 0, 3), ("DGX-1V", 0, 5), ("8xL4", 2, 6), ("4xRTX4090", 1, 2)):
        m = hardware.machine(machine)
        expected = costs.peer_copy_ns(m, hardware.link(m.link), hardware.link(m.host_link), src, dst, nbytes)
        with course.emulate(machine=machine, materialize=False, force=True) as emu:
            torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}").to(f"cuda:{dst}")
            (copy,) = [e for e in emu.trace if e.kind == "copy"]
        assert copy.end_ns - copy.start_ns == expected, machine


def test_dgx1v_rings_follow_the_cube_mesh():
    """Eight GPUs: the whitepaper's three interwoven rings, each run both ways (6 x 25 GB/s, all six bricks);
    four GPUs 0-3 have four bricks each among them, so two rings; GPU 4 reaches GPUs 0-4 by one neighbour only, so
    there is no NVLink ring and NCCL goes through host memory, at the host link's rate."""
    dgx1, nvlink2, pcie3 = hardware.machine("DGX-1V"), hardware.link("nvlink2"), hardware.link("pcie3")
    assert topology.ring_count(dgx1, list(range(8))) == 3
    assert topology.ring_count(dgx1, [0, 1, 2, 3]) == 2
    assert topology.ring_count(dgx1, [0, 3]) == 2 and topology.ring_count(dgx1, [0, 5]) == 0
    assert topology.collective_link(dgx1, nvlink2, pcie3, list(range(8))).bandwidth_gbps == nvlink2.bandwidth_gbps
    assert topology.collective_link(dgx1, nvlink2, pcie3, [0, 1, 2, 3]).bandwidth_gbps == 100
    five = topology.collective_link(dgx1, nvlink2, pcie3, [0, 1, 2, 3, 4])
    assert (five.bandwidth_gbps, five.efficiency) == (pcie3.bandwidth_gbps, pcie3.efficiency)
    assert five.hop_latency_us == pcie3.hop_latency_us


def test_an_allreduce_on_four_gpus_of_a_dgx1v_is_slower_than_on_eight():
    def busbw(gpus: int) -> float:
        with course.emulate(machine="DGX-1V", gpus=gpus, materialize=False, force=True) as emu:
            tensors = [torch.empty(2**28, device=f"cuda:{i}") for i in range(gpus)]
            torch.cuda.nccl.all_reduce(tensors)
            (event, *_) = [e for e in emu.trace if e.kind == "collective"]
        return 2**30 / (event.end_ns - event.start_ns) * 2 * (gpus - 1) / gpus

    assert busbw(4) == pytest.approx(busbw(8) * 100 / 150, rel=0.05)


def test_collectives_without_peer_access_go_through_host_memory():
    """GeForce cards cannot reach each other's memory, so NCCL's ring crosses the host link, whatever the peer
    link is (a box whose slots run at PCIe 3 is as slow as PCIe 3)."""
    pcie3, pcie4 = hardware.link("pcie3"), hardware.link("pcie4")
    box = hardware.Machine("4x RTX 4090 on PCIe 3 slots", "RTX4090", 4, "pcie4", "pcie3")
    ring = topology.collective_link(box, pcie4, pcie3, [0, 1, 2, 3])
    assert (ring.bandwidth_gbps, ring.efficiency) == (pcie3.bandwidth_gbps, pcie3.efficiency)
    assert costs.ring_allreduce_ns(ring, 2**30, 4) == costs.ring_allreduce_ns(pcie3, 2**30, 4)


def test_switched_machines_keep_their_link_for_collectives():
    for key in ("DGX-A100", "DGX-H100", "8xL4"):
        m = hardware.machine(key)
        link = hardware.link(m.link)
        assert topology.collective_link(m, link, hardware.link(m.host_link), list(range(8))) is link


def test_two_copies_out_of_one_gpu_share_its_nvswitch_port():
    """On a DGX H100 every pair has the whole NVLink through the switch, but GPU 0's port carries both copies."""
    nbytes = 2**30
    with course.emulate(machine="DGX-H100", materialize=False, force=True) as emu:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        for dst in (1, 2):
            with torch.cuda.stream(torch.cuda.Stream(0)), torch.cuda.stream(torch.cuda.Stream(dst)):
                src.to(f"cuda:{dst}", non_blocking=True)
        first, second = [e.end_ns - e.start_ns for e in emu.trace if e.kind == "copy"]
    assert second == pytest.approx(2 * first, rel=0.01)  # less the head start the first copy had


@pytest.mark.parametrize("machine", [dict(gpus=1), dict(machine="DGX-A100")])
def test_a_copy_to_a_gpu_reads_host_memory_at_half_speed_while_that_gpu_writes_there(machine):
    """A host-to-device copy is the copy engine reading host memory; its read requests queue behind the writes of a
    device-to-host copy filling the same link's upstream (hardware.PCIE_READ_UNDER_WRITE). The write keeps its speed,
    and a copy to another GPU, or to the same GPU once the write has ended, runs at full speed."""
    nbytes = 2**26
    with course.emulate(**machine, materialize=False, force=True) as emu:
        alone_ns = costs.copy_ns(emu.host_link, nbytes, pinned=True)
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dev = torch.empty(4 * nbytes, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream(0)):
            dev.to("cpu", non_blocking=True)
        with torch.cuda.stream(torch.cuda.Stream(0)):
            host.to("cuda:0", non_blocking=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream(0)):
            host.to("cuda:0", non_blocking=True)
        write, read, later = [e.end_ns - e.start_ns for e in emu.trace if e.kind == "copy"]
    assert write == costs.copy_ns(emu.host_link, 4 * nbytes, pinned=True)
    transfer_ns = nbytes / (emu.host_link.bandwidth_gbps * emu.host_link.efficiency)
    assert read - alone_ns == pytest.approx(transfer_ns * (1 / hardware.PCIE_READ_UNDER_WRITE - 1), rel=1e-3)
    assert later == alone_ns
