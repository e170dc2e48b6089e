// Convolution, pooling and BatchNorm on Tensors: one call site in the layers for both
// backends, as ops.hpp's ops (the same checks and rules). Images are NCHW in memory, or
// NHWC where the window or the call says channels_last (train --channels-last on): on a
// GPU those run kernels of their own (cuDNN's NHWC convolutions; a convolution direction
// cuDNN declines goes through channels first); on the CPU every channels-last op swaps
// its operands to channels first, runs the channels-first op and swaps back (the same
// bits: a check of the layout, not a fast path).
#pragma once
#include <cstdint>
#include <span>

#include "mpipe/backend/op_types.hpp"
#include "mpipe/core/tensor.hpp"

namespace mpipe::ops {

// Convolution and pooling over NCHW (see cpu/ops.hpp and cuda/ops.hpp). `cols` is
// scratch of conv2d_scratch(w, device) elements: im2col columns on the CPU, none on a GPU
// (its op unfolds the whole micro-batch into temporary device scratch).
int64_t conv2d_scratch(const Window2d& w, Device device);
void conv2d_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias, const Tensor& cols,
                    const Window2d& w);
void conv2d_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                     const Tensor& inp, const Tensor& weight, const Tensor& cols, const Window2d& w, GradMode mode);
void maxpool2d_forward(const Tensor& out, const Tensor& argmax, const Tensor& inp, const Window2d& w);
void maxpool2d_backward(const Tensor& dinp, const Tensor& dout, const Tensor& argmax, const Window2d& w, GradMode mode);
void avgpool2d_forward(const Tensor& out, const Tensor& inp, const Window2d& w);
void avgpool2d_backward(const Tensor& dinp, const Tensor& dout, const Window2d& w, GradMode mode);

// BatchNorm over (N, C, ...) per channel (see cpu/ops.hpp). Statistics and running
// statistics are fp32 on either device. Training with running statistics given
// (non-empty) moves them; the batch's count, sums and sums of squares (1 + 2C doubles) are
// added to `sums` (host memory) on the CPU, to `device_sums` (GPU memory) on a GPU, one
// addition per element, in micro-batch order, without a wait; inference reads them.
void batchnorm_forward_train(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& running_mean,
                             const Tensor& running_var, std::span<double> sums, const Tensor& inp, const Tensor& weight,
                             const Tensor& bias, float eps, float momentum, double* device_sums = nullptr,
                             bool relu = false, bool channels_last = false);
void batchnorm_apply_sums(const Tensor& running_mean, const Tensor& running_var, std::span<const double> sums,
                          float momentum);
void batchnorm_forward_eval(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                            const Tensor& running_mean, const Tensor& running_var, float eps,
                            bool channels_last = false);
void batchnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                        const Tensor& inp, const Tensor& weight, const Tensor& mean, const Tensor& rstd, GradMode mode,
                        bool channels_last = false);

// Layout, for skips (concatenation) and U-Net decoders (nearest upsampling): the element type of the tensors, on either device.
// dst's runs = src's (Runs, in elements).
void copy_runs(const Tensor& dst, const Tensor& src, const Runs& runs);
// (N, C, H, W) -> (N, C, H·scale, W·scale), each element a scale x scale block; the
// gradient sums each block (overwrites dinp).
void upsample_nearest_forward(const Tensor& out, const Tensor& inp, std::int64_t scale, bool channels_last = false);
void upsample_nearest_backward(const Tensor& dinp, const Tensor& dout, std::int64_t scale, bool channels_last = false);
// An image (N, C, ...) between layouts: dst (channels last) = src (channels first) when
// to_last, else the other way; per mode dst is overwritten or added to. The first
// stage's input under --channels-last on, a flatten's, the channels-last fallbacks.
void change_layout(const Tensor& dst, const Tensor& src, bool to_last, GradMode mode = GradMode::overwrite);

}  // namespace mpipe::ops
