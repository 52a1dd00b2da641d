// A spike, not the emulator: CUDA-keyed tensors over host memory in a CPU-only PyTorch build, to measure the per-op
// cost of emulating GPUs below Python dispatch (benchmarks/cuda_key_floor.py loads it and prints the ratios).
// - an allocator (host memory, counted per device in mode 1) and the two factory kernels CUDA tensors are born from;
// - a DeviceGuardImpl for CUDA (current device per thread, one default stream): the Python bindings use one, and the
//   autograd engine starts one worker thread per device it reports, so it must be registered before any backward;
// - a boxed fallback for the CUDA key: every CUDA tensor argument becomes a CPU tensor over the same StorageImpl,
//   the op is redispatched to the CPU kernel, and outputs become CUDA tensors again (views share the storage,
//   in-place and out= give back the caller's tensor; storage stays labelled cpu, only the TensorImpl says cuda:i).
// Mode 0 does only that; mode 1 also keeps per-device allocated/peak bytes and appends (op, device, stream, input
// shapes) to a C++ vector; mode 2 instead calls a Python function per op, as a ledger kept in Python would.
#include <ATen/EmptyTensor.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

namespace {

constexpr int kMaxDevices = 16;
int g_device_count = 1;
int g_mode = 0;
thread_local c10::DeviceIndex t_current_device = 0;

// ---- memory: host bytes that say cuda:i; counted per device in mode 1 ----
std::array<std::atomic<int64_t>, kMaxDevices> g_allocated{};
std::array<std::atomic<int64_t>, kMaxDevices> g_peak{};

void count(int device, int64_t bytes) {
  int64_t now = g_allocated[device].fetch_add(bytes) + bytes;
  int64_t peak = g_peak[device].load();
  while (now > peak && !g_peak[device].compare_exchange_weak(peak, now)) {
  }
}

struct Owner {  // context of a counted DataPtr: what frees the memory, and what it counted
  c10::DataPtr host;  // a CPU kernel's fresh result, or our own allocation
  int64_t bytes;
  int device;
};

void release(void* context) {
  auto* owner = static_cast<Owner*>(context);
  count(owner->device, -owner->bytes);
  delete owner;  // frees `host`
}

c10::DataPtr counted(c10::DataPtr host, int64_t bytes, int device) {
  count(device, bytes);
  void* data = host.get();
  return c10::DataPtr(data, new Owner{std::move(host), bytes, device}, &release, c10::Device(c10::kCPU));
}

// Storage stays labelled cpu: CPU kernels make views of their arguments from the storage's device, and those must be
// CPU tensors. Only the TensorImpl says cuda:i (CudaImpl below).
struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    auto host = c10::GetCPUAllocator()->allocate(n);
    return g_mode == 1 ? counted(std::move(host), static_cast<int64_t>(n), t_current_device) : std::move(host);
  }
  void copy_data(void* dest, const void* src, std::size_t n) const override { std::memcpy(dest, src, n); }
};
HostAllocator g_allocator;

// A CUDA tensor: CUDA dispatch keys, device cuda:i, host storage. (device_opt_ is protected, hence a subclass;
// shallow copies, as detach() and nn.Parameter make, copy the device.)
struct CudaImpl final : c10::TensorImpl {
  CudaImpl(const c10::Storage& storage, caffe2::TypeMeta dtype, c10::DeviceIndex device)
      : c10::TensorImpl(c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype) {
    device_opt_ = c10::Device(c10::kCUDA, device);
  }
};

at::Tensor as_cuda(const at::Tensor& host, c10::DeviceIndex device) {
  auto* storage = host.storage().unsafeGetStorageImpl();
  if (g_mode == 1 && storage->data_ptr().get_deleter() != &release) {  // a CPU kernel's fresh result: count it
    int64_t bytes = static_cast<int64_t>(storage->nbytes());
    storage->set_data_ptr_noswap(counted(storage->set_data_ptr(c10::DataPtr()), bytes, device));
    storage->set_allocator(&g_allocator);
  }
  auto out = at::Tensor(c10::make_intrusive<CudaImpl>(host.storage(), host.dtype(), device));
  out.unsafeGetTensorImpl()->set_sizes_and_strides(host.sizes(), host.strides(), host.storage_offset());
  return out;
}

c10::DeviceIndex device_of(std::optional<c10::Device> device) {
  return device && device->has_index() ? device->index() : t_current_device;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>,
                               std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceIndex saved = t_current_device, index = device_of(device);
  t_current_device = index;
  at::Tensor host = at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                              dtype.value_or(at::get_default_dtype_as_scalartype()), memory_format);
  t_current_device = saved;
  return as_cuda(host, index);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  c10::DeviceIndex saved = t_current_device, index = device_of(device);
  t_current_device = index;
  at::Tensor host = at::detail::empty_strided_generic(size, stride, &g_allocator,
                                                      c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                      dtype.value_or(at::get_default_dtype_as_scalartype()));
  t_current_device = saved;
  return as_cuda(host, index);
}

// ---- device guard: what torch.cuda.device, the Python arg parser and the autograd engine ask for ----
struct HostCudaGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::kCUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(c10::kCUDA, t_current_device);
    if (d.has_index()) t_current_device = d.index();
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(c10::kCUDA, t_current_device); }
  void setDevice(c10::Device d) const override {
    if (d.has_index()) t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) t_current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return c10::Stream(c10::Stream::DEFAULT, s.device()); }
  c10::DeviceIndex deviceCount() const noexcept override { return static_cast<c10::DeviceIndex>(g_device_count); }
  // One stream per device, so every event is already complete: the engine records and waits on them.
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    *event = reinterpret_cast<void*>(1);
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
};
C10_REGISTER_GUARD_IMPL(CUDA, HostCudaGuard);

// ---- CUDA hooks: at::hasCUDA() and the "current accelerator", which the autograd engine asks for a cuda:i gradient ----
struct HostCudaHooks final : at::CUDAHooksInterface {
  explicit HostCudaHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(g_device_count); }
  int getNumGPUs() const override { return g_device_count; }
  c10::DeviceIndex current_device() const override { return t_current_device; }
  c10::DeviceIndex getCurrentDevice() const override { return t_current_device; }
  void setCurrentDevice(c10::DeviceIndex d) const override { t_current_device = d; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override { return std::exchange(t_current_device, d); }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return std::exchange(t_current_device, d); }
  // Random numbers come from the CPU generator, as CPU kernels draw them.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
};

// ---- the per-op record of mode 1 ----
struct Record {
  const c10::OperatorName* op;
  int8_t device;
  int8_t stream;
  uint32_t shapes_begin, shapes_end;  // into g_shapes: each input's dims, then -1
};
std::vector<Record> g_records;
std::vector<int64_t> g_shapes;
py::object g_callback;  // mode 2

// What the fallback needs to know about an op, looked up once per operator.
struct OpInfo {
  bool crosses_devices;  // copies and indexing take tensors on two devices, as CUDA PyTorch allows
  std::vector<size_t> written;  // argument positions the op may resize (out=, in-place)
};
std::unordered_map<const c10::FunctionSchema*, OpInfo> g_ops;

const OpInfo& info(const c10::OperatorHandle& op) {
  auto& schema = op.schema();
  auto found = g_ops.find(&schema);
  if (found != g_ops.end()) return found->second;
  static const std::vector<std::string> crossing = {"aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize",
                                                    "aten::_to_copy", "aten::index", "aten::index_put_",
                                                    "aten::_index_put_impl_", "aten::set_"};
  OpInfo result{std::find(crossing.begin(), crossing.end(), schema.name()) != crossing.end(), {}};
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    auto* alias = schema.arguments()[i].alias_info();
    if (alias && alias->isWrite()) result.written.push_back(i);
  }
  return g_ops.emplace(&schema, std::move(result)).first->second;
}

[[noreturn]] void two_devices(const c10::OperatorHandle& op, c10::Device a, c10::Device b) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", a, " and ", b,
              "! (in ", op.schema().operator_name(), ")");
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const OpInfo& about = info(op);
  const size_t nargs = op.schema().arguments().size();
  const size_t first = stack->size() - nargs;
  std::vector<std::pair<at::Tensor, at::Tensor>> aliases;  // (cuda original, its host alias)
  int device = -1;
  bool host_tensor = false;
  size_t shapes_begin = g_shapes.size();
  auto host_of = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined()) return t;
    if (!t.is_cuda()) {
      host_tensor |= t.dim() > 0;
      return t;
    }
    if (device < 0) device = t.get_device();
    else if (device != t.get_device()) two_devices(op, c10::Device(c10::kCUDA, device), t.device());
    if (g_mode == 1) {
      g_shapes.insert(g_shapes.end(), t.sizes().begin(), t.sizes().end());
      g_shapes.push_back(-1);
    }
    auto alias = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()),
                                                          c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
    alias.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    aliases.emplace_back(t, alias);
    return alias;
  };
  for (size_t i = first; i < stack->size(); ++i) {
    auto& arg = (*stack)[i];
    if (arg.isTensor()) {
      arg = host_of(arg.toTensor());
    } else if (arg.isTensorList()) {
      auto list = arg.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list.set(j, host_of(list.get(j)));
    } else if (arg.isList()) {  // optional tensors, as in index.Tensor
      auto list = arg.toList();
      for (size_t j = 0; j < list.size(); ++j) {
        c10::IValue v = list.get(j);
        if (v.isTensor()) list.set(j, host_of(v.toTensor()));
      }
    } else if (arg.isDevice() && arg.toDevice().is_cuda()) {  // factories with no tensor argument
      if (device < 0) device = device_of(arg.toDevice());
      arg = c10::IValue(c10::Device(c10::kCPU));
    }
  }
  if (device < 0) device = t_current_device;
  if (host_tensor && !aliases.empty() && !about.crosses_devices) {
    two_devices(op, c10::Device(c10::kCUDA, device), c10::Device(c10::kCPU));
  }
  if (g_mode == 1) {
    g_records.push_back({&op.schema().operator_name(), static_cast<int8_t>(device), 0,
                         static_cast<uint32_t>(shapes_begin), static_cast<uint32_t>(g_shapes.size())});
  } else if (g_mode == 2) {
    py::gil_scoped_acquire gil;
    py::tuple shapes(aliases.size());
    for (size_t i = 0; i < aliases.size(); ++i) shapes[i] = py::cast(aliases[i].first.sizes().vec());
    g_callback(op.schema().name(), device, shapes);
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  if (!about.written.empty()) {  // an out= tensor the CPU kernel resized: the caller's tensor follows
    for (auto& [cuda, alias] : aliases) {
      auto* a = alias.unsafeGetTensorImpl();
      if (a->sizes() != cuda.sizes() || a->strides() != cuda.strides() ||
          a->storage_offset() != cuda.storage_offset()) {
        cuda.unsafeGetTensorImpl()->set_sizes_and_strides(a->sizes(), a->strides(), a->storage_offset());
      }
    }
  }
  auto to_cuda = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || t.is_cuda()) return t;
    for (auto& [cuda, alias] : aliases) {  // in-place, out=
      if (alias.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return cuda;
    }
    return as_cuda(t, static_cast<c10::DeviceIndex>(device));
  };
  const size_t nret = op.schema().returns().size();
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
    auto& ret = (*stack)[i];
    if (ret.isTensor()) {
      ret = to_cuda(ret.toTensor());
    } else if (ret.isTensorList()) {
      auto list = ret.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list.set(j, to_cuda(list.get(j)));
    }
  }
}

TORCH_LIBRARY_IMPL(_, CUDA, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  m.impl("empty.memory_format", &empty_memory_format);
  m.impl("empty_strided", &empty_strided);
  // copy_ is CompositeExplicitAutograd, which beats a backend fallback, and its body asks a CUDA DispatchStub the
  // CPU build does not have: send it through the fallback like any CPU kernel.
  m.impl("copy_", torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", HostCudaHooks)
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("set_device_count", [](int n) { g_device_count = n; });
  module.def("set_mode", [](int mode, py::object callback) {
    g_mode = mode;
    g_callback = callback;
  });
  module.def("debug_hooks", []() { auto a = at::getAccelerator(false); return std::make_tuple(at::hasCUDA(), at::CUDAHooksRegistry()->Keys(), a ? c10::DeviceTypeName(*a) : std::string("none"), at::hasMTIA(), at::hasXPU(), at::hasMPS()); });
  module.def("current_device", []() { return t_current_device; });
  module.def("set_device", [](int d) { t_current_device = static_cast<c10::DeviceIndex>(d); });
  module.def("memory", [](int d) { return std::make_pair(g_allocated[d].load(), g_peak[d].load()); });
  module.def("records", []() {
    py::list out;
    for (auto& r : g_records) {
      py::list shapes, shape;
      for (uint32_t i = r.shapes_begin; i < r.shapes_end; ++i) {
        if (g_shapes[i] < 0) {
          shapes.append(py::tuple(shape));
          shape = py::list();
        } else {
          shape.append(g_shapes[i]);
        }
      }
      out.append(py::make_tuple(r.op->name, r.device, r.stream, shapes));
    }
    return out;
  });
  module.def("clear_records", []() {
    g_records.clear();
    g_shapes.clear();
  });
}
