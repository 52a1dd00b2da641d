"""course.sharding reads back from the trace exactly the bytes that were copied, and who copied them."""
import torch

import course
from course import sharding


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
