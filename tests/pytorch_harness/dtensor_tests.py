"""DTensorTestBase-style: DTensor placement changes and a tensor-parallel MLP on a 2-GPU mesh (nccl)."""
import torch, torch.nn as nn
from torch.distributed.tensor import distribute_tensor, Shard, Replicate, DTensor
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms, MLPModule
from torch.testing._internal.common_distributed import skip_if_lt_x_gpu

class DTensorStyle(DTensorTestBase):
    @property
    def world_size(self): return 2
    @with_comms
    @skip_if_lt_x_gpu(2)
    def test_dtensor_and_tensor_parallel(self):  # one test: each spawns its processes
        mesh = self.build_device_mesh()
        self.assertEqual(mesh.device_type, "cuda")
        torch.manual_seed(0)
        full = torch.randn(4, 6, device=self.device_type)
        d = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(d.to_local().shape, torch.Size([2, 6]))
        self.assertEqual(d.redistribute(mesh, [Replicate()]).to_local(), full)
        self.assertEqual(d.full_tensor(), full)
        # tensor parallel MLP (column- then row-wise) against the same MLP on one GPU
        torch.manual_seed(0)
        model = MLPModule(self.device_type); ref = MLPModule(self.device_type)
        ref.load_state_dict(model.state_dict())
        tp = parallelize_module(model, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
        torch.manual_seed(1)
        x = torch.randn(3, 10, device=self.device_type)
        out, ref_out = tp(x), ref(x)
        self.assertEqual(out, ref_out)
        out.sum().backward(); ref_out.sum().backward()
        self.assertEqual(tp.net1.weight.grad.full_tensor(), ref.net1.weight.grad)

if __name__ == "__main__":
    run_tests()
