// Communication progress: a thread (or the compute loop) that tests posted requests.
#include "mpipe/pipeline/comm/progress.hpp"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <string_view>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "mpipe/core/error.hpp"
#include "mpipe/core/run_clock.hpp"
#include "mpipe/pipeline/comm/comm.hpp"

namespace mpipe {

namespace {
// A sweep this long moved data (see sweep()); a wait keeps sweeping without pause until
// data has not moved for keep_sweeping.
constexpr std::chrono::microseconds busy_sweep{5}, keep_sweeping{200};
}  // namespace

const char* to_string(ProgressMode mode) {
  switch (mode) {
    case ProgressMode::automatic: return "auto";
    case ProgressMode::thread: return "thread";
    case ProgressMode::layers: return "layers";
    case ProgressMode::waits: return "waits";
  }
  return "?";
}

ProgressMode parse_progress_mode(const std::string& name) {
  for (ProgressMode m : {ProgressMode::automatic, ProgressMode::thread, ProgressMode::layers, ProgressMode::waits})
    if (name == to_string(m)) return m;
  throw UserError(cat("unknown --comm-progress '", name, "'"), "use --comm-progress auto, thread, layers or waits");
}

std::string shared_memory_single_copy() {
  // The level MPI runs at: Open MPI's MPI_T_init_thread sets the process's level to the one
  // it is asked for (a lower one would leave the progress thread without MPI's locks).
  int level = MPI_THREAD_SINGLE, provided = 0;
  MPI_Query_thread(&level);
  if (MPI_T_init_thread(level, &provided) != MPI_SUCCESS) return "";
  std::string found;
  int count = 0;
  MPI_T_cvar_get_num(&count);
  for (int i = 0; i < count && found.empty(); ++i) {
    char name[256], description[16];
    int name_len = sizeof name, description_len = sizeof description, verbosity = 0, bind = 0, scope = 0;
    MPI_Datatype type = MPI_DATATYPE_NULL;
    MPI_T_enum values = MPI_T_ENUM_NULL;
    if (MPI_T_cvar_get_info(i, name, &name_len, &verbosity, &type, &values, description, &description_len, &bind,
                            &scope) != MPI_SUCCESS)
      continue;
    const std::string_view n(name);
    if (n != "btl_vader_single_copy_mechanism" && n != "btl_sm_single_copy_mechanism") continue;
    MPI_T_cvar_handle handle{};
    int elements = 0, value = -1;
    if (type != MPI_INT || MPI_T_cvar_handle_alloc(i, nullptr, &handle, &elements) != MPI_SUCCESS) continue;
    const bool read = elements == 1 && MPI_T_cvar_read(handle, &value) == MPI_SUCCESS;
    MPI_T_cvar_handle_free(&handle);
    if (!read) continue;
    found = cat("value ", value);  // an enumerator without a name
    int items = 0;
    char enum_name[64];
    int enum_name_len = sizeof enum_name;
    if (values != MPI_T_ENUM_NULL && MPI_T_enum_get_info(values, &items, enum_name, &enum_name_len) == MPI_SUCCESS)
      for (int k = 0; k < items; ++k) {
        char item[64];
        int item_len = sizeof item, item_value = 0;
        if (MPI_T_enum_get_item(values, k, &item_value, item, &item_len) == MPI_SUCCESS && item_value == value)
          found = item;
      }
  }
  MPI_T_finalize();
  return found;
}

ProgressChoice decide_progress(bool on_gpu, int ranks, int ranks_on_node, const std::string& single_copy) {
  auto thread = [](std::string why) { return ProgressChoice{ProgressMode::thread, cat("auto chose thread, ", why)}; };
  if (ranks == 1) return {ProgressMode::layers, "auto chose layers, one rank: no messages"};
  if (on_gpu) return thread("GPU ranks, whose host waits on the GPU");
  if (ranks_on_node < ranks) return thread(cat(ranks - ranks_on_node, " of ", ranks, " ranks on other nodes"));
  if (single_copy != "cma" && single_copy != "xpmem" && single_copy != "knem")
    return thread(single_copy.empty() ? "no shared-memory single-copy found"
                                      : cat("shared memory without single-copy (", single_copy, ")"));
  return {ProgressMode::layers,
          cat("auto chose layers, every rank on one node with shared memory by single-copy (", single_copy, ")")};
}

ProgressChoice choose_progress(ProgressMode requested, const Communicator& world, bool on_gpu) {
  if (requested != ProgressMode::automatic) return {requested, {}};
  const int on_node = Communicator::node(world).size();  // collective: every rank asks
  return decide_progress(on_gpu, world.size(), on_node, shared_memory_single_copy());
}

int Progress::thread_level() {
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  return level;
}

Progress::Progress(ProgressMode mode, double poll_interval_s, int capacity, bool spin_waits,
                   std::function<void()> on_thread_start, std::string why)
    : mode_(mode), interval_(std::llround(poll_interval_s * 1e9)), spin_waits_(spin_waits), why_(std::move(why)) {
  MPIPE_CHECK(capacity > 0 && poll_interval_s >= 0, "capacity ", capacity, ", poll interval ", poll_interval_s);
  MPIPE_CHECK(mode != ProgressMode::automatic, "--comm-progress auto is resolved by choose_progress()");
  const auto n = static_cast<std::size_t>(capacity);
  slots_.resize(n);
  free_.reserve(n);
  for (int id = capacity - 1; id >= 0; --id) free_.push_back(id);
  incoming_.reserve(n);
  live_.assign(n, MPI_REQUEST_NULL);
  live_slot_.assign(n, 0);
  indices_.assign(n, 0);
  statuses_.resize(n);
  if (mode_ != ProgressMode::thread) return;
  if (thread_level() < MPI_THREAD_MULTIPLE) {
    mode_ = ProgressMode::layers;
    fallback_ = "MPI was not initialised with MPI_THREAD_MULTIPLE";
    return;
  }
  thread_ = std::thread([this, start = std::move(on_thread_start)] {
    try {
      if (start) start();
      run();
    } catch (const std::exception& e) {
      // A broken progress thread must not hang the waits: they report this instead.
      std::lock_guard lock(mutex_);
      failure_ = cat("the communication progress thread failed: ", e.what());
    }
  });
}

Progress::~Progress() {
  if (thread_.joinable()) {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_.notify_all();
    thread_.join();
  }
  cancel_remaining();
}

std::string Progress::waits() const {
  return spin_waits_ ? "waits test without pause (--comm-wait spin)"
                     : "waits test while data moves, then sleep between tests";
}

double Progress::thread_cpu_seconds() const {
  if (!thread_.joinable()) return 0;
  clockid_t clock{};
  timespec t{};
  // const_cast: native_handle() is not const, and reads nothing it changes.
  if (pthread_getcpuclockid(const_cast<std::thread&>(thread_).native_handle(), &clock) != 0 || clock_gettime(clock, &t) != 0) return 0;
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

void set_mpi_transfer_defaults() {
  ::setenv("OMPI_MCA_pml_ob1_send_pipeline_depth", std::to_string(send_pipeline_depth).c_str(), /*overwrite=*/0);
}

std::string Progress::describe() const {
  const char* depth = std::getenv("OMPI_MCA_pml_ob1_send_pipeline_depth");
  return (why_.empty() ? "" : why_ + ": ") + describe_mode() + (depth ? cat("; pml_ob1_send_pipeline_depth ", depth) : "");
}

std::string Progress::describe_mode() const {
  switch (mode_) {
    case ProgressMode::thread:
      return cat("posted messages are tested between layers and by a progress thread every ",
                 std::chrono::duration<double, std::micro>(interval_).count(), " us, at once while data moves; ",
                 waits());
    case ProgressMode::layers:
      return cat("posted messages are tested between layers and actions",
                 fallback_.empty() ? "" : cat(" (no progress thread: ", fallback_, ")"), "; ", waits());
    case ProgressMode::waits: return "posted messages move only while a rank waits (MPI's own progress)";
    case ProgressMode::automatic: break;
  }
  return "";
}

Progress::Ticket Progress::track(MPI_Request request, bool cancellable, bool wake) {
  std::unique_lock lock(mutex_);
  MPIPE_CHECK(!free_.empty(), "more than ", slots_.size(), " requests in flight");
  const Ticket id = free_.back();
  free_.pop_back();
  Slot& s = slots_[static_cast<std::size_t>(id)];
  s = Slot{};
  s.request = request;
  s.cancellable = cancellable;
  s.in_use = true;
  s.posted = Clock::now();
  if (request == MPI_REQUEST_NULL) {
    s.done = true;
    s.completed = s.posted;
    return id;
  }
  incoming_.push_back(id);
  ++pending_;
  posted_ = true;
  wake = wake && wake_wanted();
  lock.unlock();
  if (wake) work_.notify_one();
  return id;
}

bool Progress::wake_wanted() const {
  // While a caller waits the thread stays aside (and the waiter sweeps): waking it would
  // only cost two context switches on the rank's core, several per sum. So while the
  // compute loop sweeps densely. A post asks it, and so does the last waiter's leaving
  // (only then can the thread have work).
  return mode_ == ProgressMode::thread && waiters_ == 0 && pending_ > 0 && !dense();
}

void Progress::loop_swept(bool timed) {
  const Clock::rep now = Clock::now().time_since_epoch().count();
  if (timed) {
    constexpr Clock::rep cap = std::chrono::nanoseconds(std::chrono::milliseconds(10)).count();
    const Clock::rep gap = std::min(now - loop_swept_.load(std::memory_order_relaxed), cap);
    const Clock::rep mean = loop_gap_.load(std::memory_order_relaxed);
    loop_gap_.store(mean + (gap - mean) / 8, std::memory_order_relaxed);
  }
  loop_swept_.store(now, std::memory_order_relaxed);
}

bool Progress::dense() const {
  return leave_dense_.load(std::memory_order_relaxed) &&
         loop_gap_.load(std::memory_order_relaxed) < std::chrono::nanoseconds(dense_loop).count();
}

void Progress::wake() {
  std::unique_lock lock(mutex_);
  const bool wanted = wake_wanted();
  lock.unlock();
  if (wanted) work_.notify_one();
}

bool Progress::sweep(bool try_only) {
  std::unique_lock sweeping(sweep_mutex_, std::defer_lock);  // one sweeper at a time owns the live arrays
  if (!try_only) sweeping.lock();
  else if (!sweeping.try_lock()) return false;
  {
    std::lock_guard lock(mutex_);
    adopt_incoming();
  }
  if (live_count_ == 0) return false;
  int completed = 0;
  const Clock::time_point start = Clock::now();
  const int rc = MPI_Testsome(live_count_, live_.data(), &completed, indices_.data(), statuses_.data());
  if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
    {
      std::lock_guard lock(mutex_);
      failure_ = cat("MPI_Testsome failed: ", mpi_error_string(rc));
    }
    return false;
  }
  const Clock::time_point now = Clock::now();
  // A test that finds nothing to do takes under a microsecond; one that copies a
  // message, or a 32 KiB fragment of one, takes microseconds: MPI is moving data. (Now
  // and then MPI also polls its event loop, for about as long (docs/communication.md):
  // callers that act on "moved" tolerate such a single false alarm.)
  const bool moved = now - start >= busy_sweep;
  if (completed == MPI_UNDEFINED || completed == 0) return moved;
  {
    std::lock_guard lock(mutex_);
    for (int k = 0; k < completed; ++k) {
      const auto at = static_cast<std::size_t>(indices_[static_cast<std::size_t>(k)]);
      const MPI_Status& status = statuses_[static_cast<std::size_t>(k)];
      Slot& s = slots_[static_cast<std::size_t>(live_slot_[at])];
      s.done = true;
      s.completed = now;
      s.error = rc == MPI_ERR_IN_STATUS ? status.MPI_ERROR : MPI_SUCCESS;
      if (s.error == MPI_SUCCESS) MPI_Get_count(&status, MPI_BYTE, &s.bytes);
      live_[at] = MPI_REQUEST_NULL;  // complete, even where MPI reported an error for it
      --pending_;
    }
    int kept = 0;  // the rest keep their order
    for (int i = 0; i < live_count_; ++i)
      if (live_[static_cast<std::size_t>(i)] != MPI_REQUEST_NULL) {
        live_[static_cast<std::size_t>(kept)] = live_[static_cast<std::size_t>(i)];
        live_slot_[static_cast<std::size_t>(kept++)] = live_slot_[static_cast<std::size_t>(i)];
      }
    live_count_ = kept;
  }
  return moved;
}

int Progress::sweep_while_moving(bool try_only, bool for_thread) {
  int busy = 0;
  while (busy < 64 && sweep(try_only)) {
    ++busy;
    if (for_thread) {
      std::lock_guard lock(mutex_);
      if (waiters_ > 0) break;
    }
  }
  return busy;
}

void Progress::run() {
#if defined(__linux__)
  // Linux lets a sleep overrun by the thread's timer slack, 50 us by default: as long
  // as the poll intervals worth having. One microsecond keeps them what was asked.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
  // After a request is posted, or while data moves, answers are wanted quickly (a
  // rendezvous send waits for the receiver's reply, then pushes its data a few
  // fragments at a time as the receiver drains them): the pause drops to 20 us and
  // doubles back up to the interval once nothing moves, so an idle rank sweeps once per
  // interval and a transfer costs a few extra sweeps only.
  constexpr std::chrono::nanoseconds quick = std::chrono::microseconds(20);
  // The compute loop sweeps between layers. Where it swept this recently, the thread's
  // sweep would add nothing but take the rank's core from compute (on a rank bound to one
  // core: two context switches and a test of every request, which after each post, every
  // 20 us and up, cost a U-Net's first stage a third of its forward time): it sleeps on,
  // and looks again after this long, sweeping once the loop is inside a longer layer.
  constexpr std::chrono::nanoseconds cover = std::chrono::microseconds(200);
  std::chrono::nanoseconds pause = interval_;
  std::unique_lock lock(mutex_);
  for (;;) {
    // While a caller waits, it sweeps itself: it has nothing else to do. A post that does
    // not wake the thread (track(..., wake = false)) is seen within one interval.
    const auto idle = interval_.count() > 0 ? interval_ : std::chrono::nanoseconds(std::chrono::milliseconds(5));
    while (!work_.wait_for(lock, idle, [&] { return stop_ || (pending_ > 0 && waiters_ == 0); })) {
    }
    if (stop_) return;
    wakes_.fetch_add(1, std::memory_order_relaxed);
    bool hurry = posted_;
    posted_ = false;
    lock.unlock();
    const bool covered = Clock::now().time_since_epoch().count() - loop_swept_.load(std::memory_order_relaxed) < cover.count();
    // One slow sweep may be MPI's periodic housekeeping; two in a row are data moving.
    if (!covered) hurry |= sweep_while_moving(false, true) >= 2;
    lock.lock();
    // A dense loop answers its own posts' handshakes at its next layer: the thread keeps
    // its pause, and hurries once it finds the loop quiet and data moving.
    if (hurry && !(covered && dense())) pause = std::min(covered ? cover : quick, interval_);
    if (interval_.count() == 0) continue;
    work_.wait_for(lock, pause, [&] { return stop_ || waiters_ > 0 || posted_; });
    pause = std::min(2 * pause, interval_);
  }
}

Progress::Completion Progress::wait(Ticket& ticket, double timeout_s, const char* what, int index,
                                    long expected_bytes) {
  Completion c;
  if (ticket == none) return c;
  const Clock::time_point start = Clock::now();
  const RunClock run;  // the timeout counts the time this rank ran, not a stop of its own
  Slot& s = slots_[static_cast<std::size_t>(ticket)];
  auto timed_out = [&] {
    return TimeoutError(cat("timed out after ", timeout_s, " s waiting for ", what, " ", index,
                     " (a neighbour stage is stuck or gone; see --p2p-timeout)"));
  };
  std::unique_lock lock(mutex_);
  MPIPE_CHECK(s.in_use, "a wait on ticket ", ticket, ", which is not tracked");
  // The caller sweeps while it waits (the progress thread steps aside meanwhile).
  ++waiters_;
  struct Leave {  // on every way out, the exceptions' too
    Progress& p;
    std::unique_lock<std::mutex>& lock;
    ~Leave() {
      p.loop_swept(false);  // the waiter swept: the loop's next gap starts now
      if (!lock.owns_lock()) lock.lock();
      --p.waiters_;
      const bool wake = p.wake_wanted();
      lock.unlock();
      if (wake) p.work_.notify_one();
    }
  } leave{*this, lock};
  // Sweep without pause (yielding the core) while data moves or the wait is fresh: the
  // transfer runs at full speed, and the request is seen complete at once. Once sweeps
  // find nothing to do for a while the rank waits for a neighbour's compute, and sleeps
  // between sweeps, 5% of the time waited so far (20 us to 1 ms), unless told to spin.
  // The waits mode keeps to sleeping: there MPI moves the data by itself.
  Clock::time_point moving = start;  // when a sweep last moved data
  for (int polls = 0; !s.done && failure_.empty(); ++polls) {
    lock.unlock();
    if (sweep()) moving = Clock::now();
    const Clock::time_point now = Clock::now();
    const double waited = std::chrono::duration<double>(now - start).count();
    lock.lock();
    if (s.done) break;
    if (waited > timeout_s && run.seconds() > timeout_s) throw timed_out();
    lock.unlock();
    if (mode_ != ProgressMode::waits && (spin_waits_ || now - moving < keep_sweeping))
      sched_yield();
    else if (polls > 10)
      std::this_thread::sleep_for(std::chrono::duration<double>(std::clamp(waited * 0.05, 20e-6, 1e-3)));
    lock.lock();
  }
  if (!s.done) throw Error(cat(failure_, " (waiting for ", what, " ", index, ")"));
  c.posted = s.posted;
  c.completed = s.completed;
  const int error = s.error, bytes = s.bytes;
  s.in_use = false;
  free_.push_back(ticket);
  ticket = none;
  lock.unlock();
  c.waited = std::chrono::duration<double>(Clock::now() - start).count();
  if (error != MPI_SUCCESS) throw Error(cat(what, " ", index, ": ", mpi_error_string(error)));
  // A shorter message than the buffer would pass silently: the stages disagree on the
  // shape (or precision) at their boundary.
  if (expected_bytes >= 0 && bytes != expected_bytes)
    throw Error(cat("received ", bytes, " bytes for ", what, " ", index, ", expected ", expected_bytes,
                    " (the stages disagree on the boundary shape)"));
  return c;
}

Progress::Attending::Attending(Progress& progress) : progress_(progress) {
  std::lock_guard lock(progress_.mutex_);
  ++progress_.waiters_;
}

Progress::Attending::~Attending() {
  bool wake = false;
  {
    std::lock_guard lock(progress_.mutex_);
    --progress_.waiters_;
    wake = progress_.wake_wanted();  // as a wait's end
  }
  if (wake) progress_.work_.notify_one();
}

bool Progress::complete(Ticket ticket) {
  if (ticket == none) return true;
  std::lock_guard lock(mutex_);
  const Slot& s = slots_[static_cast<std::size_t>(ticket)];
  MPIPE_CHECK(s.in_use, "a test of ticket ", ticket, ", which is not tracked");
  return s.done;
}

void Progress::adopt_incoming() {
  for (const int id : incoming_) {
    live_[static_cast<std::size_t>(live_count_)] = slots_[static_cast<std::size_t>(id)].request;
    live_slot_[static_cast<std::size_t>(live_count_++)] = id;
  }
  incoming_.clear();
}

void Progress::cancel_remaining() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  adopt_incoming();  // the thread has stopped: nobody else sweeps
  // What a failed step left behind. Collectives cannot be cancelled and are left to MPI.
  for (int i = 0; i < live_count_; ++i) {
    MPI_Request& r = live_[static_cast<std::size_t>(i)];
    if (r != MPI_REQUEST_NULL && slots_[static_cast<std::size_t>(live_slot_[static_cast<std::size_t>(i)])].cancellable) {
      MPI_Cancel(&r);
      MPI_Request_free(&r);
    }
  }
  live_count_ = 0;
}

}  // namespace mpipe
