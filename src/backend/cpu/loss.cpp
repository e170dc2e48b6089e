// CPU softmax cross-entropy and accuracy over classes: rows of logits (N, V), or planes
// (outer, V, plane) with a label per position (a per-pixel loss reads (N, C, H, W) as it
// lies, no transposes). Each row's arithmetic is the same in both layouts, in the same
// order: the maximum, then e^(x - max) summed over the classes in 16 running sums (kSums),
// then max + log(sum); the exponentials through vmath.hpp's exp_clamped, which the loops
// below compute 8 or 16 at a time (libm's expf is a call per element: 2.8 ns each here).
#include <algorithm>
#include <cmath>

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cpu/vmath.hpp"
#include "mpipe/core/error.hpp"

namespace mpipe::cpu {

namespace {

// Rows are taken this many values at a time: their exponentials computed together (the
// loop vectorises), then added to the running sums.
constexpr int64_t kChunk = 256;
// Positions of a plane taken together, each lane one position's row.
constexpr int64_t kLanes = 256;
// A row's exponentials are added in this many running sums: class i into sum i mod 16,
// each from zero in class order; then the sums are added pairwise, the upper half onto
// the lower (8, then 4, 2 and 1 apart). A serial sum took 4 cycles a class (an add's
// latency): 28 of the 34 ms of a 50257-word GPT's loss, 512 rows, one thread.
constexpr int64_t kSums = 16;

void check_targets(const int32_t* targets, int64_t rows, int64_t V) {
  for (int64_t n = 0; n < rows; ++n)
    MPIPE_CHECK(targets[n] >= 0 && targets[n] < V, "target ", targets[n], " outside ", V, " classes");
}

// One contiguous row of V: its log-sum-exp. The maximum over 16 lanes (exact: the same
// value in any order).
float row_lse(const float* row, int64_t V) {
  float lanes[kSums];
  std::fill(lanes, lanes + kSums, row[0]);
  int64_t i = 0;
  for (; i + kSums <= V; i += kSums)
#pragma omp simd
    for (int64_t j = 0; j < kSums; ++j) lanes[j] = std::max(lanes[j], row[i + j]);
  float mx = *std::max_element(lanes, lanes + kSums);
  for (; i < V; ++i) mx = std::max(mx, row[i]);
  // The sums of classes past the row's end (fewer than 16 classes) stay zero: adding them
  // changes nothing (every sum is positive), as plane_lse's skipping them.
  float e[kChunk], sums[kSums] = {};
  for (int64_t i0 = 0; i0 < V; i0 += kChunk) {  // i0 is a multiple of 16: e[k] is class k's sum's
    const int64_t n = std::min(kChunk, V - i0);
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) e[k] = exp_clamped(row[i0 + k] - mx);
    int64_t k = 0;
    for (; k + kSums <= n; k += kSums)
#pragma omp simd
      for (int64_t j = 0; j < kSums; ++j) sums[j] += e[k + j];
    for (; k < n; ++k) sums[k % kSums] += e[k];
  }
  for (int64_t half = kSums / 2; half >= 1; half /= 2)
    for (int64_t j = 0; j < half; ++j) sums[j] += sums[j + half];
  return mx + std::log(sums[0]);
}

// Positions [p0, p0 + n) of one plane block x (V, plane): their log-sum-exps into lse,
// each row's arithmetic row_lse's. The exponentials are stored before they are added, as
// row_lse's are: never a fused multiply-add of exp_clamped's last product into a sum.
void plane_lse(float* lse, const float* x, int64_t V, int64_t plane, int64_t p0, int64_t n) {
  float mx[kLanes], e[kLanes], sums[kSums][kLanes];
  std::copy(x + p0, x + p0 + n, mx);
  for (int64_t c = 1; c < V; ++c) {
    const float* xc = x + c * plane + p0;
#pragma omp simd
    for (int64_t p = 0; p < n; ++p) mx[p] = std::max(mx[p], xc[p]);
  }
  for (int64_t c = 0; c < V; ++c) {
    const float* xc = x + c * plane + p0;
#pragma omp simd
    for (int64_t p = 0; p < n; ++p) e[p] = exp_clamped(xc[p] - mx[p]);
    float* sum = sums[c % kSums];
    if (c < kSums) {
      std::copy(e, e + n, sum);  // 0 + e: e
    } else {
      for (int64_t p = 0; p < n; ++p) sum[p] += e[p];
    }
  }
  int64_t present = std::min(V, kSums);  // the sums holding classes
  for (int64_t half = kSums / 2; half >= 1; half /= 2) {
    for (int64_t j = 0; j < half && j + half < present; ++j)
      for (int64_t p = 0; p < n; ++p) sums[j][p] += sums[j + half][p];
    present = std::min(present, half);
  }
  for (int64_t p = 0; p < n; ++p) lse[p0 + p] = mx[p] + std::log(sums[0][p]);
}

}  // namespace

double crossentropy_forward(float* lse, const float* logits, const int32_t* targets, int64_t outer, int64_t V,
                            int64_t plane) {
  const int64_t rows = outer * plane;
  check_targets(targets, rows, V);
  if (plane == 1) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; ++n) lse[n] = row_lse(logits + n * V, V);
  } else {
    const int64_t tiles = (plane + kLanes - 1) / kLanes;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t t = 0; t < tiles; ++t)
        plane_lse(lse + o * plane, logits + o * V * plane, V, plane, t * kLanes, std::min(kLanes, plane - t * kLanes));
  }
  double loss = 0.0;
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t o = n / plane, p = n % plane;
    loss += static_cast<double>(lse[n]) - logits[(o * V + targets[n]) * plane + p];
  }
  return loss;
}

void crossentropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets, float scale,
                           int64_t outer, int64_t V, int64_t plane) {
  if (plane == 1) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < outer; ++n) {
      const float* row = logits + n * V;
      float* d = dlogits + n * V;
      const float l = lse[n];
#pragma omp simd
      for (int64_t i = 0; i < V; ++i) d[i] = scale * exp_clamped(row[i] - l);
      d[targets[n]] -= scale;
    }
    return;
  }
  // Every (sample, class) plane a work item (a micro-batch of one sample uses every
  // thread), then the targets' entries.
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t c = 0; c < V; ++c) {
      const float* l = lse + o * plane;
      const float* x = logits + (o * V + c) * plane;
      float* d = dlogits + (o * V + c) * plane;
#pragma omp simd
      for (int64_t p = 0; p < plane; ++p) d[p] = scale * exp_clamped(x[p] - l[p]);
    }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < outer * plane; ++n) dlogits[((n / plane) * V + targets[n]) * plane + n % plane] -= scale;
}

int64_t count_correct(const float* logits, const int32_t* targets, int64_t outer, int64_t V, int64_t plane) {
  int64_t correct = 0;
#pragma omp parallel for schedule(static) reduction(+ : correct)
  for (int64_t n = 0; n < outer * plane; ++n) {
    const float* row = logits + (n / plane) * V * plane + n % plane;  // entry c at row[c * plane]
    int64_t arg = 0;
    for (int64_t c = 1; c < V; ++c)
      if (row[c * plane] > row[arg * plane]) arg = c;  // the first of equal largest
    correct += arg == targets[n] ? 1 : 0;
  }
  return correct;
}

}  // namespace mpipe::cpu
