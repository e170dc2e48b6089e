// --checkpoint-async: the copy while training goes on, the write on a thread
// (io/checkpoint_async.hpp).
#include "mpipe/io/checkpoint_async.hpp"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "mpipe/core/background.hpp"
#include "mpipe/data/hdf5.hpp"
#include "mpipe/pipeline/comm/watchdog.hpp"

namespace mpipe {

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t piece_values = std::size_t{1} << 20;  // 4 MiB

double since(Clock::time_point from) { return std::chrono::duration<double>(Clock::now() - from).count(); }

}  // namespace

bool AsyncCheckpoint::possible() {
  int provided = 0;
  MPI_Query_thread(&provided);
  return provided == MPI_THREAD_MULTIPLE;
}

AsyncCheckpoint::AsyncCheckpoint(Executor& exec)
    : exec_(exec),
      world_(Communicator::split(exec.grid().world(), 0, exec.grid().world().rank())),
      pipeline_(Communicator::split(exec.grid().pipeline(), 0, exec.grid().pipeline().rank())),
      writes_(exec.grid().replica() == 0 || exec.optimizer().sharded()),
      copy_at_update_(std::getenv("MPIPE_CHECKPOINT_COPY_AT_UPDATE") != nullptr) {
  MPIPE_REQUIRE(possible(), "use --checkpoint-async off, or an MPI with MPI_THREAD_MULTIPLE",
                "--checkpoint-async writes from a thread of its own, and this MPI does not take calls from two threads");
  // The copy's memory, taken and touched now: a first touch at the checkpoint's step costs
  // page faults (on this VM 750 MB took 5-7 s where a copy into touched memory took 0.1-0.2 s).
  if (!writes_) return;
  // [begin, end) of `from` in pieces of at most piece_values, into `to`.
  const auto add_pieces = [](std::vector<Piece>& pieces, const float* from, float* to, std::size_t begin, std::size_t end) {
    for (std::size_t at = begin; at < end; at += piece_values)
      pieces.push_back({from + at, to + at, std::min(piece_values, end - at)});
  };
  if (exec.grid().replica() == 0) {  // replica 0 writes /model
    const std::span<const float> values = exec.params().params();
    params_.assign(values.size(), 0.0f);
    // The buffers (BatchNorm's running statistics) change in the next step's forwards:
    // copied at the step. Everything else changes only in an update: copied later.
    std::vector<std::pair<std::size_t, std::size_t>> buffers;
    for (const ParamEntry& e : exec.params().entries())
      if (e.buffer && !e.alias) buffers.emplace_back(e.param_offset, e.param_offset + static_cast<std::size_t>(e.numel()));
    std::sort(buffers.begin(), buffers.end());
    std::size_t at = 0;
    for (const auto& [begin, end] : buffers) {
      add_pieces(later_, values.data(), params_.data(), at, std::max(at, begin));
      add_pieces(now_, values.data(), params_.data(), std::max(at, begin), end);
      at = std::max(at, end);
    }
    add_pieces(later_, values.data(), params_.data(), at, values.size());
  }
  states_.resize(exec.optimizer().state_names().size());
  for (std::size_t s = 0; s < states_.size(); ++s) {
    const std::span<const float> state = exec.optimizer().state(static_cast<int>(s));
    states_[s].assign(state.size(), 0.0f);
    add_pieces(later_, state.data(), states_[s].data(), 0, state.size());
  }
  copied_ = next_ = static_cast<int>(later_.size());  // nothing to copy before the first start()
  exec_.set_state_reader(this);
}

AsyncCheckpoint::~AsyncCheckpoint() {
  if (thread_.joinable()) {
    finish();  // the thread may leave the copy to an update that now never comes
    thread_.join();
  }
  exec_.set_state_reader(nullptr);
}

void AsyncCheckpoint::copy_pieces() {
  const int total = static_cast<int>(later_.size());
  for (int i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < total;) {
    const Piece& p = later_[static_cast<std::size_t>(i)];
    std::memcpy(p.to, p.from, p.count * sizeof(float));
    if (copied_.fetch_add(1, std::memory_order_acq_rel) + 1 == total) copied_.notify_all();
  }
}

void AsyncCheckpoint::finish() {
  const int total = static_cast<int>(later_.size());
  if (copied_.load(std::memory_order_acquire) == total) return;
  const auto begin = Clock::now();
  copy_pieces();  // what the thread has not taken yet, at training's priority
  for (int c; (c = copied_.load(std::memory_order_acquire)) < total;) copied_.wait(c, std::memory_order_acquire);
  copy_wait_ += since(begin);
}

std::optional<SaveResult> AsyncCheckpoint::wait(Watchdog* liveness) {
  if (!thread_.joinable()) return std::nullopt;
  finish();  // training waits anyway: what is left of the copy, here
  // While this rank waits on the write, the watchdog names a rank that stops answering,
  // and bounds a write every rank is still doing, as the synchronous save's guard does.
  std::optional<Watchdog::Guard> guard;
  if (liveness) guard.emplace(liveness->arm("waiting for the background checkpoint write", write_deadline(exec_)));
  thread_.join();
  failed_ = false;
  std::optional<SaveResult> result = std::exchange(result_, std::nullopt);
  if (std::exception_ptr error = std::exchange(error_, nullptr)) std::rethrow_exception(error);
  if (result) result->copy_wait_seconds = copy_wait_;
  return result;
}

std::optional<SaveResult> AsyncCheckpoint::start(CheckpointDir& dir, std::int64_t step, Watchdog* liveness) {
  const auto begin = Clock::now();
  std::optional<SaveResult> previous = wait(liveness);  // one write at a time: the copy's memory is reused
  {
    const Hdf5Lock hdf5;  // a data reader's thread may be in HDF5
    quiet_hdf5();
  }
  // As the synchronous save: a rank stopped before the checkpoint is named here.
  rendezvous(exec_.grid().world(), cat("checkpoint step ", step), exec_.options().p2p_timeout, liveness);
  exec_.download_state();  // on a GPU: to the host mirrors
  SaveSource source{nullptr, {}, exec_.updates()};
  if (writes_) {
    for (const Piece& p : now_) std::memcpy(p.to, p.from, p.count * sizeof(float));
    if (!params_.empty()) source.params = params_.data();
    for (const std::vector<float>& state : states_) source.states.push_back(state.data());
  }
  copy_wait_ = 0;
  copied_ = 0;
  next_ = 0;
  thread_ = std::thread([this, &dir, step, source] {
    // The copy and the write take the time the ranks leave idle (their waits, the
    // bubble, cores no rank uses), not the steps': their copies, CRCs and MPI polling
    // never preempt training. An update that comes first copies what is left itself.
    become_background_thread();
    try {
      if (!copy_at_update_) copy_pieces();
      for (int c; (c = copied_.load(std::memory_order_acquire)) < static_cast<int>(later_.size());)
        copied_.wait(c, std::memory_order_acquire);
      {
        const Hdf5Lock hdf5;
        quiet_hdf5();  // per thread in a thread-safe HDF5
      }
      result_ = commit_checkpoint(exec_, dir, step, source, world_, pipeline_);
    } catch (...) {
      error_ = std::current_exception();
      failed_.store(true, std::memory_order_release);
    }
  });
  stall_ = since(begin);
  return previous;
}

}  // namespace mpipe
