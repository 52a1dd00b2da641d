"""The layer that fakes CUDA on a CPU build of PyTorch: tensors on fake devices, the dispatcher that runs and times
their ops, and what the emulator patches into torch (torch.cuda, NCCL, autocast...)."""
