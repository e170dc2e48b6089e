// The Llama family's CUDA ops against their CPU twins (backend/cpu/ops.hpp), in fp32 and
// bf16, as test_cuda_ops.cpp compares the others (normalized error; the CPU given the
// bf16-rounded inputs): RMSNorm forward and backward (with and without a residual, and
// fused with the residual sum before it, bit for bit the separate passes), RoPE forward
// then inverse over grouped queries and keys, SwiGLU forward and backward, and the
// embedding without a position table. The ops that reduce are rerun for the same bits.
// Grouped-query attention and its generation are in test_cuda_attention.cpp.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "compare.hpp"
#include "device_data.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cuda/ops.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/bf16.hpp"

using namespace mpipe;
using namespace mpipe::test;

namespace {

constexpr float kEps = 1e-5f;

// fp32 statistics and parameter gradients: the CPU's to fp32 rounding in fp32; in bf16
// the GPU's weight gradient sums dy · bf16(x · rstd) (what the forward multiplied, as
// Hugging Face's LlamaRMSNorm), the CPU's the unrounded product: bf16's tolerance.
template <class E>
constexpr double stat_tolerance = std::is_same_v<E, float> ? fp32_tolerance : tolerance<E>;

struct Rows {
  int64_t N, C;
};

}  // namespace

// ---- RMSNorm ---------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: rmsnorm forward and backward, with and without a residual", E, float, bf16) {
  for (const Rows s : {Rows{37, 768}, Rows{64, 99}, Rows{300, 2048}}) {  // packed, unpacked, many row chunks
    CAPTURE(s.N);
    CAPTURE(s.C);
    const int64_t N = s.N, C = s.C;
    const auto inp = rounded<E>(normals(N * C, 1040, 3.0f));
    const auto weight = rounded<E>(normals(C, 1041, 0.5f));
    const auto dout = rounded<E>(normals(N * C, 1043));
    const auto dinp0 = rounded<E>(normals(N * C, 1044));
    const auto dweight0 = normals(C, 1045);

    std::vector<float> out(N * C), rstd(N);
    cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C, kEps);
    const DeviceArray<E> d_inp = upload<E>(inp), d_weight = upload<E>(weight), d_dout = upload<E>(dout);
    DeviceArray<E> d_out(N * C);
    DeviceArray<float> d_rstd(N);
    cuda::rmsnorm_forward(d_out.get(), d_rstd.get(), d_inp.get(), d_weight.get(), N, C, kEps);
    CHECK(error(download(d_out), out) < tolerance<E>);
    CHECK(error(d_rstd.read(), rstd) < fp32_tolerance);

    for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
      CAPTURE(static_cast<int>(mode));
      auto dinp = dinp0, dweight = dweight0;
      cpu::rmsnorm_backward(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), rstd.data(), N, C,
                            mode);
      DeviceArray<E> d_dinp = upload<E>(dinp0);
      DeviceArray<float> d_dweight(dweight0);
      cuda::rmsnorm_backward(d_dinp.get(), d_dweight.get(), d_dout.get(), d_inp.get(), d_weight.get(), d_rstd.get(), N,
                             C, mode);
      CHECK(error(download(d_dinp), dinp) < tolerance<E>);
      CHECK(error(d_dweight.read(), dweight) < stat_tolerance<E>);
    }
    // With a residual: dinp = residual + the input gradient in one pass, the bits of
    // accumulating onto a copy of the residual, and the CPU's sum.
    const auto residual = rounded<E>(normals(N * C, 1047));
    auto dinp = residual, dweight = dweight0;
    cpu::rmsnorm_backward(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), rstd.data(), N, C,
                          GradMode::accumulate);
    const DeviceArray<E> d_residual = upload<E>(residual);
    DeviceArray<E> d_onto = upload<E>(dinp0), d_copied = upload<E>(residual);
    DeviceArray<float> d_dweight1(dweight0), d_dweight2(dweight0);
    cuda::rmsnorm_backward(d_onto.get(), d_dweight1.get(), d_dout.get(), d_inp.get(), d_weight.get(), d_rstd.get(), N,
                           C, GradMode::overwrite, d_residual.get());
    cuda::rmsnorm_backward(d_copied.get(), d_dweight2.get(), d_dout.get(), d_inp.get(), d_weight.get(), d_rstd.get(), N,
                           C, GradMode::accumulate);
    CHECK(same_bits(d_onto.read(), d_copied.read()));
    CHECK(same_bits(d_dweight1.read(), d_dweight2.read()));
    CHECK(error(download(d_onto), dinp) < tolerance<E>);
    CHECK(error(d_dweight1.read(), dweight) < stat_tolerance<E>);

    // A rerun: the same bits (the weight gradient's chunks are added in a fixed order).
    DeviceArray<E> d_again = upload<E>(dinp0);
    DeviceArray<float> d_dweight3(dweight0);
    cuda::rmsnorm_backward(d_again.get(), d_dweight3.get(), d_dout.get(), d_inp.get(), d_weight.get(), d_rstd.get(), N,
                           C, GradMode::overwrite, d_residual.get());
    CHECK(same_bits(d_again.read(), d_onto.read()));
    CHECK(same_bits(d_dweight3.read(), d_dweight1.read()));
  }
}

TEST_CASE_TEMPLATE("cuda op: residual_rmsnorm_forward is dropout_apply, add and rmsnorm_forward", E, float, bf16) {
  // Rows of 99 channels (no packed loads; a sample of 5 x 99 elements is not a multiple
  // of 4, so a dropout group spans two rows) and of 64 and 1024 (packed), with and
  // without dropout, as test_cuda_fused.cpp's LayerNorm.
  struct Case {
    int64_t B, T, C;
    float p;
  };
  const DropoutKey key{7, 5, 11, 51};
  for (const Case c : {Case{3, 5, 99, 0.0f}, Case{3, 5, 99, 0.1f}, Case{2, 4, 64, 0.0f}, Case{2, 4, 64, 0.1f},
                       Case{4, 128, 1024, 0.1f}}) {
    CAPTURE(c.C);
    CAPTURE(c.p);
    const int64_t N = c.B * c.T, C = c.C, n = N * C;
    const auto residual = rounded<E>(normals(n, 1062)), branch = rounded<E>(normals(n, 1063, 2.0f));
    const auto weight = rounded<E>(normals(C, 1064, 0.5f));
    const DeviceArray<E> d_residual = upload<E>(residual), d_weight = upload<E>(weight);
    // Three passes on the GPU.
    DeviceArray<E> d_sum3 = upload<E>(branch), d_out3(n);
    DeviceArray<float> d_rstd3(N);
    if (c.p > 0.0f) cuda::dropout_apply(d_sum3.get(), d_sum3.get(), c.B, c.T * C, c.p, key);
    cuda::add(d_sum3.get(), d_residual.get(), n);
    cuda::rmsnorm_forward(d_out3.get(), d_rstd3.get(), d_sum3.get(), d_weight.get(), N, C, kEps);
    // One.
    DeviceArray<E> d_sum = upload<E>(branch), d_out(n);
    DeviceArray<float> d_rstd(N);
    cuda::residual_rmsnorm_forward(d_out.get(), d_rstd.get(), d_sum.get(), d_residual.get(), d_weight.get(), N, C, c.T,
                                   c.p, key, kEps);
    CHECK(same_bits(d_sum.read(), d_sum3.read()));
    CHECK(same_bits(d_out.read(), d_out3.read()));
    CHECK(same_bits(d_rstd.read(), d_rstd3.read()));
    // The CPU's.
    std::vector<float> sum = branch, out(n), rstd(N);
    cpu::residual_rmsnorm_forward(out.data(), rstd.data(), sum.data(), residual.data(), weight.data(), N, C, c.T, c.p,
                                  key, kEps);
    CHECK(error(download(d_sum), sum) < tolerance<E>);
    CHECK(error(download(d_out), out) < tolerance<E>);
    CHECK(error(d_rstd.read(), rstd) < stat_tolerance<E>);
  }
}

// ---- RoPE ------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: rope_apply forward then inverse matches the CPU, grouped heads, v untouched", E, float,
                   bf16) {
  // KVH key heads (1: multi-query, 2, H) after H query heads; positions from 0 and deep
  // into a long context (angles of thousands of radians: the table's double angle); head
  // sizes whose halves are whole packs (64, 128) and not (hs 6: halves of 3).
  struct Case {
    int64_t B, T, H, KVH, hs, position;
    float theta;
  };
  uint32_t tag = 1100;
  for (const Case c : {Case{2, 37, 4, 1, 64, 0, 10000.0f}, Case{2, 37, 4, 2, 64, 0, 10000.0f},
                       Case{1, 50, 4, 4, 128, 0, 500000.0f}, Case{2, 9, 8, 2, 128, 4000, 500000.0f},
                       Case{1, 33, 2, 1, 6, 7, 10000.0f}}) {
    CAPTURE(c.H);
    CAPTURE(c.KVH);
    CAPTURE(c.hs);
    CAPTURE(c.position);
    const int64_t C = c.H * c.hs, KV = c.KVH * c.hs, ld = C + 2 * KV, n = c.B * c.T * ld;
    const auto qkv = rounded<E>(normals(n, tag++));
    std::vector<float> rotated = qkv;
    cpu::rope_apply(rotated.data(), c.B, c.T, C, c.H, c.KVH, c.position, c.theta, false);
    DeviceArray<E> d_qkv = upload<E>(qkv);
    cuda::rope_apply(d_qkv.get(), c.B, c.T, C, c.H, c.KVH, c.position, c.theta, false);
    const std::vector<E> gpu_rotated = d_qkv.read();
    CHECK(error(to_floats(gpu_rotated), rotated) < tolerance<E>);
    // v is left alone, bit for bit; q and k moved.
    const std::vector<E> original = to_elems<E>(qkv);
    bool v_same = true, qk_moved = false;
    for (int64_t row = 0; row < c.B * c.T; ++row)
      for (int64_t i = 0; i < ld; ++i) {
        const bool same = std::memcmp(&gpu_rotated[row * ld + i], &original[row * ld + i], sizeof(E)) == 0;
        if (i >= C + KV) v_same = v_same && same;
        else qk_moved = qk_moved || !same;
      }
    CHECK(v_same);
    CHECK(qk_moved);
    // The inverse (the backward of dq, dk) against the CPU's, and back to the start within
    // rounding.
    std::vector<float> back = rotated;
    cpu::rope_apply(back.data(), c.B, c.T, C, c.H, c.KVH, c.position, c.theta, true);
    DeviceArray<E> d_back = upload<E>(rotated);
    cuda::rope_apply(d_back.get(), c.B, c.T, C, c.H, c.KVH, c.position, c.theta, true);
    CHECK(error(download(d_back), back) < tolerance<E>);
    cuda::rope_apply(d_qkv.get(), c.B, c.T, C, c.H, c.KVH, c.position, c.theta, true);
    CHECK(error(download(d_qkv), qkv) < (std::is_same_v<E, float> ? fp32_tolerance : 2 * tolerance<E>));
  }
}

// ---- SwiGLU ----------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: swiglu forward and backward (overwrite, accumulate)", E, float, bf16) {
  for (const Rows s : {Rows{37, 96}, Rows{20, 99}, Rows{64, 2816}}) {  // packed, unpacked, Llama-like
    CAPTURE(s.N);
    CAPTURE(s.C);
    const int64_t N = s.N, F = s.C;
    const auto inp = rounded<E>(normals(N * 2 * F, 1200, 2.0f));
    const auto dout = rounded<E>(normals(N * F, 1201));
    const auto dinp0 = rounded<E>(normals(N * 2 * F, 1202));
    std::vector<float> out(N * F);
    cpu::swiglu_forward(out.data(), inp.data(), N, F);
    const DeviceArray<E> d_inp = upload<E>(inp), d_dout = upload<E>(dout);
    DeviceArray<E> d_out(N * F);
    cuda::swiglu_forward(d_out.get(), d_inp.get(), N, F);
    CHECK(error(download(d_out), out) < tolerance<E>);
    for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
      CAPTURE(static_cast<int>(mode));
      auto dinp = dinp0;
      cpu::swiglu_backward(dinp.data(), dout.data(), inp.data(), N, F, mode);
      DeviceArray<E> d_dinp = upload<E>(dinp0);
      cuda::swiglu_backward(d_dinp.get(), d_dout.get(), d_inp.get(), N, F, mode);
      CHECK(error(download(d_dinp), dinp) < tolerance<E>);
    }
  }
}

// ---- embedding without a position table -------------------------------------------------

TEST_CASE_TEMPLATE("cuda op: embedding without a position table (wpe, dwpe null)", E, float, bf16) {
  // Llama's input: the token's row alone (RoPE rotates inside attention). The forward is
  // the token table's row bit for bit, the CPU's copy; the backward sums repeated tokens
  // in the CPU's order (the same fp32 additions, the same bits) and writes no position
  // gradient.
  const int64_t B = 4, T = 33, V = 17;
  for (const int64_t C : {int64_t{96}, int64_t{99}}) {  // packed rows, then unpacked
    CAPTURE(C);
    const auto tokens = random_tokens(B * T, V, 1300);
    const auto wte = rounded<E>(normals(V * C, 1301));
    const auto dout = rounded<E>(normals(B * T * C, 1302));
    std::vector<float> out(B * T * C);
    cpu::embedding_forward(out.data(), tokens.data(), wte.data(), nullptr, B, T, C, V);
    const DeviceArray<int32_t> d_tokens(tokens);
    const DeviceArray<E> d_wte = upload<E>(wte), d_dout = upload<E>(dout);
    DeviceArray<E> d_out(B * T * C);
    cuda::embedding_forward(d_out.get(), d_tokens.get(), d_wte.get(), static_cast<const E*>(nullptr), B, T, C, V);
    CHECK(same_bits(d_out.read(), to_elems<E>(out)));
    auto dwte = normals(V * C, 1303);
    DeviceArray<float> d_dwte(dwte);
    cpu::embedding_backward(dwte.data(), nullptr, dout.data(), tokens.data(), B, T, C);
    cuda::embedding_backward(d_dwte.get(), nullptr, d_dout.get(), d_tokens.get(), B, T, C, V);
    CHECK(d_dwte.read() == dwte);
  }
}
