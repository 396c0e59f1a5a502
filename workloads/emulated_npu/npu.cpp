// An emulated NPU for tracecmp's tests, benchmarks and demo: torch's PrivateUse1 backend (renamed
// "npu" from Python) over host memory. Tensors live in memory from this file's allocator and
// report device npu:0; every aten op without a kernel here runs on the CPU kernels through a boxed
// fallback. The emulator counts what would block the host on a real accelerator (device-to-host
// copies, .item(), ops whose output size depends on values, explicit synchronizations) and has
// numerics of its own, as an NPU has: matrix units that read fp16/bf16, a different reduction
// order, and a random stream that differs from the CPU's for the same seed.
// Modelled on torch's out-of-tree reference backend (OpenReg, torch/test/cpp_extensions).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

namespace {

constexpr c10::DeviceType kNpu = c10::DeviceType::PrivateUse1;
const c10::Device kDevice(kNpu, 0);

// What a real device would block the host for; internal copies of the CPU fallback are not counted.
std::atomic<int64_t> d2h_copies{0}, h2d_copies{0}, syncs{0}, fallback_ops{0};
thread_local int inside_fallback = 0;

struct FallbackScope {
  FallbackScope() { ++inside_fallback; }
  ~FallbackScope() { --inside_fallback; }
};

// Numerics, set from Python: the dtype the matrix units read (Undefined: fp32 as given; Float:
// TF32, fp32 with a 10-bit mantissa, as an Ascend NPU's HF32), and whether sums run reversed.
// Atomic: the autograd engine runs backward ops on a thread of its own.
std::atomic<c10::ScalarType> matrix_dtype{c10::ScalarType::Undefined};
std::atomic<bool> reversed_reductions{false};

// The device's random stream: a CPU Mersenne twister of its own, seeded apart from the CPU's.
std::mutex rng_mutex;
at::Generator device_generator = at::make_generator<at::CPUGeneratorImpl>(0);
constexpr uint64_t kDeviceSeedSalt = 0x9E3779B97F4A7C15ULL;

// --- memory -------------------------------------------------------------------------------------
void release(void* ptr) { std::free(ptr); }

struct NpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    // 64-byte aligned like the CPU allocator, so the CPU kernels see the alignment they expect.
    void* ptr = nbytes ? std::aligned_alloc(64, (nbytes + 63) / 64 * 64) : nullptr;
    TORCH_CHECK(ptr || !nbytes, "emulated npu: out of memory allocating ", nbytes, " bytes");
    return {ptr, ptr, &release, kDevice};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

NpuAllocator allocator;
REGISTER_ALLOCATOR(kNpu, &allocator);

// A CPU tensor over the same memory (no copy): how the CPU kernels read and write npu tensors.
// It holds ``t`` until it dies itself, so an alias of a temporary stays valid.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.is_cpu()) return t;
  auto base = static_cast<char*>(t.storage().mutable_data()) + t.storage_offset() * t.element_size();
  return at::from_blob(base, t.sizes(), t.strides(), [keep = t](void*) {}, t.options().device(at::kCPU));
}

// --- the kernels a backend must own ------------------------------------------------------------
at::Tensor npu_empty(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype, std::optional<c10::Layout>,
                     std::optional<c10::Device>, std::optional<bool>, std::optional<c10::MemoryFormat> format) {
  return at::detail::empty_generic(size, &allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), format);
}

at::Tensor npu_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                             std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, &allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor npu_copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  if (!inside_fallback) {
    if (!self.is_cpu() && dst.is_cpu()) ++d2h_copies;
    if (self.is_cpu() && !dst.is_cpu()) ++h2d_copies;
  }
  FallbackScope scope;
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor npu_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return npu_copy_from(self, dst, false);
}

const at::Tensor& npu_resize(const at::Tensor& self, c10::IntArrayRef size, std::optional<c10::MemoryFormat> format) {
  // The CPU implementation grows storage through the storage's own allocator: this file's.
  return at::native::resize_(self, size, format);
}

at::Scalar npu_local_scalar_dense(const at::Tensor& self) {
  if (!inside_fallback) ++syncs;
  return at::_local_scalar_dense(host_alias(self));
}

at::Tensor& npu_set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                            c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset, size, stride);
}

at::Tensor& npu_set_source(at::Tensor& self, c10::Storage source) {
  const auto size = static_cast<int64_t>(source.nbytes() / self.element_size());
  return at::native::set_storage_cpu_(self, source, 0, {size}, {});
}

// --- the fallback: every other op on the CPU kernels, with the device's numerics ---------------
const std::set<std::string>& data_dependent_ops() {
  // Their output's size depends on values: a real device hands the size to the host.
  static const std::set<std::string> ops{"aten::nonzero", "aten::masked_select", "aten::unique_dim",
                                         "aten::_unique2", "aten::unique_consecutive", "aten::nonzero_static",
                                         "aten::is_nonzero", "aten::equal", "aten::allclose"};
  return ops;
}

// Which arguments of a matmul-like op the matrix units read (the bias and accumulator stay fp32).
const std::set<std::string>* matrix_operands(const std::string& name) {
  static const std::set<std::string> mm{"self", "mat2"}, addmm{"mat1", "mat2"}, bmm{"batch1", "batch2"},
      mv{"self", "vec", "mat"};
  if (name == "aten::mm" || name == "aten::bmm") return &mm;
  if (name == "aten::addmm" || name == "aten::_addmm_activation") return &addmm;
  if (name == "aten::baddbmm" || name == "aten::addbmm") return &bmm;
  if (name == "aten::mv" || name == "aten::addmv") return &mv;
  return nullptr;
}

bool is_sum_like(const std::string& name) {
  return name == "aten::sum" || name == "aten::mean" || name == "aten::nansum";
}

// An fp32 operand as the matrix units read it: in their dtype, or TF32 (the low 13 mantissa bits
// rounded off, to nearest even) when that dtype is Float.
at::Tensor round_for_matrix_units(const at::Tensor& t) {
  const c10::ScalarType units = matrix_dtype.load();
  if (units != at::kFloat) return t.to(units).to(at::kFloat);
  const auto bits = t.contiguous().view(at::kInt);
  const auto rounded = (bits + 0xFFF + bits.bitwise_right_shift(13).bitwise_and(1)).bitwise_and(~0x1FFF);
  return at::where(t.isfinite(), rounded.view(at::kFloat), t);
}

// The dimensions a sum-like call reduces: its "dim" argument, or all of them when it has none.
std::vector<int64_t> reduced_dims(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first,
                                  int64_t rank) {
  const auto index = schema.argumentIndexWithName("dim");
  std::vector<int64_t> dims;
  if (index && stack[first + *index].isIntList()) {
    for (auto d : stack[first + *index].toIntVector()) dims.push_back(c10::maybe_wrap_dim(d, rank));
  }
  if (dims.empty()) {
    for (int64_t d = 0; d < rank; ++d) dims.push_back(d);
  }
  return dims;
}

// Rewrites the op's arguments on the stack for the device's numerics, before the CPU runs it.
// Functional ops without a kernel here reach the fallback as their out= variants: same names.
void apply_numerics(const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  const auto& args = schema.arguments();
  const auto first = stack->size() - args.size();
  const auto* operands = matrix_dtype != c10::ScalarType::Undefined ? matrix_operands(schema.name()) : nullptr;
  const bool reverse = reversed_reductions && is_sum_like(schema.name());
  for (size_t i = 0; i < args.size(); ++i) {
    auto& value = (*stack)[first + i];
    if (!value.isTensor() || (args[i].alias_info() && args[i].alias_info()->isWrite())) continue;
    const auto t = value.toTensor();
    if (!t.defined() || !t.is_floating_point()) continue;
    if (operands && operands->count(args[i].name()) && t.scalar_type() == at::kFloat) {
      value = round_for_matrix_units(t);  // rounded as the unit reads it, accumulated in fp32
    } else if (reverse && args[i].name() == "self" && t.dim() > 0) {
      // The same values summed in the opposite order along the reduced dimensions: other rounding.
      value = t.flip(reduced_dims(schema, *stack, first, t.dim()));
    }
  }
}

// Runs a random op with the device's generator in place of the CPU's default one. The CPU
// generator's lock is held only to swap states: its kernels take that lock themselves.
at::Tensor swap_cpu_state(const at::Tensor& state) {
  auto cpu_default = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(cpu_default.mutex());
  auto previous = cpu_default.get_state();
  cpu_default.set_state(state);
  return previous;
}

void with_device_rng(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  std::lock_guard<std::mutex> lock(rng_mutex);
  const auto host_state = swap_cpu_state(device_generator.get_state());
  try {
    at::native::cpu_fallback(op, stack, true);
  } catch (...) {
    swap_cpu_state(host_state);
    throw;
  }
  device_generator.set_state(swap_cpu_state(host_state));
}

void npu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  if (!inside_fallback) {
    ++fallback_ops;
    if (data_dependent_ops().count(schema.name())) ++syncs;
  }
  FallbackScope scope;
  apply_numerics(schema, stack);
  if (op.hasTag(at::Tag::nondeterministic_seeded)) {
    with_device_rng(op, stack);
  } else {
    at::native::cpu_fallback(op, stack, true);
  }
}

// --- convolution: torch hands every device but the CPU's and CUDA's to these two ops ----------
// The operands as the CPU kernel reads them: through the matrix units' rounding, then aliased.
at::Tensor matrix_operand(const at::Tensor& t) {
  const bool rounds = matrix_dtype != c10::ScalarType::Undefined && t.scalar_type() == at::kFloat;
  return host_alias(rounds ? round_for_matrix_units(t) : t);
}

at::Tensor on_npu(const at::Tensor& t) { return t.defined() ? t.to(kDevice) : t; }

at::Tensor npu_convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                           bool transposed, c10::IntArrayRef output_padding, int64_t groups) {
  if (!inside_fallback) ++fallback_ops;
  FallbackScope scope;
  const auto host_bias = bias && bias->defined() ? std::optional<at::Tensor>(host_alias(*bias)) : std::nullopt;
  return on_npu(at::convolution(matrix_operand(input), matrix_operand(weight), host_bias, stride, padding, dilation,
                                transposed, output_padding, groups));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> npu_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask) {
  if (!inside_fallback) ++fallback_ops;
  FallbackScope scope;
  const std::vector<int64_t> bias_sizes{grad_output.size(1)};
  auto [grad_input, grad_weight, grad_bias] = at::convolution_backward(
      matrix_operand(grad_output), matrix_operand(input), matrix_operand(weight),
      output_mask[2] ? c10::OptionalIntArrayRef(bias_sizes) : std::nullopt, stride, padding, dilation, transposed,
      output_padding, groups, output_mask);
  return {on_npu(grad_input), on_npu(grad_weight), on_npu(grad_bias)};
}

// --- device guard and hooks: one device, one in-order queue -------------------------------------
struct NpuGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNpu; }
  c10::Device exchangeDevice(c10::Device) const override { return kDevice; }
  c10::Device getDevice() const override { return kDevice; }
  void setDevice(c10::Device d) const override { TORCH_CHECK(d.index() <= 0, "emulated npu: only npu:0 exists"); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override { return c10::Stream(c10::Stream::DEFAULT, kDevice); }
  c10::Stream exchangeStream(c10::Stream) const override { return c10::Stream(c10::Stream::DEFAULT, kDevice); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  // Events and streams: every op completes before it returns, so there is nothing to wait for.
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void synchronizeStream(const c10::Stream&) const override { ++syncs; }
  void synchronizeDevice(const c10::DeviceIndex) const override { ++syncs; }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NpuGuard);

struct NpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::Device getDeviceFromPtr(void*) const override { return kDevice; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override { return device_generator; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), nbytes);
  }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new NpuHooks());
  return true;
}();

// --- collectives: gloo's, on host copies (gloo takes CPU and CUDA tensors only) ---------------
// A collective that completed before it was returned: its gloo work was waited for.
class CompletedWork final : public c10d::Work {
 public:
  explicit CompletedWork(std::vector<at::Tensor> tensors)
      : tensors_(std::move(tensors)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors())) {
    future_->markCompleted(c10::IValue(tensors_));
    finish();
  }
  std::vector<at::Tensor> result() override { return tensors_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> tensors_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

std::vector<at::Tensor> to_host(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> host;
  for (const auto& t : tensors) host.push_back(t.cpu());
  return host;
}

void copy_back(std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& host) {
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(host[i]);
}

// The npu's backend in a process group: each collective copies to the host, runs gloo's, waits,
// and copies back (counted by the emulator as any copy is: a real device's would not copy).
class NpuOverGloo final : public c10d::Backend {
 public:
  explicit NpuOverGloo(c10::intrusive_ptr<c10d::Backend> gloo)
      : Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)) {}
  const std::string getBackendName() const override { return "npu-over-gloo"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    auto host = to_host(tensors);
    gloo_->allreduce(host, opts)->wait();
    copy_back(tensors, host);
    return c10::make_intrusive<CompletedWork>(tensors);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto host = to_host(tensors);
    gloo_->broadcast(host, opts)->wait();
    copy_back(tensors, host);
    return c10::make_intrusive<CompletedWork>(tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    std::vector<std::vector<at::Tensor>> host_outputs;
    for (const auto& group : outputs) host_outputs.push_back(to_host(group));
    auto host_inputs = to_host(inputs);
    gloo_->allgather(host_outputs, host_inputs, opts)->wait();
    std::vector<at::Tensor> flat;
    for (size_t i = 0; i < outputs.size(); ++i) {
      copy_back(outputs[i], host_outputs[i]);
      flat.insert(flat.end(), outputs[i].begin(), outputs[i].end());
    }
    return c10::make_intrusive<CompletedWork>(flat);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override { return gloo_->barrier(opts); }

 private:
  c10::intrusive_ptr<c10d::Backend> gloo_;
};

// Gives the process group (made with gloo for the CPU) a backend for the npu.
void serve_collectives(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  auto backend = c10::make_intrusive<NpuOverGloo>(group->getBackend(c10::DeviceType::CPU));
  group->setBackend(kNpu, c10d::ProcessGroup::BackendType::CUSTOM, backend);
}

// --- what Python calls (torch.ops.emulated_npu.*) -----------------------------------------------
std::vector<int64_t> counters() { return {d2h_copies, h2d_copies, syncs, fallback_ops}; }

void reset_counters() { d2h_copies = h2d_copies = syncs = fallback_ops = 0; }

void synchronize() { ++syncs; }

void manual_seed(int64_t seed) {
  std::lock_guard<std::mutex> lock(rng_mutex);
  std::lock_guard<std::mutex> gen_lock(device_generator.mutex());
  device_generator.set_current_seed(static_cast<uint64_t>(seed) ^ kDeviceSeedSalt);
}

void set_numerics(c10::string_view matrix_units, bool reversed_sums) {
  const std::string units(matrix_units);
  TORCH_CHECK(units == "fp32" || units == "tf32" || units == "fp16" || units == "bf16",
              "emulated npu: matrix units are fp32, tf32, fp16 or bf16, not ", units);
  matrix_dtype = units == "fp16"   ? c10::ScalarType::Half
                 : units == "bf16" ? c10::ScalarType::BFloat16
                 : units == "tf32" ? c10::ScalarType::Float
                                   : c10::ScalarType::Undefined;
  reversed_reductions = reversed_sums;
}

}  // namespace

TORCH_LIBRARY(emulated_npu, m) {
  m.def("counters() -> int[]", &counters);
  m.def("reset_counters() -> ()", &reset_counters);
  m.def("synchronize() -> ()", &synchronize);
  m.def("manual_seed(int seed) -> ()", &manual_seed);
  m.def("set_numerics(str matrix_units, bool reversed_sums) -> ()", &set_numerics);
  m.def("serve_collectives(__torch__.torch.classes.c10d.ProcessGroup group) -> ()", &serve_collectives);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", npu_empty);
  m.impl("empty_strided", npu_empty_strided);
  m.impl("_copy_from", npu_copy_from);
  m.impl("_copy_from_and_resize", npu_copy_from_and_resize);
  m.impl("resize_", npu_resize);
  m.impl("_local_scalar_dense", npu_local_scalar_dense);
  m.impl("set_.source_Storage_storage_offset", npu_set_storage);
  m.impl("set_.source_Storage", npu_set_source);
  // Views share the storage: the CPU's metadata-only implementations serve any device.
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("convolution_overrideable", npu_convolution);
  m.impl("convolution_backward_overrideable", npu_convolution_backward);
  // Ops with a CPU kernel and a generic decomposition, which the npu would otherwise run (rounding
  // apart from the CPU): the fallback sends them to the CPU kernel like every other op.
  for (const char* name : {"native_layer_norm", "native_group_norm", "addr", "addr.out", "_stack", "_stack.out",
                           "any.dims", "any.dims_out", "all.dims", "all.dims_out"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&npu_fallback>()); }
