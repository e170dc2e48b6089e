// --checkpoint-async: the copy at the step, the write on a thread (io/checkpoint_async.hpp).
#include "mpipe/io/checkpoint_async.hpp"

#include <mpi.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>

#include "mpipe/data/hdf5.hpp"
#include "mpipe/pipeline/watchdog.hpp"

namespace mpipe {

AsyncCheckpoint::AsyncCheckpoint(Executor& exec)
    : exec_(exec),
      world_(Communicator::split(exec.grid().world(), 0, exec.grid().world().rank())),
      pipeline_(Communicator::split(exec.grid().pipeline(), 0, exec.grid().pipeline().rank())),
      writes_(exec.grid().replica() == 0 || exec.optimizer().sharded()) {
  int provided = 0;
  MPI_Query_thread(&provided);
  MPIPE_REQUIRE(provided == MPI_THREAD_MULTIPLE, "use --checkpoint-async off, or an MPI with MPI_THREAD_MULTIPLE",
                "--checkpoint-async writes from a thread of its own, and this MPI does not take calls from two threads");
  // The copy's memory, taken and touched now: a first touch at the checkpoint's step costs
  // page faults (on this VM 750 MB took 5-7 s where a copy into touched memory took 0.1-0.2 s).
  if (writes_) {
    if (exec.grid().replica() == 0) params_.assign(exec.params().params().size(), 0.0f);
    states_.resize(exec.optimizer().state_names().size());
    for (std::size_t s = 0; s < states_.size(); ++s) states_[s].assign(exec.optimizer().state(static_cast<int>(s)).size(), 0.0f);
  }
}

AsyncCheckpoint::~AsyncCheckpoint() {
  if (thread_.joinable()) thread_.join();
}

std::optional<SaveResult> AsyncCheckpoint::wait(Watchdog* liveness) {
  if (!thread_.joinable()) return std::nullopt;
  // While this rank waits on the write, the watchdog names a rank that stops answering,
  // and bounds a write every rank is still doing, as the synchronous save's guard does.
  std::optional<Watchdog::Guard> guard;
  if (liveness) guard.emplace(liveness->arm("waiting for the background checkpoint write", write_deadline(exec_)));
  thread_.join();
  std::optional<SaveResult> result = std::exchange(result_, std::nullopt);
  if (std::exception_ptr error = std::exchange(error_, nullptr)) std::rethrow_exception(error);
  return result;
}

std::optional<SaveResult> AsyncCheckpoint::start(CheckpointDir& dir, std::int64_t step, Watchdog* liveness) {
  const auto begin = std::chrono::steady_clock::now();
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
    if (!params_.empty()) {  // replica 0 writes /model
      const std::span<const float> values = exec_.params().params();
      std::copy(values.begin(), values.end(), params_.begin());
      source.params = params_.data();
    }
    for (std::size_t s = 0; s < states_.size(); ++s) {
      const std::span<const float> state = exec_.optimizer().state(static_cast<int>(s));
      std::copy(state.begin(), state.end(), states_[s].begin());
      source.states.push_back(states_[s].data());
    }
  }
  thread_ = std::thread([this, &dir, step, source] {
    // The write takes the time the ranks leave idle (their waits, the bubble), not the
    // steps': a thread of the idle class, whose CRCs, copies and MPI polling never
    // preempt training (sched(7); where refused, it runs as any thread).
    sched_param idle{};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
    {
      const Hdf5Lock hdf5;
      quiet_hdf5();  // per thread in a thread-safe HDF5
    }
    try {
      result_ = commit_checkpoint(exec_, dir, step, source, world_, pipeline_);
    } catch (...) {
      error_ = std::current_exception();
    }
  });
  stall_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  return previous;
}

}  // namespace mpipe
