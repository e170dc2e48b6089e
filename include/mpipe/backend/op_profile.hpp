// Where a step's time goes by kind of op (train --profile-ops STEP): every Tensor op
// (ops.hpp, conv_ops.hpp) and the optimizer's update carry an OpTimer of their kind, which
// between OpProfile::begin() and end() adds the op's time to its kind's total: on the CPU
// the wall time of the call, on a GPU the time between CUDA events recorded around its
// launches on the compute stream (the GPU's own time, not the launch's). Outside a
// profile a timer costs one load and a branch. Only the thread that called begin() is
// timed (a reader thread's conversions are not the step's), and an op called inside
// another counts once, in the outer one's kind. Each op's time is also kept by its name
// (the function's), for the ops that take the most.
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "mpipe/core/tensor.hpp"

namespace mpipe::ops {

enum class OpKind : int { gemm, attention, convolution, normalization, elementwise, loss, optimizer, copy };
inline constexpr int kOpKinds = 8;
// "GEMM", "attention", ...: a column's name.
const char* name(OpKind kind);

// One op's time by name: `name` is a string with static storage (its function's __func__).
struct NamedTime {
  const char* name = nullptr;
  double seconds = 0;
  std::int64_t calls = 0;
};
inline constexpr int kNamedOps = 64;  // names kept; ops past them count in their kind only

struct OpTimes {
  std::array<double, kOpKinds> seconds{};
  std::array<std::int64_t, kOpKinds> calls{};
  std::array<NamedTime, kNamedOps> ops{};  // in order of first call
  int named = 0;
  std::int64_t untimed = 0;  // GPU ops past the events prepare() made (their time is missing)
  double total() const;
  // The `count` named ops that took the most time, most first.
  std::vector<NamedTime> top(int count) const;
};

class OpProfile {
 public:
  // Before the step loop: on a GPU, the CUDA events for up to `ops` timed calls (made
  // here, so the profiled step allocates nothing).
  static void prepare(Device device, int ops = 32768);
  // From now on, this thread's ops are timed.
  static void begin();
  // Stops timing and returns the totals since begin() (on a GPU after waiting for the
  // compute stream, so every timed op has run).
  static OpTimes end();
  // Between begin() and end(): a profiled step (its GPU ops are timed by events, which a
  // CUDA graph cannot hold: its actions are not graphed).
  static bool active();
};

class OpTimer {
 public:
  // `name`: a string with static storage, the op's (its function's __func__).
  OpTimer(OpKind kind, const char* name) noexcept;
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;
  ~OpTimer();

 private:
  int slot_ = -1;  // this call's record in the profile, or -1: not timed
  const char* name_;
};

}  // namespace mpipe::ops
