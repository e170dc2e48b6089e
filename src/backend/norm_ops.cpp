// Tensor ops of the rows of a transformer (ops.hpp): LayerNorm's and RMSNorm's forward,
// residual and backward forms, RoPE and SwiGLU; device and element-type checks, then the
// CPU or the CUDA op.
#include "mpipe/backend/ops.hpp"

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/dispatch.hpp"
#include "mpipe/backend/op_profile.hpp"
#include "mpipe/core/bf16.hpp"
#if MPIPE_HAVE_CUDA
#include "mpipe/backend/cuda/ops.hpp"
#endif

namespace mpipe::ops {

using namespace detail;

namespace {
// A LayerNorm forward's tensors: out, inp and the parameters alike, the statistics fp32 beside them.
void layernorm_arguments(const char* op, const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& inp,
                         const Tensor& weight, const Tensor& bias) {
  same_place(op, out, inp);
  same_place(op, inp, weight);
  same_place(op, weight, bias);
  same_device(op, mean, inp);
  is_f32(op, mean);
  is_f32(op, rstd);
}
}  // namespace

void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& inp,
                       const Tensor& weight, const Tensor& bias) {
  const OpTimer timer(OpKind::normalization, __func__);
  layernorm_arguments("layernorm", out, mean, rstd, inp, weight, bias);
  const int64_t N = inp.shape.rows(), C = inp.shape[-1];
  if (inp.device == Device::cpu)
    cpu::layernorm_forward(out.f32(), mean.f32(), rstd.f32(), inp.f32(), weight.f32(), bias.f32(), N, C);
  else
    MPIPE_ON_GPU(inp, cuda::layernorm_forward(ptr<E>(out), mean.f32(), rstd.f32(), ptr<E>(inp), ptr<E>(weight),
                                              ptr<E>(bias), N, C));
}

void residual_layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& sum,
                                const Tensor& residual, float p, const DropoutKey& key, const Tensor& weight,
                                const Tensor& bias) {
  const OpTimer timer(OpKind::normalization, __func__);
  layernorm_arguments("residual layernorm", out, mean, rstd, sum, weight, bias);
  same_place("residual layernorm", sum, residual);
  const int64_t N = sum.shape.rows(), C = sum.shape[-1], per_sample = N / sum.shape[0];
  if (sum.device == Device::cpu)
    cpu::residual_layernorm_forward(out.f32(), mean.f32(), rstd.f32(), sum.f32(), residual.f32(), weight.f32(),
                                    bias.f32(), N, C, per_sample, p, key);
  else
    MPIPE_ON_GPU(sum, cuda::residual_layernorm_forward(ptr<E>(out), mean.f32(), rstd.f32(), ptr<E>(sum),
                                                       ptr<E>(residual), ptr<E>(weight), ptr<E>(bias), N, C,
                                                       per_sample, p, key));
}

void layernorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                        const Tensor& inp, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        GradMode mode, const Tensor& residual) {
  const OpTimer timer(OpKind::normalization, __func__);
  same_place("layernorm backward", dinp, inp);
  same_place("layernorm backward", residual, dinp);
  MPIPE_CHECK(residual.empty() || (mode == GradMode::overwrite && residual.shape == dinp.shape && residual.data != dinp.data),
              "layernorm backward: a residual needs overwrite mode, dinp's shape and its own memory");
  same_place("layernorm backward", dout, inp);
  same_place("layernorm backward", inp, weight);
  same_device("layernorm backward", dweight, inp);
  is_f32("layernorm backward", dweight);
  is_f32("layernorm backward", dbias);
  const int64_t N = inp.shape.rows(), C = inp.shape[-1];
  if (inp.device == Device::cpu) {
    if (!residual.empty()) {
      copy(dinp, residual);
      mode = GradMode::accumulate;
    }
    cpu::layernorm_backward(dinp.f32(), dweight.f32(), dbias.f32(), dout.f32(), inp.f32(), weight.f32(), mean.f32(),
                            rstd.f32(), N, C, mode);
  } else {
    MPIPE_ON_GPU(inp, cuda::layernorm_backward(ptr<E>(dinp), dweight.f32(), dbias.f32(), ptr<E>(dout), ptr<E>(inp),
                                               ptr<E>(weight), mean.f32(), rstd.f32(), N, C, mode,
                                               ptr_or_null<E>(residual)));
  }
}

void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps) {
  const OpTimer timer(OpKind::normalization, __func__);
  layernorm_arguments("rmsnorm", out, rstd, rstd, inp, weight, Tensor{});
  const int64_t N = inp.shape.rows(), C = inp.shape[-1];
  MPIPE_CHECK(weight.numel() == C && rstd.numel() == N, "rmsnorm: weight ", weight.shape.str(), ", rstd ", rstd.shape.str());
  if (inp.device == Device::cpu)
    cpu::rmsnorm_forward(out.f32(), rstd.f32(), inp.f32(), weight.f32(), N, C, eps);
  else
    MPIPE_ON_GPU(inp, cuda::rmsnorm_forward(ptr<E>(out), rstd.f32(), ptr<E>(inp), ptr<E>(weight), N, C, eps));
}

void residual_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& sum, const Tensor& residual,
                              float p, const DropoutKey& key, const Tensor& weight, float eps) {
  const OpTimer timer(OpKind::normalization, __func__);
  layernorm_arguments("residual rmsnorm", out, rstd, rstd, sum, weight, Tensor{});
  same_place("residual rmsnorm", sum, residual);
  const int64_t N = sum.shape.rows(), C = sum.shape[-1], per_sample = N / sum.shape[0];
  if (sum.device == Device::cpu)
    cpu::residual_rmsnorm_forward(out.f32(), rstd.f32(), sum.f32(), residual.f32(), weight.f32(), N, C, per_sample, p,
                                  key, eps);
  else
    MPIPE_ON_GPU(sum, cuda::residual_rmsnorm_forward(ptr<E>(out), rstd.f32(), ptr<E>(sum), ptr<E>(residual),
                                                     ptr<E>(weight), N, C, per_sample, p, key, eps));
}

void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd, GradMode mode, const Tensor& residual) {
  const OpTimer timer(OpKind::normalization, __func__);
  same_place("rmsnorm backward", dinp, inp);
  same_place("rmsnorm backward", residual, dinp);
  MPIPE_CHECK(residual.empty() || (mode == GradMode::overwrite && residual.shape == dinp.shape && residual.data != dinp.data),
              "rmsnorm backward: a residual needs overwrite mode, dinp's shape and its own memory");
  same_place("rmsnorm backward", dout, inp);
  same_place("rmsnorm backward", inp, weight);
  same_device("rmsnorm backward", dweight, inp);
  is_f32("rmsnorm backward", dweight);
  is_f32("rmsnorm backward", rstd);
  const int64_t N = inp.shape.rows(), C = inp.shape[-1];
  if (inp.device == Device::cpu) {
    if (!residual.empty()) {
      copy(dinp, residual);
      mode = GradMode::accumulate;
    }
    cpu::rmsnorm_backward(dinp.f32(), dweight.f32(), dout.f32(), inp.f32(), weight.f32(), rstd.f32(), N, C, mode);
  } else {
    MPIPE_ON_GPU(inp, cuda::rmsnorm_backward(ptr<E>(dinp), dweight.f32(), ptr<E>(dout), ptr<E>(inp), ptr<E>(weight),
                                             rstd.f32(), N, C, mode, ptr_or_null<E>(residual)));
  }
}

void rope_apply(const Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t position, float theta, bool inverse) {
  const OpTimer timer(OpKind::elementwise, __func__);
  MPIPE_CHECK(qkv.shape.rank == 3, "rope: qkv ", qkv.shape.str());
  const int64_t B = qkv.shape[0], T = qkv.shape[1], width = qkv.shape[2];
  const int64_t C = width * heads / (heads + 2 * kv_heads);  // width = C + 2 C kv_heads / heads
  MPIPE_CHECK(C * (heads + 2 * kv_heads) == width * heads && kv_heads_of(width, C, heads) == kv_heads &&
                  (C / heads) % 2 == 0,
              "rope: qkv ", qkv.shape.str(), " for ", heads, " heads, ", kv_heads, " key/value heads");
  if (qkv.device == Device::cpu)
    cpu::rope_apply(qkv.f32(), B, T, C, heads, kv_heads, position, theta, inverse);
  else
    MPIPE_ON_GPU(qkv, cuda::rope_apply(ptr<E>(qkv), B, T, C, heads, kv_heads, position, theta, inverse));
}

void swiglu_forward(const Tensor& out, const Tensor& inp) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("swiglu", out, inp);
  const int64_t N = inp.shape.rows(), F = out.shape[-1];
  MPIPE_CHECK(inp.shape[-1] == 2 * F && out.shape.rows() == N, "swiglu: out ", out.shape.str(), ", inp ", inp.shape.str());
  if (inp.device == Device::cpu) cpu::swiglu_forward(out.f32(), inp.f32(), N, F);
  else MPIPE_ON_GPU(inp, cuda::swiglu_forward(ptr<E>(out), ptr<E>(inp), N, F));
}

void swiglu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp, GradMode mode) {
  const OpTimer timer(OpKind::elementwise, __func__);
  same_place("swiglu backward", dinp, inp);
  same_place("swiglu backward", dout, inp);
  const int64_t N = inp.shape.rows(), F = dout.shape[-1];
  MPIPE_CHECK(inp.shape[-1] == 2 * F && dinp.shape == inp.shape && dout.shape.rows() == N, "swiglu backward: dout ",
              dout.shape.str(), ", inp ", inp.shape.str());
  if (inp.device == Device::cpu) cpu::swiglu_backward(dinp.f32(), dout.f32(), inp.f32(), N, F, mode);
  else MPIPE_ON_GPU(inp, cuda::swiglu_backward(ptr<E>(dinp), ptr<E>(dout), ptr<E>(inp), N, F, mode));
}

}  // namespace mpipe::ops
