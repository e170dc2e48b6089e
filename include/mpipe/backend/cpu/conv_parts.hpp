// The CPU convolution's parts shared by conv.cpp (im2col and GEMMs, and which path a
// window takes) and conv_shifted.cpp (stride-1 windows as sums over the padded planes).
// Callers outside the two use ops.hpp.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "mpipe/backend/cpu/ops.hpp"

namespace mpipe::cpu::conv_parts {

// A 1x1 window with stride 1 and no padding: the columns are the input plane itself.
inline bool pointwise(const Window2d& w) { return w.KH == 1 && w.KW == 1 && w.stride == 1 && w.padding == 0; }

// Samples run side by side, one per thread, each with its own columns (a sample's output
// and input gradient are its own: the same bits for any thread count); one sample, or one
// thread, runs its im2col and GEMMs on every thread instead.
inline int64_t conv_lanes(const Window2d& w) { return std::max<int64_t>(1, std::min<int64_t>(threads(), w.N)); }

// One lane's im2col columns.
inline int64_t columns(const Window2d& w) { return w.C / w.groups * w.KH * w.KW * w.OH * w.OW; }

// This thread's lane of `floats` among `lanes`, inside the samples' loop.
inline float* lane_at(float* cols, int64_t lanes, int64_t floats) {
  return cols + (lanes > 1 ? omp_get_thread_num() : 0) * floats;
}

// ---- stride 1 over the padded planes (conv_shifted.cpp) ----
// Whether the window takes that path (ops.hpp's conv2d_shifted).
bool shifted(const Window2d& w);
// Whether its weight gradient is summed there too (planes of 1024 positions and more);
// else by im2col's GEMMs, from the same scratch.
bool shifted_weight_tiles(const Window2d& w);
// The scratch (conv2d_cols) of a window that takes the path.
int64_t shifted_cols(const Window2d& w);
void shifted_forward(float* out, const float* inp, const float* weight, const float* bias, float* cols,
                     const Window2d& w);
void shifted_input_grad(float* dinp, const float* dout, const float* weight, float* cols, const Window2d& w,
                        GradMode mode);
void shifted_weight_grad(float* dweight, const float* dout, const float* inp, float* cols, const Window2d& w);

// ---- pointwise windows by the same tiles (conv_shifted.cpp) ----
// Whether a pointwise window takes them: planes of whole vectors (positions a multiple of
// 16), up to 1152 channels a group; else its GEMMs over the planes. No scratch either way.
bool pointwise_tiled(const Window2d& w);
// Whether its weight gradient is tiled too (planes of 1024 positions and more), else a GEMM.
bool pointwise_weight_tiles(const Window2d& w);
void pointwise_forward(float* out, const float* inp, const float* weight, const float* bias, const Window2d& w);
void pointwise_input_grad(float* dinp, const float* dout, const float* weight, const Window2d& w, GradMode mode);
void pointwise_weight_grad(float* dweight, const float* dout, const float* inp, const Window2d& w);

}  // namespace mpipe::cpu::conv_parts
