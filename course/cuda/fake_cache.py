"""FakeTensorMode's dispatch cache keyed by the thread's current GPU as well, for rank threads.

FakeTensorMode caches each op's output metadata in one dict for the whole process, keyed by the op and its
arguments' metadata (torch/_subclasses/fake_tensor.py, FakeTensorMode._cache_key). A factory call naming "cuda"
without an index makes a tensor on the current device, which the key leaves out: one process per GPU never
notices, but rank threads share the cache, so a rank could get a fake tensor on another rank's GPU. DTensor's
sharding propagation makes its fake arguments that way (`torch.empty_strided(..., device="cuda")`), and
`dtensor + scalar_dtensor` then failed on rank threads with "Expected all tensors to be on the same device, but
found at least two devices, cuda:0 and cuda:1". The key here adds the thread's current emulated GPU, and a key's
eviction (when an object it hashed by id dies) evicts the key for every GPU.
"""
from __future__ import annotations

from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode, _DispatchCacheKey

from course.cuda.devices import current_emulator

_cache_key = FakeTensorMode._cache_key
_evict = fake_tensor.evict_fake_tensor_cache_key


def _on_this_gpu(key: _DispatchCacheKey) -> _DispatchCacheKey:
    return _DispatchCacheKey(key.key + (("cuda", current_emulator("fake tensors").current_device()),))


def _cache_key_on_this_gpu(self, state, func, args, kwargs) -> _DispatchCacheKey:
    return _on_this_gpu(_cache_key(self, state, func, args, kwargs))


def _evict_on_every_gpu(key: _DispatchCacheKey) -> None:
    for index in range(current_emulator("fake tensors").num_gpus):
        _evict(_DispatchCacheKey(key.key + (("cuda", index),)))


PATCHES = [(FakeTensorMode, {"_cache_key": _cache_key_on_this_gpu}),
           (fake_tensor, {"evict_fake_tensor_cache_key": _evict_on_every_gpu})]
