"""course.lessons.sharding reads back from the trace exactly the bytes that were copied, and who copied them."""
import pytest
import torch

import course
from course.lessons import sharding


def test_bytes_copied_by_direction():
    with course.emulate(gpus=3) as emu:
        x = torch.randn(100, 10)                  # 4000 bytes
        on_gpu = x.to("cuda:0")                   # cpu -> cuda:0
        on_gpu.to("cuda:1")                       # cuda:0 -> cuda:1
        on_gpu.to("cuda:2")[:50].to("cuda:0")     # cuda:0 -> cuda:2, then 2000 bytes back
        on_gpu.clone().cpu()                      # cuda:0 -> cpu
        on_gpu.copy_(on_gpu * 2)                  # within one GPU: not a move between devices
    trace = emu.trace
    assert sharding.bytes_copied(trace, "cpu", "cuda:0") == 4000
    assert sharding.bytes_copied(trace, "cuda:0", "cuda:1") == 4000
    assert sharding.bytes_copied(trace, "cuda:2", "cuda:0") == 2000
    assert sharding.bytes_copied(trace, "cuda:0", "cpu") == 4000
    assert sharding.bytes_copied(trace, src="cuda:0") == 12000
    assert sharding.bytes_copied(trace, dst="cuda:0") == 6000
    assert sharding.bytes_copied(trace) == 18000
    assert len(sharding.copies(trace, "cuda:1")) == 0


def test_copy_table_rows_are_sources_and_columns_destinations():
    with course.emulate(gpus=2) as emu:
        torch.ones(1000, device="cuda:0").to("cuda:1")
    table = sharding.copy_table(emu.trace)
    assert table.devices == ["cuda:0", "cuda:1"]
    assert table["cuda:0", "cuda:1"] == 4000 and table["cuda:1", "cuda:0"] == 0
    assert str(table).splitlines()[1].split() == ["cuda:0", "-", "3.91", "KiB"]
    assert "<table>" in table._repr_html_()


def test_collective_bytes_counts_each_collective_once():
    with course.emulate(gpus=4) as emu:
        x = torch.ones(256, device="cuda:0")
        torch.cuda.comm.broadcast(x, [0, 1, 2, 3])
    assert sharding.collective_bytes(emu.trace) == 1024
    assert sharding.collective_bytes(emu.trace, "nccl:all_reduce") == 0


def test_since_keeps_only_what_ran_after_a_synchronize():
    with course.emulate(gpus=2) as emu:
        x = torch.ones(1000, device="cuda:0")
        x.to("cuda:1")
        torch.cuda.synchronize()
        start_ms = emu.now_ms()
        x[:10].to("cuda:1")
    assert sharding.bytes_copied(emu.trace, "cuda:0", "cuda:1") == 4040
    assert sharding.bytes_copied(sharding.since(emu.trace, start_ms), "cuda:0", "cuda:1") == 40


def _three_collectives(rank, world_size):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    shard = torch.ones(4, device="cuda")
    full = torch.empty(4 * world_size, device="cuda")
    dist.all_gather_into_tensor(full, shard)
    dist.reduce_scatter_tensor(shard, full)
    dist.all_reduce(full)
    torch.cuda.synchronize()


def test_ring_bytes_sent_counts_what_each_rank_puts_on_its_link():
    with course.emulate(gpus=3) as emu:
        course.run_threads(_three_collectives, 3, backend="nccl")
    full_bytes = 4 * 3 * 4  # 12 fp32 values
    # all-gather and reduce-scatter: 2 of the 3 chunks each; all-reduce: twice that
    want = full_bytes * 2 // 3 + full_bytes * 2 // 3 + 2 * full_bytes * 2 // 3
    assert [sharding.ring_bytes_sent(emu.trace, f"cuda:{r}", 3) for r in range(3)] == [want] * 3
    assert sharding.ring_bytes_sent(emu.trace, "cuda:0", 1) == 0
    broadcast = emu.trace + [emu.trace[0]._replace(kind="collective", name="nccl:broadcast", device="cuda:0")]
    with pytest.raises(ValueError, match="broadcast"):
        sharding.ring_bytes_sent(broadcast, "cuda:0", 3)
