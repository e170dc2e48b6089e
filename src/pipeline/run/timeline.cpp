// A rank's phase times per step and its trace events.
#include "mpipe/pipeline/run/timeline.hpp"

#include <algorithm>

namespace mpipe {

const char* TraceEvent::name(int kind) {
  static const char* names[count] = {"forward",       "backward",      "recompute", "send activation",
                                     "wait activation", "send gradient", "wait gradient", "wait sends",
                                     "allreduce",     "optimizer",     "gradient sum", "tied-weight sum",
                                     "weight gradient"};
  return names[kind];
}

const char* PhaseTimes::name(int i) {
  static const char* names[count] = {"forward", "backward", "recompute", "p2p wait", "allreduce", "optimizer", "idle", "step"};
  return names[i];
}

void Timeline::reserve(std::size_t events, int trace_steps) {
  trace_steps_ = trace_steps;
  events_.clear();
  events_.reserve(trace_steps > 0 ? events : 0);
}

void Timeline::begin_quiet() {
  saved_ = times_;
  quiet_ = true;
}

void Timeline::end_quiet() {
  quiet_ = false;
  times_ = saved_;
}

void Timeline::record(std::int64_t step, int kind, int micro_batch, Clock::time_point start, Clock::time_point end,
                      int layer, int stage) {
  if (!tracing(step)) return;
  TraceEvent e;
  e.start = std::chrono::duration<double>(start - origin_).count();
  e.end = std::chrono::duration<double>(end - origin_).count();
  e.step = static_cast<std::int32_t>(step);
  e.kind = static_cast<std::int16_t>(kind);
  e.micro_batch = static_cast<std::int16_t>(micro_batch);
  e.layer = layer;
  if (micro_batch >= 0) e.stage = stage;
  events_.push_back(e);
}

void Timeline::account(int kind, double seconds) {
  (kind == TraceEvent::forward     ? times_.forward
   : kind == TraceEvent::recompute ? times_.recompute
                                   : times_.backward) += seconds;
  if (kind == TraceEvent::weight) times_.weight += seconds;
}

void Timeline::read_device(std::int64_t step, const StepDevice& device) {
  const double at = std::chrono::duration<double>(device.origin() - origin_).count();
  for (const StepDevice::Timed& t : device.timed()) {
    account(t.kind, t.end - t.start);
    if (!tracing(step)) continue;
    TraceEvent e;
    e.start = at + t.start;
    e.end = at + t.end;
    e.step = static_cast<std::int32_t>(step);
    e.kind = static_cast<std::int16_t>(t.kind);
    e.micro_batch = static_cast<std::int16_t>(t.micro_batch);
    e.stage = t.stage;
    events_.push_back(e);
  }
}

void Timeline::close(double seconds) {
  times_.step = seconds;
  times_.idle = std::max(0.0, seconds - (times_.compute() + times_.p2p_wait + times_.allreduce + times_.optimizer));
}

}  // namespace mpipe
