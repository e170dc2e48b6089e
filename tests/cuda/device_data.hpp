// What the `cuda` op tests share: host data drawn as a pure function of a tag, its E
// (fp32 or bf16) form and back, the normalized error they compare by, and device arrays
// filled and read on the compute stream (the ops' stream), so no copy races a fill
// queued elsewhere. The CPU twin of an op is given the bf16-rounded inputs (rounded<E>),
// so a comparison measures the GPU's compute error.
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "compare.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/bf16.hpp"
#include "mpipe/core/rng.hpp"
#include "mpipe/core/tensor.hpp"

TYPE_TO_STRING(mpipe::bf16);

namespace mpipe::test {

// ---- host data ---------------------------------------------------------------------------

// n normal samples times `scale`, a pure function of `tag`.
inline std::vector<float> normals(std::size_t n, uint32_t tag, float scale = 1.0f) {
  std::vector<float> x(n);
  make_stream(20240917, Stream::init, tag, 0, 0).fill_normal(x.data(), n, scale);
  return x;
}

// n tokens below V, a pure function of `tag`.
inline std::vector<int32_t> random_tokens(std::size_t n, int64_t V, uint32_t tag) {
  const RandomStream s = make_stream(20240917, Stream::data, tag, 0, 0);
  std::vector<int32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(s.below(i, static_cast<uint64_t>(V)));
  return t;
}

template <class E>
std::vector<E> to_elems(const std::vector<float>& x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    std::vector<bf16> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = to_bf16(x[i]);
    return out;
  }
}

template <class E>
std::vector<float> to_floats(const std::vector<E>& x) {
  if constexpr (std::is_same_v<E, float>) {
    return x;
  } else {
    std::vector<float> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = to_float(x[i]);
    return out;
  }
}

// x as an E tensor holds it, which is what the CPU twin is given.
template <class E>
std::vector<float> rounded(const std::vector<float>& x) {
  return to_floats(to_elems<E>(x));
}
template <class E>
float rounded(float x) {
  return rounded<E>(std::vector<float>{x})[0];
}

template <class E>
constexpr DType dtype_of = std::is_same_v<E, float> ? DType::f32 : DType::bf16;

// Where results are stored as E.
template <class E>
constexpr double tolerance = std::is_same_v<E, float> ? 1e-5 : 1e-2;
// fp32 parameter gradients of a GEMM: with bf16 operands the tensor cores add inside
// each MMA with truncation, a few fp32 ulps per step.
template <class E>
constexpr double gemm_grad_tolerance = std::is_same_v<E, float> ? 1e-5 : 1e-4;
constexpr double fp32_tolerance = 1e-5;

// ||gpu - cpu|| / ||cpu||.
inline double error(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  REQUIRE(gpu.size() == cpu.size());
  return relative_difference(gpu, cpu);
}

// ---- device data -------------------------------------------------------------------------

// Device memory owned by a test: zeroed, or filled from the host.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n), data_(static_cast<T*>(cuda::allocate(bytes()))) {
    cuda::zero(data_, bytes());
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { write(host); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cuda::release(data_); }

  T* get() const { return data_; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return std::max<std::size_t>(1, n_) * sizeof(T); }
  std::vector<T> read() const {
    std::vector<T> host(n_);
    cuda::copy_to_host(host.data(), data_, n_ * sizeof(T));
    cuda::synchronize(cuda::StreamKind::compute);
    return host;
  }
  void write(const std::vector<T>& host) {
    REQUIRE(host.size() == n_);
    cuda::copy_to_device(data_, host.data(), n_ * sizeof(T));
  }

 private:
  std::size_t n_;
  T* data_;
};

template <class E>
DeviceArray<E> upload(const std::vector<float>& x) {
  return DeviceArray<E>(to_elems<E>(x));
}
template <class E>
std::vector<float> download(const DeviceArray<E>& d) {
  return to_floats(d.read());
}

// Reference log-sum-exp of each causal score row (B, H, T) of qkv (B, T, C + 2 KV), in
// double: query head h against key head h / (H / KVH) (KVH 0: H, qkv (B, T, 3C)).
inline std::vector<float> attention_lse(const std::vector<float>& qkv, int64_t B, int64_t T, int64_t C, int64_t H,
                                        int64_t KVH = 0) {
  if (KVH == 0) KVH = H;
  const int64_t hs = C / H, ld = C + 2 * KVH * hs;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<float> lse(static_cast<std::size_t>(B * H * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const float* q = qkv.data() + (b * T + i) * ld + h * hs;
        std::vector<double> s(static_cast<std::size_t>(i + 1));
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          const float* k = qkv.data() + (b * T + j) * ld + C + (h / (H / KVH)) * hs;
          double dot = 0.0;
          for (int64_t d = 0; d < hs; ++d) dot += static_cast<double>(q[d]) * k[d];
          s[static_cast<std::size_t>(j)] = dot * scale;
          mx = std::max(mx, s[static_cast<std::size_t>(j)]);
        }
        double sum = 0.0;
        for (double v : s) sum += std::exp(v - mx);
        lse[static_cast<std::size_t>((b * H + h) * T + i)] = static_cast<float>(mx + std::log(sum));
      }
  return lse;
}

}  // namespace mpipe::test
