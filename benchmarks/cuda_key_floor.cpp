// A spike, not the emulator: CUDA-keyed tensors over host memory in a CPU-only PyTorch build, to measure the per-op
// cost of emulating GPUs below Python dispatch (benchmarks/cuda_key_floor.py loads it and prints the ratios).
// - an allocator (host memory labelled cuda:i, counted per device in mode 1) and the two factory kernels;
// - a DeviceGuardImpl for CUDA (current device per thread, one default stream), which the Python bindings and the
//   autograd engine use, and CUDA hooks (at::hasCUDA, the "current accelerator" the engine asks for a cuda gradient);
// - a boxed fallback for the CUDA key: every CUDA tensor argument becomes a CPU tensor over the same memory,
//   the op is redispatched to the CPU kernel, and outputs become CUDA tensors again (views share the storage,
//   in-place and out= give back the caller's tensor, fresh results have their storage relabelled cuda:i). It is
//   also registered as the CUDA kernel of every op the CPU runs directly, so the numbers are the CPU's exactly;
// - scaled_dot_product_attention choosing and running the CPU's flash kernel, as it does for CPU tensors.
// Mode 0 does only that; mode 1 also keeps per-device allocated/peak bytes and appends (op, device, stream, input
// shapes) to a C++ vector; mode 2 instead calls a Python function per op, as a ledger kept in Python would.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/set_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
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

struct Owner {  // context of every cuda:i DataPtr: the host memory it labels, and what it counted
  c10::DataPtr host;
  int64_t bytes;
  int device;
  bool counted;
};

void release(void* context) {
  auto* owner = static_cast<Owner*>(context);
  if (owner->counted) count(owner->device, -owner->bytes);
  delete owner;  // frees `host`
}

// Host memory labelled cuda:i: a CUDA tensor's storage says cuda:i, as torch.save and untyped_storage() read it.
c10::DataPtr on_device(c10::DataPtr host, int64_t bytes, int device) {
  void* data = host.get();
  bool counting = g_mode == 1;
  if (counting) count(device, bytes);
  return c10::DataPtr(data, new Owner{std::move(host), bytes, device, counting}, &release,
                      c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
}

struct HostAsCudaAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    return on_device(c10::GetCPUAllocator()->allocate(n), static_cast<int64_t>(n), t_current_device);
  }
  void copy_data(void* dest, const void* src, std::size_t n) const override { std::memcpy(dest, src, n); }
};
HostAsCudaAllocator g_allocator;
REGISTER_ALLOCATOR(c10::kCUDA, &g_allocator)  // storages made from Python: torch.UntypedStorage(n, device="cuda")

c10::DeviceIndex device_of(std::optional<c10::Device> device) {
  return device && device->has_index() ? device->index() : t_current_device;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>,
                               std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceIndex saved = t_current_device, index = device_of(device);
  t_current_device = index;
  at::Tensor out = at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                             dtype.value_or(at::get_default_dtype_as_scalartype()), memory_format);
  t_current_device = saved;
  return out;
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  c10::DeviceIndex saved = t_current_device, index = device_of(device);
  t_current_device = index;
  at::Tensor out = at::detail::empty_strided_generic(size, stride, &g_allocator,
                                                     c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                     dtype.value_or(at::get_default_dtype_as_scalartype()));
  t_current_device = saved;
  return out;
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
// Mode 2's Python function. Never destroyed: a static py::object would be released after the interpreter is gone.
auto& g_callback = *new py::object();

// What the fallback needs to know about an op, looked up once per operator.
struct OpInfo {
  bool crosses_devices;  // copies and indexing take tensors on two devices, as CUDA PyTorch allows
  std::vector<size_t> written;  // argument positions the op may resize (out=, in-place)
};
std::unordered_map<const c10::FunctionSchema*, OpInfo> g_ops;
std::mutex g_lock;  // ops run from several threads (autograd's device threads, rank threads): guards g_ops and records

const OpInfo& info(const c10::OperatorHandle& op) {
  std::lock_guard<std::mutex> hold(g_lock);
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

// A CPU tensor over a CUDA tensor's memory, with its own StorageImpl: CPU kernels make views of their arguments from
// the storage (whose device they take), and may resize it (out=), which the CUDA tensor then takes over.
at::Tensor host_alias(const at::Tensor& cuda) {
  const c10::Storage& storage = cuda.storage();
  auto impl = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), storage.nbytes(),
      c10::DataPtr(const_cast<void*>(storage.data()), c10::Device(c10::kCPU)), c10::GetCPUAllocator(), true);
  auto alias = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(impl)),
                                                        c10::DispatchKeySet(c10::DispatchKey::CPU), cuda.dtype());
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(cuda.sizes(), cuda.strides(), cuda.storage_offset());
  return alias;
}

at::Tensor cuda_over(const c10::Storage& storage, const at::Tensor& like) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                      like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  return out;
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const OpInfo& about = info(op);
  const size_t nargs = op.schema().arguments().size();
  const size_t first = stack->size() - nargs;
  c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 4> aliases;  // (cuda original, its host alias)
  int device = -1;
  bool host_tensor = false;
  c10::SmallVector<int64_t, 16> shapes;  // mode 1: each CUDA input's dims, then -1
  auto host_of = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined()) return t;
    if (!t.is_cuda()) {
      host_tensor |= t.dim() > 0;
      return t;
    }
    if (device < 0) device = t.get_device();
    else if (device != t.get_device() && !about.crosses_devices) {
      two_devices(op, c10::Device(c10::kCUDA, device), t.device());
    }
    if (g_mode == 1) {
      shapes.append(t.sizes().begin(), t.sizes().end());
      shapes.push_back(-1);
    }
    aliases.emplace_back(t, host_alias(t));
    return aliases.back().second;
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
    std::lock_guard<std::mutex> hold(g_lock);
    auto begin = static_cast<uint32_t>(g_shapes.size());
    g_shapes.insert(g_shapes.end(), shapes.begin(), shapes.end());
    g_records.push_back({&op.schema().operator_name(), static_cast<int8_t>(device), 0, begin,
                         static_cast<uint32_t>(g_shapes.size())});
  } else if (g_mode == 2) {
    py::gil_scoped_acquire gil;
    py::tuple inputs(aliases.size());
    for (size_t i = 0; i < aliases.size(); ++i) inputs[i] = py::cast(aliases[i].first.sizes().vec());
    g_callback(op.schema().name(), device, inputs);
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  if (!about.written.empty()) {  // out= and in-place: the caller's tensor follows what the CPU kernel did
    for (auto& [cuda, alias] : aliases) {
      auto* host = alias.storage().unsafeGetStorageImpl();
      auto* mine = cuda.storage().unsafeGetStorageImpl();
      if (host->data_ptr().get() != mine->data_ptr().get()) {  // resized into new memory
        int64_t bytes = static_cast<int64_t>(host->nbytes());
        mine->set_data_ptr_noswap(on_device(host->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU))),
                                            bytes, device));
        mine->set_nbytes(bytes);
      }
      auto* a = alias.unsafeGetTensorImpl();
      if (a->sizes() != cuda.sizes() || a->strides() != cuda.strides() ||
          a->storage_offset() != cuda.storage_offset()) {
        cuda.unsafeGetTensorImpl()->set_sizes_and_strides(a->sizes(), a->strides(), a->storage_offset());
      }
    }
  }
  auto to_cuda = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || t.is_cuda()) return t;
    for (auto& [cuda, alias] : aliases) {
      if (alias.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return cuda;  // in-place, out=
      if (alias.storage().is_alias_of(t.storage())) return cuda_over(cuda.storage(), t);  // a view
    }
    auto* storage = t.storage().unsafeGetStorageImpl();
    if (storage->device_type() != c10::kCUDA) {  // a fresh result: its storage becomes cuda:i memory
      int64_t bytes = static_cast<int64_t>(storage->nbytes());
      storage->set_data_ptr_noswap(on_device(storage->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU))),
                                             bytes, device));
      storage->set_allocator(&g_allocator);
    }
    return cuda_over(t.storage(), t);
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

// ---- attention: CUDA's scaled_dot_product_attention asks a DispatchStub which fused kernel to run, and the CPU build
// has none for CUDA, so it would decompose (the math path) where the CPU runs its flash kernel. The choice is made by
// the CPU's rule, and CUDA's flash op runs the CPU's flash kernel. CUDA's flash path takes no mask, so with a mask
// the math path runs (as on a GPU whose flash kernel cannot take it).
int64_t sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                   double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  constexpr int64_t kMath = 0, kFlash = 1;
  if (mask.has_value() && mask->defined()) return kMath;
  return at::_fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) == kFlash ? kFlash : kMath;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor, at::Tensor, at::Tensor>
flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p, bool is_causal, bool,
              std::optional<double> scale) {
  auto [out, logsumexp] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, std::nullopt,
                                                                          scale);
  auto none = at::empty({0}, q.options());
  return {out, logsumexp, at::Tensor(), at::Tensor(), c10::SymInt(q.size(2)), c10::SymInt(k.size(2)), none, none, none};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& logsumexp, const at::Tensor&, const at::Tensor&, c10::SymInt, c10::SymInt, double dropout_p,
    bool is_causal, const at::Tensor&, const at::Tensor&, std::optional<double> scale) {
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, logsumexp, dropout_p, is_causal,
                                                                  std::nullopt, scale);
}

struct ChooseLikeCpu {
  ChooseLikeCpu() { at::native::_fused_sdp_choice_stub.set_cuda_dispatch_ptr(&sdp_choice); }
} choose_like_cpu;

TORCH_LIBRARY_IMPL(_, CUDA, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  m.impl("empty.memory_format", &empty_memory_format);
  m.impl("empty_strided", &empty_strided);
  // copy_ is CompositeExplicitAutograd, which beats a backend fallback, and its body asks a CUDA DispatchStub the
  // CPU build does not have: send it through the fallback like any CPU kernel.
  m.impl("copy_", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  // torch.load rebuilds a tensor by set_() onto a cuda storage: the CPU kernel does it, without aliasing either.
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(at::native::set_storage_cpu_));
  m.impl("set_.source_Storage", TORCH_FN(at::native::set_));
  m.impl("_scaled_dot_product_flash_attention", &flash_forward);
  m.impl("_scaled_dot_product_flash_attention_backward", &flash_backward);
}

// A kernel for the CUDA key beats a CompositeExplicitAutograd one, and that one beats a backend fallback. Composite
// kernels branch on the device (_convolution picks its algorithm, native_layer_norm decomposes where the CPU has a
// kernel), so left to them a CUDA tensor would give other numbers than a CPU one. Every op with a CPU kernel or an
// explicit composite gets the fallback as its CUDA kernel, so a CUDA tensor runs exactly what a CPU tensor runs;
// except ops that take a device (factories, to()), whose composite must see cuda, and the copies.
bool takes_device(const c10::FunctionSchema& schema) {
  for (const auto& argument : schema.arguments()) {
    auto type = argument.type();
    if (auto optional = type->castRaw<c10::OptionalType>()) type = optional->getElementType();
    if (type->kind() == c10::TypeKind::DeviceObjType || type->kind() == c10::TypeKind::StorageType) return true;
  }
  return false;
}

int64_t take_cpu_kernels() {
  // Never destroyed: at exit the dispatcher may be gone before a static Library would deregister from it.
  static auto& libraries = *new std::vector<std::unique_ptr<torch::Library>>();
  static const std::vector<std::string> copies = {"aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize",
                                                  "aten::lift_fresh", "aten::lift", "aten::lift_fresh_copy"};
  auto& dispatcher = c10::Dispatcher::singleton();
  std::unordered_map<std::string, torch::Library*> by_namespace;
  int64_t taken = 0;
  for (const auto& name : dispatcher.getAllOpNames()) {
    auto op = dispatcher.findOp(name);
    if (!op || !name.getNamespace() || op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) continue;
    bool cpu = op->hasKernelForDispatchKey(c10::DispatchKey::CPU);
    bool composite = op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
                     op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
    if (!(cpu || (composite && !takes_device(op->schema()))) ||
        std::find(copies.begin(), copies.end(), name.name) != copies.end()) {
      continue;
    }
    auto space = std::string(*name.getNamespace());
    auto& library = by_namespace[space];
    if (!library) {
      libraries.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, space, c10::DispatchKey::CUDA,
                                                           __FILE__, __LINE__));
      library = libraries.back().get();
    }
    auto bare = name.name.substr(space.size() + 2);
    auto full = name.overload_name.empty() ? bare : bare + "." + name.overload_name;
    library->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
    ++taken;
  }
  return taken;
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
  module.def("take_cpu_kernels", &take_cpu_kernels);
  module.def("accelerator", []() {  // which accelerator torch decided it has: CUDA once the hooks came first
    auto found = at::getAccelerator(false);
    return found ? c10::DeviceTypeName(*found) : std::string("none");
  });
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
