// The one-pass ops on the GPU (add_dropped, residual_layernorm_forward, embedding_forward
// with dropout) against the passes they replace on the GPU, bit for bit (a transformer
// block's forward keeps its bits with MPIPE_FUSE=off), and against the CPU: fp32 bit for
// bit where the CPU's ops are single operations (add_dropped, the embedding), else within
// the ops' tolerance. Rows of 99 channels (no packed loads; a sample of 5 x 99 elements is
// not a multiple of 4, so a dropout group spans two rows) and of 64 and 1024 (packed),
// with and without dropout. And cross-entropy's backward written over its own logits.
#include <doctest/doctest.h>

#include <vector>

#include "compare.hpp"
#include "device_data.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cuda/ops.hpp"
#include "mpipe/backend/cuda/runtime.hpp"

using namespace mpipe;
using namespace mpipe::test;

namespace {

struct Case {
  int64_t B, T, C;
  float p;
};
constexpr Case kCases[] = {{3, 5, 99, 0.0f}, {3, 5, 99, 0.1f}, {2, 4, 64, 0.0f}, {2, 4, 64, 0.1f},
                           {4, 128, 1024, 0.1f}};

}  // namespace

TEST_CASE_TEMPLATE("cuda op: add_dropped is dropout_apply then add, on the GPU and the CPU", E, float, bf16) {
  const DropoutKey key{7, 5, 11, 49};
  for (const Case c : kCases) {
    CAPTURE(c.C);
    CAPTURE(c.p);
    const int64_t per_sample = c.T * c.C, n = c.B * per_sample;
    const auto base = rounded<E>(normals(n, 60)), branch = rounded<E>(normals(n, 61, 2.0f));
    const DeviceArray<E> d_base = upload<E>(base), d_branch = upload<E>(branch);
    // Two passes on the GPU.
    DeviceArray<E> d_two = upload<E>(branch);
    if (c.p > 0.0f) cuda::dropout_apply(d_two.get(), d_two.get(), c.B, per_sample, c.p, key);
    cuda::add(d_two.get(), d_base.get(), n);
    // One, into the branch, into the base and apart.
    DeviceArray<E> d_into_branch = upload<E>(branch), d_into_base = upload<E>(base), d_apart(n);
    cuda::add_dropped(d_into_branch.get(), d_base.get(), d_into_branch.get(), c.B, per_sample, c.p, key);
    cuda::add_dropped(d_into_base.get(), d_into_base.get(), d_branch.get(), c.B, per_sample, c.p, key);
    cuda::add_dropped(d_apart.get(), d_base.get(), d_branch.get(), c.B, per_sample, c.p, key);
    const auto two = d_two.read();
    CHECK(same_bits(d_into_branch.read(), two));
    CHECK(same_bits(d_into_base.read(), two));
    CHECK(same_bits(d_apart.read(), two));
    // The CPU's.
    std::vector<float> cpu_out(n);
    cpu::add_dropped(cpu_out.data(), base.data(), branch.data(), c.B, per_sample, c.p, key);
    if constexpr (std::is_same_v<E, float>) CHECK(same_bits(two, cpu_out));
    else CHECK(error(download(d_apart), cpu_out) < tolerance<E>);
  }
}

TEST_CASE_TEMPLATE("cuda op: residual_layernorm_forward is dropout_apply, add and layernorm_forward", E, float, bf16) {
  const DropoutKey key{7, 5, 11, 50};
  for (const Case c : kCases) {
    CAPTURE(c.C);
    CAPTURE(c.p);
    const int64_t N = c.B * c.T, C = c.C, n = N * C;
    const auto residual = rounded<E>(normals(n, 62)), branch = rounded<E>(normals(n, 63, 2.0f));
    const auto weight = rounded<E>(normals(C, 64, 0.5f)), bias = rounded<E>(normals(C, 65));
    const DeviceArray<E> d_residual = upload<E>(residual), d_weight = upload<E>(weight), d_bias = upload<E>(bias);
    // Three passes on the GPU.
    DeviceArray<E> d_sum3 = upload<E>(branch), d_out3(n);
    DeviceArray<float> d_mean3(N), d_rstd3(N);
    if (c.p > 0.0f) cuda::dropout_apply(d_sum3.get(), d_sum3.get(), c.B, c.T * C, c.p, key);
    cuda::add(d_sum3.get(), d_residual.get(), n);
    cuda::layernorm_forward(d_out3.get(), d_mean3.get(), d_rstd3.get(), d_sum3.get(), d_weight.get(), d_bias.get(),
                            N, C);
    // One.
    DeviceArray<E> d_sum = upload<E>(branch), d_out(n);
    DeviceArray<float> d_mean(N), d_rstd(N);
    cuda::residual_layernorm_forward(d_out.get(), d_mean.get(), d_rstd.get(), d_sum.get(), d_residual.get(),
                                     d_weight.get(), d_bias.get(), N, C, c.T, c.p, key);
    CHECK(same_bits(d_sum.read(), d_sum3.read()));
    CHECK(same_bits(d_out.read(), d_out3.read()));
    CHECK(same_bits(d_mean.read(), d_mean3.read()));
    CHECK(same_bits(d_rstd.read(), d_rstd3.read()));
    // The CPU's.
    std::vector<float> sum = branch, out(n), mean(N), rstd(N);
    cpu::residual_layernorm_forward(out.data(), mean.data(), rstd.data(), sum.data(), residual.data(), weight.data(),
                                    bias.data(), N, C, c.T, c.p, key);
    CHECK(error(download(d_sum), sum) < tolerance<E>);
    CHECK(error(download(d_out), out) < tolerance<E>);
    CHECK(error(d_rstd.read(), rstd) < (std::is_same_v<E, float> ? fp32_tolerance : tolerance<E>));
  }
}

TEST_CASE_TEMPLATE("cuda op: embedding_forward with dropout is embedding_forward then dropout_apply", E, float, bf16) {
  const DropoutKey key{7, 5, 11, 0};
  const int64_t V = 50;
  for (const Case c : kCases) {
    CAPTURE(c.C);
    CAPTURE(c.p);
    const int64_t n = c.B * c.T * c.C;
    const auto wte = rounded<E>(normals(V * c.C, 66)), wpe = rounded<E>(normals(c.T * c.C, 67));
    const auto tokens = random_tokens(static_cast<std::size_t>(c.B * c.T), V, 68);
    const DeviceArray<E> d_wte = upload<E>(wte), d_wpe = upload<E>(wpe);
    const DeviceArray<int32_t> d_tokens(tokens);
    DeviceArray<E> d_two(n), d_one(n);
    cuda::embedding_forward(d_two.get(), d_tokens.get(), d_wte.get(), d_wpe.get(), c.B, c.T, c.C, V);
    if (c.p > 0.0f) cuda::dropout_apply(d_two.get(), d_two.get(), c.B, c.T * c.C, c.p, key);
    cuda::embedding_forward(d_one.get(), d_tokens.get(), d_wte.get(), d_wpe.get(), c.B, c.T, c.C, V, c.p, key);
    CHECK(same_bits(d_one.read(), d_two.read()));
    // The CPU's.
    std::vector<float> cpu_out(n);
    cpu::embedding_forward(cpu_out.data(), tokens.data(), wte.data(), wpe.data(), c.B, c.T, c.C, V);
    if (c.p > 0.0f) cpu::dropout_apply(cpu_out.data(), cpu_out.data(), c.B, c.T * c.C, c.p, key);
    if constexpr (std::is_same_v<E, float>) CHECK(same_bits(d_one.read(), cpu_out));
    else CHECK(error(download(d_one), cpu_out) < tolerance<E>);
  }
}

TEST_CASE_TEMPLATE("cuda op: crossentropy_backward over its own logits gives the bits of a separate output", E, float,
                   bf16) {
  // A loss writes its gradient over its logits (gradient_in_place): the kernel must read
  // each element before it writes it.
  const int64_t N = 37, V = 1003;
  const auto logits = rounded<E>(normals(N * V, 72, 3.0f));
  const auto targets = random_tokens(N, V, 73);
  const DeviceArray<E> d_logits = upload<E>(logits);
  const DeviceArray<int32_t> d_targets(targets);
  DeviceArray<float> d_lse(N);
  DeviceArray<double> d_loss(1);
  cuda::crossentropy_forward(d_lse.get(), d_loss.get(), d_logits.get(), d_targets.get(), N, V);
  DeviceArray<E> d_apart(N * V), d_over = upload<E>(logits);
  cuda::crossentropy_backward(d_apart.get(), d_logits.get(), d_lse.get(), d_targets.get(), 0.25f, N, V);
  cuda::crossentropy_backward(d_over.get(), d_over.get(), d_lse.get(), d_targets.get(), 0.25f, N, V);
  CHECK(same_bits(d_over.read(), d_apart.read()));
}
