// The op-kind profile of one step (op_profile.hpp).
#include "mpipe/backend/op_profile.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <thread>
#include <vector>

#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/error.hpp"

namespace mpipe::ops {

namespace {

using Clock = std::chrono::steady_clock;

// The profile's state. Written by the profiling thread only (begin, the timers, end);
// `active` is what every other thread's timers read, and they read it alone.
struct Profile {
  std::atomic<bool> active{false};
  std::thread::id thread;
  Device device = Device::cpu;
  int depth = 0;  // timers open on the profiling thread: only the outermost one counts
  OpTimes times;
  bool prepared = false;
  // CPU: the open timer's start (one counts at a time). GPU: an event pair per timed
  // call, its kind and its name.
  Clock::time_point started;
  std::vector<cuda::Event> starts, ends;
  std::vector<OpKind> kinds;
  std::vector<const char*> names;
  int used = 0;
};

Profile& profile() {
  static Profile p;
  return p;
}

// Adds a call's time to its name's entry (the same function, the same pointer).
void add_named(OpTimes& t, const char* name, double seconds) {
  for (int i = 0; i < t.named; ++i)
    if (t.ops[static_cast<std::size_t>(i)].name == name) {
      t.ops[static_cast<std::size_t>(i)].seconds += seconds;
      ++t.ops[static_cast<std::size_t>(i)].calls;
      return;
    }
  if (t.named == kNamedOps) return;
  t.ops[static_cast<std::size_t>(t.named++)] = NamedTime{name, seconds, 1};
}

}  // namespace

const char* name(OpKind kind) {
  switch (kind) {
    case OpKind::gemm: return "GEMM";
    case OpKind::attention: return "attention";
    case OpKind::convolution: return "convolution";
    case OpKind::normalization: return "normalization";
    case OpKind::elementwise: return "elementwise";
    case OpKind::loss: return "loss";
    case OpKind::optimizer: return "optimizer";
    case OpKind::copy: return "copies";
  }
  return "?";
}

double OpTimes::total() const { return std::accumulate(seconds.begin(), seconds.end(), 0.0); }

std::vector<NamedTime> OpTimes::top(int count) const {
  std::vector<NamedTime> sorted(ops.begin(), ops.begin() + named);
  // Ties keep the order of first call.
  std::stable_sort(sorted.begin(), sorted.end(), [](const NamedTime& a, const NamedTime& b) { return a.seconds > b.seconds; });
  if (static_cast<int>(sorted.size()) > count) sorted.resize(static_cast<std::size_t>(count));
  return sorted;
}

void OpProfile::prepare(Device device, int ops) {
  Profile& p = profile();
  p.device = device;
  p.prepared = true;
  p.kinds.assign(static_cast<std::size_t>(ops), OpKind::gemm);
  p.names.assign(static_cast<std::size_t>(ops), nullptr);
  if (device == Device::cuda) {
    p.starts.clear();
    p.ends.clear();
    p.starts.reserve(static_cast<std::size_t>(ops));
    p.ends.reserve(static_cast<std::size_t>(ops));
    for (int i = 0; i < ops; ++i) {
      p.starts.emplace_back(true);
      p.ends.emplace_back(true);
    }
  }
}

void OpProfile::begin() {
  Profile& p = profile();
  MPIPE_CHECK(p.prepared, "OpProfile::begin() before prepare()");
  p.thread = std::this_thread::get_id();
  p.depth = 0;
  p.used = 0;
  p.times = OpTimes{};
  p.active.store(true, std::memory_order_release);
}

bool OpProfile::active() { return profile().active.load(std::memory_order_acquire); }

OpTimes OpProfile::end() {
  Profile& p = profile();
  p.active.store(false, std::memory_order_release);
  if (p.device == Device::cuda) {
    if (p.used > 0) p.ends[static_cast<std::size_t>(p.used - 1)].synchronize();
    for (int i = 0; i < p.used; ++i) {
      const auto at = static_cast<std::size_t>(i);
      const double seconds = cuda::seconds_between(p.starts[at], p.ends[at]);
      p.times.seconds[static_cast<std::size_t>(p.kinds[at])] += seconds;
      add_named(p.times, p.names[at], seconds);
    }
  }
  return p.times;
}

OpTimer::OpTimer(OpKind kind, const char* name) noexcept : name_(name) {
  Profile& p = profile();
  if (!p.active.load(std::memory_order_acquire) || std::this_thread::get_id() != p.thread) return;
  if (p.depth++ > 0) {
    slot_ = -2;  // nested: counted by the outer timer
    return;
  }
  const auto k = static_cast<std::size_t>(kind);
  ++p.times.calls[k];
  if (p.device == Device::cpu) {
    slot_ = static_cast<int>(k);
    p.started = Clock::now();
    return;
  }
  if (p.used >= static_cast<int>(p.starts.size())) {
    ++p.times.untimed;
    slot_ = -2;
    return;
  }
  try {
    p.starts[static_cast<std::size_t>(p.used)].record(cuda::StreamKind::compute);
    p.kinds[static_cast<std::size_t>(p.used)] = kind;
    p.names[static_cast<std::size_t>(p.used)] = name;
    slot_ = p.used;
  } catch (const std::exception&) {
    ++p.times.untimed;  // the op itself will say what is wrong with the GPU
    slot_ = -2;
  }
}

OpTimer::~OpTimer() {
  if (slot_ == -1) return;
  Profile& p = profile();
  --p.depth;
  if (slot_ == -2) return;
  if (p.device == Device::cpu) {
    const double seconds = std::chrono::duration<double>(Clock::now() - p.started).count();
    p.times.seconds[static_cast<std::size_t>(slot_)] += seconds;
    add_named(p.times, name_, seconds);
    return;
  }
  try {
    p.ends[static_cast<std::size_t>(slot_)].record(cuda::StreamKind::compute);
    ++p.used;
  } catch (const std::exception&) {
    ++p.times.untimed;
  }
}

}  // namespace mpipe::ops
