// A rank's record of its steps: the seconds of each phase (the phase table and the
// bubble) and, for --trace, the start and end of every action, transfer and sum. Traced
// events are reserved once and never grow a vector in a step.
#pragma once
#include <chrono>
#include <cstdint>
#include <vector>

#include "mpipe/pipeline/run/step_device.hpp"

namespace mpipe {

// One timed action of one rank, for --trace. Plain data: gathered with MPI as bytes.
// Compute and waits are the rank's own track; transfers (a send from posting to
// completion, a gradient sum from its start to its end) go on its communication track,
// where they overlap the compute.
struct TraceEvent {
  enum Kind : std::int16_t { forward, backward, recompute, send_act, recv_act, send_grad, recv_grad, send_wait,
                             allreduce, optimizer, gradient_sum, tied_sum, weight, count };
  static const char* name(int kind);
  static bool communication(int kind) {
    return kind == send_act || kind == send_grad || kind == gradient_sum || kind == tied_sum;
  }
  double start = 0, end = 0;  // seconds since the run's common start
  std::int32_t step = 0;
  std::int16_t kind = 0;
  std::int16_t micro_batch = -1;
  std::int32_t layer = -1;    // of a gradient sum
  std::int32_t stage = -1;    // the model stage of a micro-batch's action, with virtual stages
};

// Seconds one rank spent in each phase of a step.
struct PhaseTimes {
  static constexpr int count = 8;
  static const char* name(int i);
  double forward = 0, backward = 0, recompute = 0, p2p_wait = 0, allreduce = 0, optimizer = 0, idle = 0, step = 0;
  double weight = 0;  // the part of backward spent in W actions (split schedules); not a phase of its own
  double operator[](int i) const {
    const double all[count] = {forward, backward, recompute, p2p_wait, allreduce, optimizer, idle, step};
    return all[i];
  }
  double compute() const { return forward + backward + recompute; }
};

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;
  // Steps 1 .. trace_steps are traced, at most `events` events in all (0: no trace).
  void reserve(std::size_t events, int trace_steps);
  // A common time origin: the caller has every rank leave a barrier just before.
  void start_clock() { origin_ = Clock::now(); }

  PhaseTimes& times() { return times_; }
  const PhaseTimes& times() const { return times_; }
  // A quiet stretch (an evaluation): nothing traced, and the phase times as they were
  // before it once it ends.
  void begin_quiet();
  void end_quiet();

  // `kind` from `start` to `end` in `step`, on the trace; a micro-batch's action carries
  // its model stage (-1 without virtual stages), a gradient sum its layer.
  void record(std::int64_t step, int kind, int micro_batch, Clock::time_point start, Clock::time_point end = Clock::now(),
              int layer = -1, int stage = -1);
  // A compute action's seconds into its phase.
  void account(int kind, double seconds);
  // The compute actions the device timed in this step (a GPU's): into their phases and
  // on the trace.
  void read_device(std::int64_t step, const StepDevice& device);
  // The step took `seconds`: what no phase accounts for is idle.
  void close(double seconds);
  const std::vector<TraceEvent>& events() const { return events_; }

 private:
  bool tracing(std::int64_t step) const {
    return !quiet_ && step >= 1 && step <= trace_steps_ && events_.size() < events_.capacity();
  }
  PhaseTimes times_, saved_;
  std::vector<TraceEvent> events_;
  int trace_steps_ = 0;
  bool quiet_ = false;
  Clock::time_point origin_ = Clock::now();
};

}  // namespace mpipe
