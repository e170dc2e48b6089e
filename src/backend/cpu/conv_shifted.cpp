// The CPU convolution of stride-1 windows as sums over the zero-padded planes (the path
// conv.cpp takes for them; conv_parts.hpp).
//
// A stride-1 window over 16 or more channels per group needs no (Cg KH KW, OH OW) columns.
// With the input zero-padded to (Hp, Wp) planes and the output computed over OH rows of the
// padded width Wp (the last KW - 1 columns of each row are junk, dropped), tap (kh, c, kw)
// of output position j reads the padded plane of channel c at j + kh Wp + kw: every tap is
// the same run of positions from its own offset. The forward and the input gradient are
// sums of such runs, each scaled by a weight per output row, which `taps_sum` tiles in
// registers (8 rows by 48 positions) straight from the padded planes and the weights as
// they are: no columns, no packing. (OpenBLAS packs both operands on every call; over the
// padded planes its GEMMs of 16 to 64 rows and 48 to 576 taps ran at half this tiling's
// speed here.) The weight gradient, a long sum per weight, is tiled the same way (4 output
// channels by 6 taps, 16 partial sums each) over planes of 1024 positions and more; over
// smaller planes the tiles' final adds across lanes would weigh, and im2col's GEMMs do it.
// Which windows: the junk columns cost (KW - 1) / Wp of the work, so planes of 4 (KW - 1)
// columns and more (8 for 3x3); 16 to 1152 taps a group (fewer channels keep im2col; at
// 128 channels, 3x3, the tiles ran 1.1-1.3x OpenBLAS's AVX-512 GEMMs over im2col's columns
// and 1.6-2x its AVX2 ones, at 256 channels 0.9-1.1x the AVX-512 ones); and a lane's planes
// no larger than its im2col columns. One lane's, not every thread's: the path, and so the bits, are the same for any
// thread count.
#include <omp.h>

#include <algorithm>
#include <array>

#include "mpipe/backend/cpu/conv_parts.hpp"

namespace mpipe::cpu::conv_parts {

namespace {

// Tap k = (a, x, b) of a sum reads base + a sa + x sx + b sb (+ the position), scaled by
// the weight at a wa + x wx + b wb (+ the output row times wm): the weights' own layout.
struct Taps {
  int64_t A, X, B, sa, sx, sb, wa, wx, wb, wm;
};

using v16 = float __attribute__((vector_size(64), aligned(4)));

// out[m][j] (rows ldo apart) = sum over taps k, in order, of weight_k[m] * run_k[j], for
// m in [0, MT) and j in [0, 16 NV): MT x NV vectors of sums in registers. With `add`, the
// sum is added to out (out + sum: the bits of the sum written apart, then added).
template <int MT, int NV>
void taps_tile(float* out, int64_t ldo, const float* wt, const float* base, const Taps& t, bool add) {
  v16 acc[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = v16{};
  for (int64_t a = 0; a < t.A; ++a)
    for (int64_t x = 0; x < t.X; ++x) {
      const float* run = base + a * t.sa + x * t.sx;
      const float* wk = wt + a * t.wa + x * t.wx;
      for (int64_t b = 0; b < t.B; ++b, run += t.sb, wk += t.wb) {
        v16 in[NV];
        for (int v = 0; v < NV; ++v) in[v] = *reinterpret_cast<const v16*>(run + 16 * v);
        for (int m = 0; m < MT; ++m)
          for (int v = 0; v < NV; ++v) acc[m][v] += wk[m * t.wm] * in[v];
      }
    }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v) {
      v16* o = reinterpret_cast<v16*>(out + m * ldo + 16 * v);
      *o = add ? *o + acc[m][v] : acc[m][v];
    }
}

// out (M, J; rows ldo apart) = the taps' sums: weights from wt, runs from base.
template <int NV>
void taps_rows(float* out, int64_t ldo, int64_t M, int64_t j, const float* wt, const float* base, const Taps& t,
               bool add) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) taps_tile<8, NV>(out + m * ldo + j, ldo, wt + m * t.wm, base + j, t, add);
  for (; m + 4 <= M; m += 4) taps_tile<4, NV>(out + m * ldo + j, ldo, wt + m * t.wm, base + j, t, add);
  for (; m < M; ++m) taps_tile<1, NV>(out + m * ldo + j, ldo, wt + m * t.wm, base + j, t, add);
}
// J a multiple of 16 (the callers' runs are rounded up, their ends junk).
void taps_sum(float* out, int64_t ldo, int64_t M, int64_t J, const float* wt, const float* base, const Taps& t,
              bool add = false) {
  int64_t j = 0;
  for (; j + 48 <= J; j += 48) taps_rows<3>(out, ldo, M, j, wt, base, t, add);
  for (; j < J; j += 16) taps_rows<1>(out, ldo, M, j, wt, base, t, add);
}

constexpr int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

struct Shift {
  int64_t Cg, OCg, Wp, plane, L;
  int64_t LR;           // L rounded up to 16: the forward's runs
  int64_t lead, J, LP;  // the input gradient's: zeros before each widened row, positions (rounded up to 16), row length
  explicit Shift(const Window2d& w)
      : Cg(w.C / w.groups), OCg(w.OC / w.groups), Wp(w.W + 2 * w.padding), plane((w.H + 2 * w.padding) * Wp),
        L(w.OH * Wp), LR(round16(L)), lead((w.KH - 1) * Wp + w.KW - 1), J(round16((w.H - 1) * Wp + w.W)),
        LP(lead + std::max(L, w.padding * Wp + w.padding + J)) {}
  // The forward's: the padded planes and zeros past them for the last runs, then the wide output.
  int64_t slack(const Window2d& w) const { return w.KW - 1 + LR - L; }
  int64_t forward_lane(const Window2d& w) const { return Cg * plane + slack(w) + OCg * LR; }
  // The input gradient's: the widened output gradient, then the padded input positions' sums.
  int64_t input_lane() const { return OCg * LP + Cg * J; }
  // The weight gradient's, summed in tiles over planes of 1024 positions and more (where the
  // tiles' final adds across their vectors' lanes are a small part), is the forward's: the
  // padded planes, then the widened gradient. Over smaller planes it is im2col's.
  bool tiled_weight_grad() const { return LR >= 1024; }
  int64_t lane(const Window2d& w) const { return std::max(forward_lane(w), input_lane()); }
};

}  // namespace

bool shifted(const Window2d& w) {
  return w.stride == 1 && !pointwise(w) && w.C / w.groups >= 16 && w.C / w.groups * w.KH * w.KW <= 1152 &&
         w.OW >= 4 * (w.KW - 1) && Shift(w).lane(w) <= columns(w);
}

// Its weight gradient summed in tiles (planes of 1024 positions and more), else by im2col's GEMMs.
bool shifted_weight_tiles(const Window2d& w) { return Shift(w).tiled_weight_grad(); }

// Every lane's, and room for im2col's weight gradient where that runs.
int64_t shifted_cols(const Window2d& w) {
  const Shift s(w);
  return std::max(conv_lanes(w) * s.lane(w), s.tiled_weight_grad() ? 0 : columns(w));
}

namespace {

// Channel c's plane zero-padded to (Hp, Wp) at `to`.
void pad_plane(float* to, const float* in, const Shift& s, const Window2d& w) {
  std::fill(to, to + w.padding * s.Wp, 0.0f);
  for (int64_t h = 0; h < w.H; ++h) {
    float* d = to + (h + w.padding) * s.Wp;
    std::fill(d, d + w.padding, 0.0f);
    std::copy(in + h * w.W, in + (h + 1) * w.W, d + w.padding);
    std::fill(d + w.padding + w.W, d + s.Wp, 0.0f);
  }
  std::fill(to + (w.H + w.padding) * s.Wp, to + s.plane, 0.0f);
}

// Output gradient row oc (OH, OW) in the padded width (OH Wp written), its junk columns
// zero (they meet real input positions in the adjoint).
void widen_row(float* to, const float* from, const Shift& s, const Window2d& w) {
  for (int64_t oh = 0; oh < w.OH; ++oh, from += w.OW, to += s.Wp) {
    std::copy(from, from + w.OW, to);
    std::fill(to + w.OW, to + s.Wp, 0.0f);
  }
}
void widen(float* wide, int64_t row, const float* d, const Shift& s, const Window2d& w) {
  for (int64_t oc = 0; oc < s.OCg; ++oc) widen_row(wide + oc * row, d + oc * w.OH * w.OW, s, w);
}

// body(n, g, lane, inner) for every sample and group. Samples side by side, each thread
// its own lane (inner false); or, with fewer samples than threads (a pipeline's
// micro-batch of one), one after another in the first lane, every thread inside each
// (inner true: the body's loops split their channels and taps_par its positions). Each
// output element is the same sum either way: the same bits for any thread count.
template <class Body>
void each_sample(const Shift& s, const Window2d& w, float* cols, Body body) {
  if (w.N < threads()) {
    for (int64_t n = 0; n < w.N; ++n)
      for (int64_t g = 0; g < w.groups; ++g) body(n, g, cols, true);
    return;
  }
  const int64_t lanes = conv_lanes(w);
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(lanes)) if (lanes > 1)
  for (int64_t n = 0; n < w.N; ++n) {
    float* lane = lane_at(cols, lanes, s.lane(w));
    for (int64_t g = 0; g < w.groups; ++g) body(n, g, lane, false);
  }
}

// Positions a thread's work item takes where threads split a sample's: four 48-wide tiles.
// Each element's sum is the same in any block.
constexpr int64_t kPositionBlock = 192;

// taps_sum, its positions split in blocks across the threads when `inner`.
void taps_par(bool inner, float* out, int64_t ldo, int64_t M, int64_t J, const float* wt, const float* base,
              const Taps& t, bool add = false) {
  if (!inner || J <= kPositionBlock) return taps_sum(out, ldo, M, J, wt, base, t, add);
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < J; j0 += kPositionBlock)
    taps_sum(out + j0, ldo, M, std::min(kPositionBlock, J - j0), wt, base + j0, t, add);
}

}  // namespace

void shifted_forward(float* out, const float* inp, const float* weight, const float* bias, float* cols,
                     const Window2d& w) {
  const Shift s(w);
  const int64_t P = w.OH * w.OW;
  // Taps (kh, c, kw), rows oc: weight (oc, c, kh, kw).
  const Taps taps{w.KH, s.Cg, w.KW, s.Wp, s.plane, 1, w.KW, w.KH * w.KW, 1, s.Cg * w.KH * w.KW};
  each_sample(s, w, cols, [&](int64_t n, int64_t g, float* lane, bool inner) {
    const float* wt = weight + g * s.OCg * s.Cg * w.KH * w.KW;
    float* planes = lane;
    float* wide = lane + s.Cg * s.plane + s.slack(w);
    for_each_index(inner, s.Cg, [&](int64_t c) {
      pad_plane(planes + c * s.plane, inp + (n * w.C + g * s.Cg + c) * w.H * w.W, s, w);
    });
    std::fill(planes + s.Cg * s.plane, wide, 0.0f);
    taps_par(inner, wide, s.LR, s.OCg, s.LR, wt, planes, taps);
    float* o = out + (n * w.OC + g * s.OCg) * P;
    for_each_index(inner, s.OCg, [&](int64_t oc) {
      const float b = bias ? bias[g * s.OCg + oc] : 0.0f;
      for (int64_t oh = 0; oh < w.OH; ++oh) {
        const float* from = wide + oc * s.LR + oh * s.Wp;
        float* to = o + oc * P + oh * w.OW;
        if (bias) {
#pragma omp simd
          for (int64_t ow = 0; ow < w.OW; ++ow) to[ow] = from[ow] + b;
        } else {
          std::copy(from, from + w.OW, to);
        }
      }
    });
  });
}

namespace {

// dw[m][t] (rows ldw apart) += the sum over positions j in [0, J) of g[m][j] (rows ldg
// apart) times base[off[t] + j], for MT rows and NT taps: MT x NT vectors of 16 partial sums
// in registers, each added up in lane order at the end.
template <int MT, int NT>
void grad_tile(float* dw, int64_t ldw, const float* g, int64_t ldg, const float* base, const int64_t* off, int64_t J) {
  v16 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = v16{};
  // The MT gradient vectors held, each tap's run loaded once: MT + NT loads per MT NT
  // multiply-adds. (Left to itself, GCC read every run again for each row, MT NT
  // unaligned loads: 84 against 149 GFLOP/s on 32 channels at 32 x 32, one AVX-512 core.)
  // Each sum's order is the positions' either way: the same bits.
  for (int64_t j = 0; j < J; j += 16) {
    v16 d[MT];
    for (int m = 0; m < MT; ++m) d[m] = *reinterpret_cast<const v16*>(g + m * ldg + j);
    for (int t = 0; t < NT; ++t) {
      v16 in = *reinterpret_cast<const v16*>(base + off[t] + j);
#ifdef __AVX512F__
      asm("" : "+v"(in));  // in a register: else GCC folds the load into each of the MT multiply-adds
#endif
      for (int m = 0; m < MT; ++m) acc[m][t] += d[m] * in;
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < NT; ++t) {
      float sum = 0;
      for (int i = 0; i < 16; ++i) sum += acc[m][t][i];
      dw[m * ldw + t] += sum;
    }
}

// dw (M, T; rows ldw apart) += the tiles' sums over positions [0, J): rows of g (ldg
// apart), tap t's run at base + off(t). Threads split the tiles of MT rows by NT taps:
// each weight's sum the same for any thread count.
template <class Offset>
void grad_tiles(float* dw, int64_t ldw, int64_t M, int64_t T, const float* g, int64_t ldg, const float* base,
                int64_t J, Offset off_of) {
  constexpr int64_t MT = 4, NT = 6;
  const int64_t row_tiles = (M + MT - 1) / MT, tap_tiles = (T + NT - 1) / NT;
  for_each_index(threads_here(), row_tiles * tap_tiles, [&](int64_t tile) {
    const int64_t m0 = tile / tap_tiles * MT, t0 = tile % tap_tiles * NT;
    const int64_t rows = std::min(MT, M - m0), taps = std::min(NT, T - t0);
    std::array<int64_t, NT> off{};
    for (int64_t t = 0; t < taps; ++t) off[t] = off_of(t0 + t);
    float* d = dw + m0 * ldw + t0;
    const float* gm = g + m0 * ldg;
    if (rows == MT && taps == NT) {
      grad_tile<MT, NT>(d, ldw, gm, ldg, base, off.data(), J);
    } else {
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t t = 0; t < taps; ++t) grad_tile<1, 1>(d + m * ldw + t, ldw, gm + m * ldg, ldg, base, &off[t], J);
    }
  });
}

}  // namespace

// The weight gradient: per sample in order (every sum's order), the padded planes and the
// widened output gradient, then tiles of (output channel, tap) sums over the positions:
// threads split the tiles, each weight's sum the same for any thread count. The taps (c, kh,
// kw) are the weights' own order: the sums add to dweight in place.
void shifted_weight_grad(float* dweight, const float* dout, const float* inp, float* cols, const Window2d& w) {
  const Shift s(w);
  const int64_t T = s.Cg * w.KH * w.KW;
  float* planes = cols;
  float* wide = planes + s.Cg * s.plane + s.slack(w);
  std::fill(planes + s.Cg * s.plane, wide, 0.0f);
  for (int64_t n = 0; n < w.N; ++n)
    for (int64_t g = 0; g < w.groups; ++g) {
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < s.Cg; ++c) pad_plane(planes + c * s.plane, inp + (n * w.C + g * s.Cg + c) * w.H * w.W, s, w);
      widen(wide, s.LR, dout + (n * w.OC + g * s.OCg) * w.OH * w.OW, s, w);
      for (int64_t oc = 0; oc < s.OCg; ++oc) std::fill(wide + oc * s.LR + s.L, wide + (oc + 1) * s.LR, 0.0f);
      grad_tiles(dweight + g * s.OCg * T, T, s.OCg, T, wide, s.LR, planes, s.LR, [&](int64_t tap) {
        const int64_t c = tap / (w.KH * w.KW), kh = tap / w.KW % w.KH, kw = tap % w.KW;
        return c * s.plane + kh * s.Wp + kw;
      });
    }
}

// The input gradient: per sample (side by side), padded position p of channel c sums
// w(oc, c, kh, kw) times the output gradient at p - kh Wp - kw over the taps (kh, oc, kw):
// the widened gradient has `lead` zeros before each row and zeros after it, so every tap's
// run is in bounds. The sums cover the real input positions' span of the padded plane.
void shifted_input_grad(float* dinp, const float* dout, const float* weight, float* cols, const Window2d& w,
                        GradMode mode) {
  const Shift s(w);
  // Taps (kh, oc, kw), rows c: weight (oc, c, kh, kw).
  const Taps taps{w.KH, s.OCg, w.KW, -s.Wp, s.LP, -1, w.KW, s.Cg * w.KH * w.KW, 1, w.KH * w.KW};
  const int64_t first = w.padding * s.Wp + w.padding;  // the padded position of input (0, 0)
  each_sample(s, w, cols, [&](int64_t n, int64_t g, float* lane, bool inner) {
    const float* wt = weight + g * s.OCg * s.Cg * w.KH * w.KW;
    float* wide = lane;
    float* sums = lane + s.OCg * s.LP;
    const float* dy = dout + (n * w.OC + g * s.OCg) * w.OH * w.OW;
    for_each_index(inner, s.OCg, [&](int64_t oc) {
      float* row = wide + oc * s.LP;
      std::fill(row, row + s.lead, 0.0f);
      widen_row(row + s.lead, dy + oc * w.OH * w.OW, s, w);
      std::fill(row + s.lead + s.L, row + s.LP, 0.0f);
    });
    taps_par(inner, sums, s.J, s.Cg, s.J, wt, wide + s.lead + first, taps);
    for_each_index(inner, s.Cg, [&](int64_t c) {
      float* dx = dinp + (n * w.C + g * s.Cg + c) * w.H * w.W;
      const float* from = sums + c * s.J;
      for (int64_t h = 0; h < w.H; ++h) {
        float* d = dx + h * w.W;
        const float* r = from + h * s.Wp;
        if (mode == GradMode::overwrite) {
          std::copy(r, r + w.W, d);
        } else {
#pragma omp simd
          for (int64_t x = 0; x < w.W; ++x) d[x] += r[x];
        }
      }
    });
  });
}

// ---- pointwise windows: the same tiles, the input planes themselves the runs ----
// Tap c of output position p reads channel c's plane at p: no padding, no junk columns,
// no scratch, where the planes are whole vectors (positions a multiple of 16).

bool pointwise_tiled(const Window2d& w) {
  return pointwise(w) && (w.OH * w.OW) % 16 == 0 && w.C / w.groups <= 1152;
}

bool pointwise_weight_tiles(const Window2d& w) { return w.OH * w.OW >= 1024; }

namespace {

// body(n, g, j0, J) for every sample, group and block of positions [j0, j0 + J), threads
// splitting them all: every output element is one tile's sum whatever the thread count,
// and one sample on many threads still runs on all of them.
template <class Body>
void each_block(const Window2d& w, Body body) {
  const int64_t P = w.OH * w.OW, blocks = (P + kPositionBlock - 1) / kPositionBlock;
#pragma omp parallel for schedule(static) if (threads() > 1)
  for (int64_t item = 0; item < w.N * w.groups * blocks; ++item) {
    const int64_t b = item % blocks, ng = item / blocks, j0 = b * kPositionBlock;
    body(ng / w.groups, ng % w.groups, j0, std::min(kPositionBlock, P - j0));
  }
}

}  // namespace

void pointwise_forward(float* out, const float* inp, const float* weight, const float* bias, const Window2d& w) {
  const int64_t Cg = w.C / w.groups, OCg = w.OC / w.groups, P = w.OH * w.OW;
  const Taps taps{1, Cg, 1, 0, P, 0, 0, 1, 0, Cg};  // taps c, rows oc: weight (oc, c)
  each_block(w, [&](int64_t n, int64_t g, int64_t j0, int64_t J) {
    float* o = out + (n * w.OC + g * OCg) * P + j0;
    taps_sum(o, P, OCg, J, weight + g * OCg * Cg, inp + (n * w.C + g * Cg) * P + j0, taps);
    if (!bias) return;
    for (int64_t oc = 0; oc < OCg; ++oc) {
      const float b = bias[g * OCg + oc];
      float* row = o + oc * P;
#pragma omp simd
      for (int64_t j = 0; j < J; ++j) row[j] = row[j] + b;
    }
  });
}

void pointwise_input_grad(float* dinp, const float* dout, const float* weight, const Window2d& w, GradMode mode) {
  const int64_t Cg = w.C / w.groups, OCg = w.OC / w.groups, P = w.OH * w.OW;
  const Taps taps{1, OCg, 1, 0, P, 0, 0, Cg, 0, 1};  // taps oc, rows c: weight (oc, c)
  each_block(w, [&](int64_t n, int64_t g, int64_t j0, int64_t J) {
    taps_sum(dinp + (n * w.C + g * Cg) * P + j0, P, Cg, J, weight + g * OCg * Cg, dout + (n * w.OC + g * OCg) * P + j0,
             taps, mode == GradMode::accumulate);
  });
}

// Per sample in order, tiles of (output channel, input channel) sums over the positions
// (grad_tiles, as the shifted path's).
void pointwise_weight_grad(float* dweight, const float* dout, const float* inp, const Window2d& w) {
  const int64_t Cg = w.C / w.groups, OCg = w.OC / w.groups, P = w.OH * w.OW;
  for (int64_t n = 0; n < w.N; ++n)
    for (int64_t g = 0; g < w.groups; ++g)
      grad_tiles(dweight + g * OCg * Cg, Cg, OCg, Cg, dout + (n * w.OC + g * OCg) * P, P, inp + (n * w.C + g * Cg) * P, P,
                 [P](int64_t c) { return c * P; });
}

}  // namespace mpipe::cpu::conv_parts
