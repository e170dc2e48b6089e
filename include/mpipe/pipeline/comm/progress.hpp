// Communication progress: every posted request keeps moving while the rank computes.
//
// MPI moves a large message or a non-blocking collective only while a thread of each
// rank involved is inside an MPI call. That holds for Open MPI's shared-memory transport
// without single-copy (containers without ptrace rights, VMs), for rendezvous protocols
// between nodes and for libNBC's collectives. A rank that computes makes no MPI calls, so
// without help its transfers stall until its next wait and a pipeline runs serially.
// Progress owns the requests the executor posts and keeps them moving, in one of three
// modes, thread, layers or waits, which auto chooses between by default
// (docs/communication.md has the measurements behind each choice):
//   auto    layers where every rank shares this rank's node, computes on the CPU and Open
//           MPI's shared memory copies by single-copy (CMA, XPMEM, KNEM: a receiver copies
//           a message itself when it tests, so a thread only takes the rank's core);
//           thread otherwise (between nodes, shared memory without single-copy, GPUs).
//   thread  the compute loop tests them between layers (where a test costs well under a
//           microsecond), and a thread of its own (MPI_THREAD_MULTIPLE) tests them
//           through long layers and while the host waits on a GPU: once per poll
//           interval while nothing moves, at once while data moves, and sooner right
//           after a request is posted (a rendezvous handshake wants quick answers),
//           unless the loop sweeps densely (leave_dense_loops below).
//   layers  only the compute loop, between layers and between actions (for an MPI
//           without MPI_THREAD_MULTIPLE; thread falls back to it there).
//   waits   only waits test them: MPI's own progress, for transports that move data by
//           themselves (single-copy shared memory, RDMA offload); the baseline.
// A rank that waits tests its requests itself, without pause while data moves, so that
// the transfer runs at full speed and its end is seen at once; once nothing moves it is
// waiting for a neighbour's compute, and sleeps between tests (unless told to spin):
// a spinning wait takes cores the node's other processes need.
// Only Progress tests a request once it is tracked: MPI forbids two threads testing one.
#pragma once
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mpipe {

class Communicator;

enum class ProgressMode { automatic, thread, layers, waits };
const char* to_string(ProgressMode mode);  // automatic: "auto"
ProgressMode parse_progress_mode(const std::string& name);  // UserError for an unknown name

// The mode a run takes, and for auto why (for the run's header).
struct ProgressChoice {
  ProgressMode mode = ProgressMode::thread;
  std::string why;  // empty unless chosen by auto
};
// Collective over `world` where `requested` is auto (every rank asks the same); any other
// mode is returned as it is.
ProgressChoice choose_progress(ProgressMode requested, const Communicator& world, bool on_gpu);
// auto's rule, given what choose_progress() found: one rank takes layers (no messages);
// GPU ranks (their host waits on the GPU), ranks on several nodes, or shared memory
// without single-copy take the thread; the rest layers.
ProgressChoice decide_progress(bool on_gpu, int ranks, int ranks_on_node, const std::string& single_copy);
// Open MPI's shared-memory single-copy mechanism in this process, as its MPI_T control
// variable (btl_vader_single_copy_mechanism, btl_sm_ in Open MPI 5) names it: "cma",
// "xpmem", "knem", "emulated" or "none"; empty where MPI has no such variable (another MPI,
// or the transport not loaded: --mca btl ^vader).
std::string shared_memory_single_copy();

// Before MPI_Init. Without single-copy (no CMA: containers, some VMs; between nodes) Open
// MPI's ob1 moves a large message as fragments, pml_ob1_send_pipeline_depth of them (3)
// per turn of the sender's progress after the receiver's answer; a stage that computes
// between its sweeps then holds each message back for several turns (K = 2 on stages of
// one block: 1.1 ms mean from a posted activation to its receiver seeing it, 20 ms until
// the send completed, against 0.05 ms with single-copy). Unless the environment sets it
// (mpirun --mca, -x), the depth becomes send_pipeline_depth: a message of up to 4 MiB
// (Open MPI's shared-memory segment) moves in one turn. The run's header names the depth.
inline constexpr int send_pipeline_depth = 128;
void set_mpi_transfer_defaults();

class Progress {
 public:
  using Clock = std::chrono::steady_clock;
  using Ticket = int;  // a tracked request
  static constexpr Ticket none = -1;

  struct Completion {
    Clock::time_point posted, completed;  // tracked; seen complete by Progress
    double waited = 0;                    // seconds the caller blocked in wait()
  };

  // `capacity`: requests tracked at once, at most (sized once: nothing allocates later).
  // thread mode without MPI_THREAD_MULTIPLE runs as layers, and describe() says why.
  // `spin_waits`: a wait tests without pause for as long as it lasts (--comm-wait spin),
  // instead of sleeping once nothing moves. `on_thread_start` runs first on the progress
  // thread (binding it to the rank's GPU, whose memory a CUDA-aware MPI may touch while
  // progressing).
  // `mode` is thread, layers or waits (choose_progress() resolves auto); `why` says why
  // auto chose it, for describe().
  Progress(ProgressMode mode, double poll_interval_s, int capacity, bool spin_waits,
           std::function<void()> on_thread_start = {}, std::string why = {});
  // Stops the thread; point-to-point requests still tracked (a failed step) are cancelled.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  ProgressMode mode() const { return mode_; }
  std::string describe() const;  // for the run's header (with the send pipeline's depth)
  // The MPI thread level this process runs with (MPI_Query_thread).
  static int thread_level();
  // CPU seconds the progress thread has run so far (0 without one).
  double thread_cpu_seconds() const;
  // Times the progress thread woke and looked at its requests so far (0 without one).
  long thread_wakes() const { return wakes_.load(std::memory_order_relaxed); }

  // Hands `request` over; only Progress tests it from now on. Collectives are not
  // cancellable (MPI has no cancel for them). `wake`: the progress thread looks at it
  // soon (a rendezvous handshake wants a quick answer); false: within one poll interval
  // (the idle thread looks that often), or when the compute loop polls between layers (a sum whose caller soon waits or polls: waking
  // the thread costs context switches on the rank's core, up to 1.7x a small sum).
  Ticket track(MPI_Request request, bool cancellable, bool wake = true);
  // Wakes the thread once for requests tracked with wake = false: a batch of posts (a
  // step's sends ready at once, a sum's pieces) wakes it once, not once each; on a rank
  // bound to one core every wake is two context switches.
  void wake();
  // Blocks until the request completes and releases the ticket (sets it to none). Past
  // timeout_s seconds throws Error naming `what` and `index` ("the activation of
  // micro-batch", 3). For a receive, expected_bytes >= 0 is checked against what arrived.
  Completion wait(Ticket& ticket, double timeout_s, const char* what, int index, long expected_bytes = -1);
  // While one lives, the progress thread steps aside as during a wait: for a caller that
  // waits, posts what follows and waits again (a sum's phases), whose posts would
  // otherwise wake the thread between its waits to compete for the sweeps.
  class Attending {
   public:
    explicit Attending(Progress& progress);
    ~Attending();
    Attending(const Attending&) = delete;
    Attending& operator=(const Attending&) = delete;

   private:
    Progress& progress_;
  };
  // Whether the request has completed (none: true), without waiting or releasing it.
  bool complete(Ticket ticket);
  // Between layers (thread and layers modes): tests every tracked request, again while
  // data moves; nothing if the progress thread is testing them right now. Waits mode:
  // nothing.
  void poll() {
    if (mode_ == ProgressMode::waits) return;
    sweep_while_moving(true);
    loop_swept();
  }
  // Whether the progress thread leaves a compute loop that sweeps densely to itself (CPU
  // ranks: set by the executor; a GPU rank's host blocks on the GPU between its sweeps).
  // Where the loop's sweeps come less than dense_loop (an average) apart, posts and the
  // ends of waits do not wake the thread, and a post does not shorten its pause while the
  // loop covers: it wakes on its own timer, and sweeps once the loop has gone quiet (a long
  // layer). Each wake is two context switches on the rank's own core: a U-Net's stages,
  // whose layers take 0.05-0.2 ms, ran 1.10x faster without the thread than with it.
  void leave_dense_loops(bool leave) { leave_dense_.store(leave, std::memory_order_relaxed); }
  static constexpr std::chrono::microseconds dense_loop{200};

 private:
  struct Slot {
    MPI_Request request = MPI_REQUEST_NULL;  // as tracked (the sweeper holds the live copy)
    bool cancellable = false, in_use = false, done = false;
    int error = MPI_SUCCESS, bytes = 0;
    Clock::time_point posted, completed;
  };
  void run();    // the progress thread
  bool wake_wanted() const;  // whether a post or a last waiter leaving wakes the thread; under mutex_
  // One MPI_Testsome over every tracked request, by the thread or a waiting caller;
  // true when it took long enough to have moved data.
  bool sweep(bool try_only = false);
  // Sweeps again while data moves (at most 64 times); returns the sweeps that moved data.
  // `for_thread`: stops as soon as a caller waits (it sweeps itself; the thread, holding
  // the sweeps, would make it queue behind them).
  int sweep_while_moving(bool try_only = false, bool for_thread = false);
  void adopt_incoming();  // tracked since the last sweep into the live arrays; under both mutexes
  void cancel_remaining();
  std::string waits() const;  // how waits behave, for describe()
  std::string describe_mode() const;

  ProgressMode mode_;
  std::chrono::nanoseconds interval_;
  bool spin_waits_;
  std::string fallback_;  // why thread mode is not running, or empty
  std::string why_;       // why auto chose this mode, or empty
  std::mutex mutex_;
  std::condition_variable work_;  // wakes the thread: work, a waiter leaving, stop
  std::vector<Slot> slots_;
  std::vector<int> free_, incoming_;  // slot ids: unused; tracked since the last sweep
  int pending_ = 0;                   // tracked and not complete
  int waiters_ = 0;                   // callers blocked in wait(), sweeping themselves
  bool posted_ = false;               // a request was tracked since the thread's last sweep
  bool stop_ = false;
  std::string failure_;               // an MPI_Testsome that failed as a whole, or the thread
  // The sweeper's own arrays (the thread's, or a waiting caller's), under sweep_mutex_.
  std::mutex sweep_mutex_;
  std::vector<MPI_Request> live_;
  std::vector<int> live_slot_, indices_;
  std::vector<MPI_Status> statuses_;
  int live_count_ = 0;
  // When the compute loop last swept between layers (poll()): while it does so often, the
  // thread leaves the sweeping to it.
  std::atomic<Clock::rep> loop_swept_{0};
  // The mean time between the loop's sweeps (ns; an average over about 8 gaps, each at most
  // 10 ms; a wait's end counts as a sweep), and whether the thread leaves a dense loop alone.
  std::atomic<Clock::rep> loop_gap_{std::chrono::nanoseconds(std::chrono::milliseconds(10)).count()};
  std::atomic<bool> leave_dense_{false};  // set after the thread starts: atomic
  std::atomic<long> wakes_{0};
  void loop_swept(bool timed = true);  // the compute loop swept now (timed: a gap between two of its sweeps)
  bool dense() const;                  // the thread leaves the loop alone
  std::thread thread_;
};

}  // namespace mpipe
