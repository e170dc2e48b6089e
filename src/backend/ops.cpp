// Tensor ops: device and element-type checks, then the CPU or the CUDA op.
#include "mpipe/backend/ops.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/backend/dispatch.hpp"
#include "mpipe/backend/op_profile.hpp"
#include "mpipe/core/bf16.hpp"
#if MPIPE_HAVE_CUDA
#include "mpipe/backend/cuda/ops.hpp"
#endif

namespace mpipe::ops {

using namespace detail;

DeviceMemory device_memory(Device device) {
  DeviceMemory memory;
  memory.device = device;
  if (device == Device::cuda) {
    memory.allocate = &cuda::allocate;
    memory.release = &cuda::release;
    memory.zero = [](void* p, std::size_t bytes) { cuda::zero(p, bytes); };
  }
  return memory;
}

void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) {
  const OpTimer timer(OpKind::gemm, __func__);
  same_place("matmul", out, inp);
  same_place("matmul", inp, weight);
  same_place("matmul", weight, bias);
  const int64_t N = inp.shape.rows(), C = inp.shape[-1], OC = weight.shape[0];
  if (inp.device == Device::cpu)
    cpu::matmul_forward(out.f32(), inp.f32(), weight.f32(), ptr_or_null<float>(bias), N, C, OC);
  else
    MPIPE_ON_GPU(inp, cuda::matmul_forward(ptr<E>(out), ptr<E>(inp), ptr<E>(weight), ptr_or_null<E>(bias), N, C, OC));
}

void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                     const Tensor& inp, const Tensor& weight, GradMode mode) {
  const OpTimer timer(OpKind::gemm, __func__);
  same_place("matmul backward", dout, inp);
  same_place("matmul backward", inp, weight);
  same_place("matmul backward", dinp, inp);
  same_device("matmul backward", dweight, inp);
  is_f32("matmul backward", dweight);
  is_f32("matmul backward", dbias);
  const int64_t N = inp.shape.rows(), C = inp.shape[-1], OC = weight.shape[0];
  if (inp.device == Device::cpu)
    cpu::matmul_backward(ptr_or_null<float>(dinp), ptr_or_null<float>(dweight), ptr_or_null<float>(dbias), dout.f32(), inp.f32(),
                         weight.f32(), N, C, OC, mode);
  else
    MPIPE_ON_GPU(inp, cuda::matmul_backward(ptr_or_null<E>(dinp), ptr_or_null<float>(dweight), ptr_or_null<float>(dbias),
                                            ptr<E>(dout), ptr<E>(inp), ptr<E>(weight), N, C, OC, mode));
}

void matmul_gelu_forward(const Tensor& out, const Tensor& pre, const Tensor& inp, const Tensor& weight,
                         const Tensor& bias) {
  const OpTimer timer(OpKind::gemm, __func__);
  same_place("matmul+gelu", out, pre);
  same_place("matmul+gelu", pre, inp);
  same_place("matmul+gelu", inp, weight);
  same_place("matmul+gelu", weight, bias);
  const int64_t N = inp.shape.rows(), C = inp.shape[-1], OC = weight.shape[0];
  if (inp.device == Device::cpu) {
    cpu::matmul_forward(pre.f32(), inp.f32(), weight.f32(), ptr_or_null<float>(bias), N, C, OC);
    cpu::gelu_forward(out.f32(), pre.f32(), pre.numel());
  } else {
    MPIPE_ON_GPU(inp, cuda::matmul_gelu_forward(ptr<E>(out), ptr<E>(pre), ptr<E>(inp), ptr<E>(weight),
                                                ptr_or_null<E>(bias), N, C, OC));
  }
}

void relu_forward(const Tensor& out, const Tensor& inp) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("relu", out, inp);
  if (inp.device == Device::cpu) cpu::relu_forward(out.f32(), inp.f32(), inp.numel());
  else MPIPE_ON_GPU(inp, cuda::relu_forward(ptr<E>(out), ptr<E>(inp), inp.numel()));
}

void relu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& out, GradMode mode) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("relu backward", dinp, dout);
  same_place("relu backward", dout, out);
  if (out.device == Device::cpu) cpu::relu_backward(dinp.f32(), dout.f32(), out.f32(), out.numel(), mode);
  else MPIPE_ON_GPU(out, cuda::relu_backward(ptr<E>(dinp), ptr<E>(dout), ptr<E>(out), out.numel(), mode));
}

void gelu_forward(const Tensor& out, const Tensor& inp) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("gelu", out, inp);
  if (inp.device == Device::cpu) cpu::gelu_forward(out.f32(), inp.f32(), inp.numel());
  else MPIPE_ON_GPU(inp, cuda::gelu_forward(ptr<E>(out), ptr<E>(inp), inp.numel()));
}

void gelu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp, GradMode mode) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("gelu backward", dinp, dout);
  same_place("gelu backward", dout, inp);
  if (inp.device == Device::cpu) cpu::gelu_backward(dinp.f32(), dout.f32(), inp.f32(), inp.numel(), mode);
  else MPIPE_ON_GPU(inp, cuda::gelu_backward(ptr<E>(dinp), ptr<E>(dout), ptr<E>(inp), inp.numel(), mode));
}

int64_t kv_heads_of(int64_t width, int64_t C, int64_t heads) {
  MPIPE_CHECK(heads > 0 && C % heads == 0 && width > C && (width - C) % 2 == 0 && ((width - C) / 2) % (C / heads) == 0,
              "attention: qkv width ", width, " for ", C, " channels in ", heads, " heads");
  const int64_t kv_heads = (width - C) / 2 / (C / heads);
  MPIPE_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "attention: ", kv_heads, " key/value heads for ", heads, " heads");
  return kv_heads;
}

void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor& wpe, float p,
                       const DropoutKey& key) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("embedding", out, wte);
  same_place("embedding", wte, wpe);
  same_device("embedding", tokens, wte);
  const int64_t B = tokens.shape[0], T = tokens.shape[1], C = wte.shape[1], V = wte.shape[0];
  if (wte.device == Device::cpu) {
    cpu::embedding_forward(out.f32(), tokens.i32(), wte.f32(), ptr_or_null<float>(wpe), B, T, C, V);
    if (p > 0.0f) cpu::dropout_apply(out.f32(), out.f32(), B, T * C, p, key);  // rows in cache: two passes
  } else {
    MPIPE_ON_GPU(wte, cuda::embedding_forward(ptr<E>(out), tokens.i32(), ptr<E>(wte), ptr_or_null<E>(wpe), B, T, C, V, p,
                                              key));
  }
}

void embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& tokens) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_device("embedding backward", dwte, dout);
  same_device("embedding backward", tokens, dout);
  is_f32("embedding backward", dwte);
  is_f32("embedding backward", dwpe);
  const int64_t B = tokens.shape[0], T = tokens.shape[1], C = dwte.shape[1];
  [[maybe_unused]] const int64_t V = dwte.shape[0];  // the GPU op sizes its sort by it
  if (dout.device == Device::cpu)
    cpu::embedding_backward(dwte.f32(), ptr_or_null<float>(dwpe), dout.f32(), tokens.i32(), B, T, C);
  else
    MPIPE_ON_GPU(dout, cuda::embedding_backward(dwte.f32(), ptr_or_null<float>(dwpe), ptr<E>(dout), tokens.i32(), B, T, C,
                                                V));
}

Shape attention_state_shape(int64_t B, int64_t H, int64_t T) { return Shape{B, H, T}; }

void attention_forward(const Tensor& out, const Tensor& state, const Tensor& qkv, int64_t heads) {
  const OpTimer timer(OpKind::attention, __func__);
  same_place("attention", out, qkv);
  same_device("attention", state, qkv);
  is_f32("attention", state);
  const int64_t B = out.shape[0], T = out.shape[1], C = out.shape[2], KVH = kv_heads_of(qkv.shape[-1], C, heads);
  MPIPE_CHECK(state.shape == attention_state_shape(B, heads, T), "attention state ", state.shape.str());
  if (qkv.device == Device::cpu)
    cpu::attention_forward(out.f32(), state.f32(), qkv.f32(), B, T, C, heads, KVH);
  else
    MPIPE_ON_GPU(qkv, cuda::attention_forward(ptr<E>(out), state.f32(), ptr<E>(qkv), B, T, C, heads, KVH));
}

void attention_decode(const Tensor& out, const Tensor& qkv, const Tensor& cache, int64_t position, int64_t heads) {
  const OpTimer timer(OpKind::attention, __func__);
  same_place("attention decode", out, cache);
  same_place("attention decode", qkv, cache);
  const int64_t B = out.shape[0], t = out.shape[1], C = out.shape[2], capacity = cache.shape[1];
  const int64_t KVH = kv_heads_of(qkv.shape[-1], C, heads), KV = KVH * (C / heads);
  MPIPE_CHECK(cache.shape.rank == 3 && cache.shape[0] == B && cache.shape[2] == 2 * KV && qkv.shape[0] == B &&
                  qkv.shape[1] == t && position >= 0 && position + t <= capacity,
              "attention decode: out ", out.shape.str(), ", qkv ", qkv.shape.str(), ", cache ", cache.shape.str(),
              ", position ", position);
  if (cache.device == Device::cpu)
    cpu::attention_decode(out.f32(), qkv.f32(), cache.f32(), B, t, position, capacity, C, heads, KVH);
  else
    MPIPE_ON_GPU(cache, cuda::attention_decode(ptr<E>(out), ptr<E>(qkv), ptr<E>(cache), B, t, position, capacity, C,
                                               heads, KVH));
}

void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& state) {
  const OpTimer timer(OpKind::attention, __func__);
  same_place("attention backward", dqkv, qkv);
  same_place("attention backward", dout, qkv);
  same_place("attention backward", out, qkv);
  same_device("attention backward", state, qkv);
  const int64_t B = dout.shape[0], T = dout.shape[1], C = dout.shape[2], heads = state.shape[1];
  const int64_t KVH = kv_heads_of(qkv.shape[-1], C, heads);
  MPIPE_CHECK(state.shape == attention_state_shape(B, heads, T) && dqkv.shape == qkv.shape, "attention state ",
              state.shape.str(), ", dqkv ", dqkv.shape.str(), ", qkv ", qkv.shape.str());
  if (qkv.device == Device::cpu)
    cpu::attention_backward(dqkv.f32(), dout.f32(), qkv.f32(), out.f32(), state.f32(), B, T, C, heads, KVH);
  else
    MPIPE_ON_GPU(qkv, cuda::attention_backward(ptr<E>(dqkv), ptr<E>(dout), ptr<E>(qkv), ptr<E>(out), state.f32(), B,
                                               T, C, heads, KVH));
}

ClassRows class_rows(const Shape& logits) {
  if (logits.rank == 4) return {logits[0], logits[1], logits[2] * logits[3]};
  return {logits.rows(), logits[-1], 1};
}

namespace {

// The loss's rows of `logits`, checked against the targets' and the statistics' counts.
ClassRows loss_rows(const char* op, const Tensor& logits, const Tensor& targets, const Tensor& lse) {
  const ClassRows r = class_rows(logits.shape);
  MPIPE_CHECK(targets.numel() == r.rows() && (lse.empty() || lse.numel() == r.rows()), op, ": ", targets.numel(),
              " targets and ", lse.numel(), " statistics for ", r.rows(), " rows of ", logits.shape.str());
  return r;
}

}  // namespace

double crossentropy_forward(const Tensor& lse, const Tensor& logits, const Tensor& targets, double* device_loss_sum) {
  const OpTimer timer(OpKind::loss, __func__);
  same_device("cross-entropy", lse, logits);
  same_device("cross-entropy", targets, logits);
  is_f32("cross-entropy", lse);
  const ClassRows r = loss_rows("cross-entropy", logits, targets, lse);
  if (logits.device == Device::cpu)
    return cpu::crossentropy_forward(lse.f32(), logits.f32(), targets.i32(), r.outer, r.classes, r.plane);
  MPIPE_ON_GPU(logits, cuda::crossentropy_forward(lse.f32(), device_loss_sum, ptr<E>(logits), targets.i32(), r.outer,
                                                  r.classes, r.plane));
  return 0.0;
}

void crossentropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                           float scale) {
  const OpTimer timer(OpKind::loss, __func__);
  same_place("cross-entropy backward", dlogits, logits);
  same_device("cross-entropy backward", lse, logits);
  const ClassRows r = loss_rows("cross-entropy backward", logits, targets, lse);
  if (logits.device == Device::cpu)
    cpu::crossentropy_backward(dlogits.f32(), logits.f32(), lse.f32(), targets.i32(), scale, r.outer, r.classes,
                               r.plane);
  else
    MPIPE_ON_GPU(logits, cuda::crossentropy_backward(ptr<E>(dlogits), ptr<E>(logits), lse.f32(), targets.i32(),
                                                     scale, r.outer, r.classes, r.plane));
}

void dropout_apply(const Tensor& out, const Tensor& inp, float p, const DropoutKey& key) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("dropout", out, inp);
  const int64_t B = inp.shape[0], per_sample = inp.numel() / B;
  if (inp.device == Device::cpu) cpu::dropout_apply(out.f32(), inp.f32(), B, per_sample, p, key);
  else MPIPE_ON_GPU(inp, cuda::dropout_apply(ptr<E>(out), ptr<E>(inp), B, per_sample, p, key));
}

void add_dropped(const Tensor& out, const Tensor& base, const Tensor& branch, float p, const DropoutKey& key) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("add dropped", out, base);
  same_place("add dropped", base, branch);
  const int64_t B = base.shape[0], per_sample = base.numel() / B;
  if (base.device == Device::cpu) cpu::add_dropped(out.f32(), base.f32(), branch.f32(), B, per_sample, p, key);
  else MPIPE_ON_GPU(base, cuda::add_dropped(ptr<E>(out), ptr<E>(base), ptr<E>(branch), B, per_sample, p, key));
}

namespace {

// The statistics (4, N) of a head chunk: fp32 on either device.
void head_statistics(const char* op, const Tensor& stats, int64_t N) {
  is_f32(op, stats);
  MPIPE_CHECK(stats.empty() || stats.numel() == 4 * N, op, ": statistics of ", stats.numel(), " for ", N, " rows");
}
}  // namespace

int64_t count_correct(const Tensor& logits, const Tensor& targets) {
  const OpTimer timer(OpKind::loss, __func__);
  const ClassRows r = loss_rows("count_correct", logits, targets, Tensor{});
  if (logits.device == Device::cpu) return cpu::count_correct(logits.f32(), targets.i32(), r.outer, r.classes, r.plane);
  std::vector<float> host(static_cast<std::size_t>(logits.numel()));
  std::vector<std::int32_t> wanted(static_cast<std::size_t>(r.rows()));
  if (logits.dtype == DType::bf16) {
    std::vector<bf16> half(host.size());
    cuda::copy_to_host(half.data(), logits.data, half.size() * sizeof(bf16));
    cuda::copy_to_host(wanted.data(), targets.data, wanted.size() * sizeof(std::int32_t));
    cuda::synchronize(cuda::StreamKind::compute);
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = to_float(half[i]);
  } else {
    cuda::copy_to_host(host.data(), logits.data, host.size() * sizeof(float));
    cuda::copy_to_host(wanted.data(), targets.data, wanted.size() * sizeof(std::int32_t));
    cuda::synchronize(cuda::StreamKind::compute);
  }
  return cpu::count_correct(host.data(), wanted.data(), r.outer, r.classes, r.plane);
}

void vocab_chunk_forward(const Tensor& out, const Tensor& in, const Tensor& z, const Tensor& targets, int64_t v0) {
  const OpTimer timer(OpKind::loss, __func__);
  const int64_t N = z.shape.rows(), V = z.shape[-1];
  same_device("vocab chunk", out, z);
  same_device("vocab chunk", in, z);
  same_device("vocab chunk", targets, z);
  head_statistics("vocab chunk", out, N);
  head_statistics("vocab chunk", in, N);
  MPIPE_CHECK(!out.empty() && targets.numel() == N, "vocab chunk: ", targets.numel(), " targets for ", N, " rows");
  if (z.device == Device::cpu)
    cpu::vocab_chunk_forward(out.f32(), ptr_or_null<float>(in), z.f32(), targets.i32(), N, V, v0);
  else
    MPIPE_ON_GPU(z, cuda::vocab_chunk_forward(out.f32(), ptr_or_null<float>(in), ptr<E>(z), targets.i32(), N, V, v0));
}

void vocab_chunk_backward(const Tensor& dz, const Tensor& din, const Tensor& dout, const Tensor& z, const Tensor& in,
                          const Tensor& out, const Tensor& targets, int64_t v0, GradMode mode) {
  const OpTimer timer(OpKind::loss, __func__);
  const int64_t N = z.shape.rows(), V = z.shape[-1];
  same_place("vocab chunk backward", dz, z);
  same_device("vocab chunk backward", dout, z);
  head_statistics("vocab chunk backward", dout, N);
  head_statistics("vocab chunk backward", din, N);
  MPIPE_CHECK(dz.shape == z.shape && !dout.empty(), "vocab chunk backward: dz ", dz.shape.str(), " for z ", z.shape.str());
  if (z.device == Device::cpu)
    cpu::vocab_chunk_backward(dz.f32(), ptr_or_null<float>(din), dout.f32(), z.f32(), ptr_or_null<float>(in), out.f32(),
                              targets.i32(), N, V, v0, mode);
  else
    MPIPE_ON_GPU(z, cuda::vocab_chunk_backward(ptr<E>(dz), ptr_or_null<float>(din), dout.f32(), ptr<E>(z),
                                               ptr_or_null<float>(in), out.f32(), targets.i32(), N, V, v0, mode));
}

double vocab_loss_forward(const Tensor& stats, const Tensor& targets, int64_t vocab, double* device_loss_sum) {
  const OpTimer timer(OpKind::loss, __func__);
  const int64_t N = targets.numel();
  head_statistics("vocab loss", stats, N);
  if (stats.device == Device::cpu) return cpu::vocab_loss_forward(stats.f32(), targets.i32(), N, vocab);
#if MPIPE_HAVE_CUDA
  cuda::vocab_loss_forward(device_loss_sum, stats.f32(), N);
#endif
  return 0.0;
}

void vocab_loss_backward(const Tensor& dstats, const Tensor& stats, float scale) {
  const OpTimer timer(OpKind::loss, __func__);
  MPIPE_CHECK(dstats.numel() == stats.numel() && stats.numel() % 4 == 0, "vocab loss backward shapes");
  same_device("vocab loss backward", dstats, stats);
  is_f32("vocab loss backward", stats);
  is_f32("vocab loss backward", dstats);
  if (stats.device == Device::cpu) return cpu::vocab_loss_backward(dstats.f32(), stats.f32(), scale, stats.numel() / 4);
#if MPIPE_HAVE_CUDA
  cuda::vocab_loss_backward(dstats.f32(), stats.f32(), scale, stats.numel() / 4);
#endif
}

int64_t vocab_count_correct(const Tensor& stats, const Tensor& targets) {
  const OpTimer timer(OpKind::loss, __func__);
  const int64_t N = targets.numel();
  head_statistics("vocab count", stats, N);
  if (stats.device == Device::cpu) return cpu::vocab_count_correct(stats.f32(), targets.i32(), N);
  // Evaluation only: the statistics and targets to the host.
  std::vector<float> host(static_cast<std::size_t>(4 * N));
  std::vector<std::int32_t> wanted(static_cast<std::size_t>(N));
  cuda::copy_to_host(host.data(), stats.data, host.size() * sizeof(float));
  cuda::copy_to_host(wanted.data(), targets.data, wanted.size() * sizeof(std::int32_t));
  cuda::synchronize(cuda::StreamKind::compute);
  return cpu::vocab_count_correct(host.data(), wanted.data(), N);
}

void add(const Tensor& y, const Tensor& x) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("add", y, x);
  MPIPE_CHECK(y.numel() == x.numel(), "add: ", y.shape.str(), " += ", x.shape.str());
  if (x.device == Device::cpu) cpu::add(y.f32(), x.f32(), x.numel());
  else MPIPE_ON_GPU(x, cuda::add(ptr<E>(y), ptr<E>(x), x.numel()));
}

void copy(const Tensor& y, const Tensor& x) {
  const OpTimer timer(OpKind::copy, __func__);
  same_place("copy", y, x);
  MPIPE_CHECK(y.numel() == x.numel(), "copy: ", y.shape.str(), " = ", x.shape.str());
  if (x.device == Device::cpu) cpu::copy(y.f32(), x.f32(), x.numel());
  else MPIPE_ON_GPU(x, cuda::copy(ptr<E>(y), ptr<E>(x), x.numel()));
}

void convert(const Tensor& y, const Tensor& x) {
  const OpTimer timer(OpKind::copy, __func__);
  same_device("convert", y, x);
  MPIPE_CHECK(y.numel() == x.numel(), "convert: ", y.shape.str(), " = ", x.shape.str());
  if (y.dtype == x.dtype) return copy(y, x);
  MPIPE_CHECK(x.device == Device::cuda, "convert: the CPU computes in fp32 only");
#if MPIPE_HAVE_CUDA
  if (y.dtype == DType::bf16 && x.dtype == DType::f32) cuda::convert(ptr<bf16>(y), ptr<float>(x), x.numel());
  else if (y.dtype == DType::f32 && x.dtype == DType::bf16) cuda::convert(ptr<float>(y), ptr<bf16>(x), x.numel());
  else throw Error(cat("convert: ", to_string(x.dtype), " to ", to_string(y.dtype)));
#endif
}

void zero(const Tensor& y) {
  const OpTimer timer(OpKind::copy, __func__);
  if (y.device == Device::cpu) std::fill_n(static_cast<std::byte*>(y.data), y.bytes(), std::byte{0});
  else cuda::zero(y.data, y.bytes());
}

void scale(const Tensor& y, float factor) {
  const OpTimer timer(OpKind::optimizer, __func__);
  is_f32("scale", y);
  if (y.device == Device::cpu) cpu::scale(y.f32(), factor, y.numel());
  else MPIPE_ON_GPU(y, cuda::scale(ptr<E>(y), factor, y.numel()));
}

void transfer(const Tensor& y, const Tensor& x) {
  const OpTimer timer(OpKind::copy, __func__);
  MPIPE_CHECK(y.bytes() == x.bytes(), "transfer: ", y.bytes(), " bytes from ", x.bytes());
  if (y.data == x.data) return;
  if (y.device == Device::cpu && x.device == Device::cpu) {
    std::memcpy(y.data, x.data, x.bytes());
    return;
  }
  if (y.device == Device::cuda && x.device == Device::cuda) cuda::copy_on_device(y.data, x.data, x.bytes());
  else if (y.device == Device::cuda) cuda::copy_to_device(y.data, x.data, x.bytes());
  else cuda::copy_to_host(y.data, x.data, x.bytes());
  cuda::synchronize(cuda::StreamKind::compute);
}

// A GPU's spans as device arrays, and the per-span sums there and in pinned memory.
struct SpanSums::OnDevice {
  cuda::DeviceBuffer offsets, sizes, sums;
  cuda::PinnedBuffer host_sums;
};

SpanSums::SpanSums(Device device, std::span<const std::int64_t> offsets, std::span<const std::int64_t> sizes)
    : device_(device), offsets_(offsets.begin(), offsets.end()), sizes_(sizes.begin(), sizes.end()),
      host_(offsets.size(), 0.0) {
  MPIPE_CHECK(offsets.size() == sizes.size(), "span sums: ", offsets.size(), " offsets, ", sizes.size(), " sizes");
  if (device == Device::cpu) return;
  const std::size_t n = std::max<std::size_t>(1, offsets.size());
  gpu_ = std::make_unique<OnDevice>(OnDevice{cuda::DeviceBuffer(n * sizeof(std::int64_t)),
                                             cuda::DeviceBuffer(n * sizeof(std::int64_t)),
                                             cuda::DeviceBuffer(n * sizeof(double)), cuda::PinnedBuffer(n * sizeof(double))});
  cuda::copy_to_device(gpu_->offsets.data(), offsets_.data(), offsets_.size() * sizeof(std::int64_t));
  cuda::copy_to_device(gpu_->sizes.data(), sizes_.data(), sizes_.size() * sizeof(std::int64_t));
  cuda::synchronize(cuda::StreamKind::compute);
}

SpanSums::SpanSums() = default;
SpanSums::~SpanSums() = default;
SpanSums::SpanSums(SpanSums&&) noexcept = default;
SpanSums& SpanSums::operator=(SpanSums&&) noexcept = default;

std::span<const double> SpanSums::sums(const Tensor& x) {
  const OpTimer timer(OpKind::optimizer, "gradient_norms");
  is_f32("span sums", x);
  MPIPE_CHECK(x.device == device_, "span sums: the buffer is on another device");
  if (device_ == Device::cpu) {
    for (std::size_t i = 0; i < offsets_.size(); ++i) host_[i] = cpu::sum_squares(x.f32() + offsets_[i], sizes_[i]);
    return host_;
  }
#if MPIPE_HAVE_CUDA
  const int count = static_cast<int>(offsets_.size());
  cuda::sum_squares(gpu_->sums.as<double>(), x.f32(), gpu_->offsets.as<std::int64_t>(), gpu_->sizes.as<std::int64_t>(),
                    count);
  cuda::copy_to_host(gpu_->host_sums.data(), gpu_->sums.data(), static_cast<std::size_t>(count) * sizeof(double));
  cuda::synchronize(cuda::StreamKind::compute);
  return {gpu_->host_sums.as<double>(), offsets_.size()};
#else
  throw Error("span sums on the GPU in a build without CUDA");
#endif
}

}  // namespace mpipe::ops
