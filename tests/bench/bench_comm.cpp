// Communication benchmark behind scripts/bench_comm.sh (not a test: it prints a table).
// Under mpirun -n 2 (or more: ranks pair up 0-1, 2-3, ...). For each size it times, in
// one run so that the ratios compare like with like:
//   allreduce   blocking MPI_Allreduce, then MPI_Iallreduce waited on through Progress in
//               each mode, every rank starting together (a barrier before each);
//   bucket sum  a replica bucket's sum (GroupSum: our reduce-scatter and all-gather over
//               Progress) over all the ranks, every rank starting together, against a
//               blocking MPI_Allreduce over all the ranks (its own blocking column);
//   tied sum    the executor's tied-weight sum (PairSum: the spans exchanged and added),
//               in its case: one rank starts its sum, the other joins after computing
//               for a while; timed from the later rank's start to the end;
//   send        blocking MPI_Send/MPI_Recv of the same bytes, then the pipeline's case:
//               the sender posts MPI_Isend and computes, the receiver waits; timed from
//               the post to the arrival, against the compute time.
// Medians over --reps repetitions; ratios are against the blocking call of the same row.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mpipe/pipeline/comm/comm.hpp"
#include "mpipe/pipeline/comm/group_sum.hpp"
#include "mpipe/pipeline/comm/pair_sum.hpp"
#include "mpipe/pipeline/comm/progress.hpp"

using namespace mpipe;
using Clock = std::chrono::steady_clock;

namespace {

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Computes for `s` seconds without entering MPI: what a stage does between messages.
// Streams over a buffer as a layer would, so memory traffic is part of it, and calls
// Progress::poll() after each pass, as the executor does after each layer.
void compute_for(double s, std::vector<float>& work, Progress& progress) {
  const auto start = Clock::now();
  float acc = 0;
  while (seconds(start, Clock::now()) < s) {
    for (std::size_t i = 0; i < work.size(); i += 16) acc += work[i] * 1.0001f, work[i] = acc;
    progress.poll();
  }
}

// The median of `reps` timings of f(rep), every rank starting together (a barrier before each).
template <class F>
double together(const Communicator& world, int reps, F f) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    world.barrier();
    const auto a = Clock::now();
    f(r);
    t.push_back(seconds(a, Clock::now()));
  }
  return median(t);
}

struct Options {
  std::vector<double> sizes_mb{0.5, 16, 154};
  int reps = 5;
  double compute_ms = 100;
  double poll_us = 5000;  // the executor's default
  bool spin = false;      // --comm-wait spin
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    if (key == "--sizes-mb") {
      o.sizes_mb.clear();
      for (char* p = std::strtok(argv[i + 1], ","); p; p = std::strtok(nullptr, ",")) o.sizes_mb.push_back(std::atof(p));
    } else if (key == "--reps") o.reps = std::atoi(argv[i + 1]);
    else if (key == "--compute-ms") o.compute_ms = std::atof(argv[i + 1]);
    else if (key == "--comm-poll-us") o.poll_us = std::atof(argv[i + 1]);
    else if (key == "--comm-wait" && (std::string(argv[i + 1]) == "sleep" || std::string(argv[i + 1]) == "spin"))
      o.spin = std::string(argv[i + 1]) == "spin";
    else {
      std::fprintf(stderr, "bench_comm: unknown option %s (--sizes-mb A,B --reps N --compute-ms T --comm-poll-us U --comm-wait sleep|spin)\n",
                   key.c_str());
      return 2;
    }
  }
  const Communicator world = Communicator::borrow(MPI_COMM_WORLD);
  if (world.size() < 2 || world.size() % 2) {
    if (world.rank() == 0) std::fprintf(stderr, "bench_comm: run it on an even number of ranks (mpirun -n 2)\n");
    MPI_Finalize();
    return 2;
  }
  // Pairs (0, 1), (2, 3), ...: each pair is a tied group / a pipeline link.
  const Communicator pair = Communicator::split(world, world.rank() / 2, world.rank());
  const int partner = 1 - pair.rank();
  const bool spin_waits = o.spin;  // as the executor's --comm-wait
  const bool root = world.rank() == 0;
  std::vector<float> work(std::size_t{1} << 20, 1.0f);  // 4 MB streamed by compute_for per pass
  const ProgressMode modes[] = {ProgressMode::thread, ProgressMode::layers, ProgressMode::waits};
  if (root) {
    std::printf("bench_comm: %d ranks in pairs; MPI thread level %s; medians of %d; progress thread poll interval %g us;\n"
                "compute %g ms between posts in the overlapped rows; ratio = time / blocking time\n",
                world.size(), provided == MPI_THREAD_MULTIPLE ? "MULTIPLE" : "below MULTIPLE", o.reps, o.poll_us,
                o.compute_ms);
    if (world.size() > 2)
      std::printf("*: over all %d ranks, against a blocking MPI_Allreduce over all of them; other rows: over pairs\n", world.size());
    std::printf("%-11s %10s %14s", "operation", "MB", "blocking ms");
    for (ProgressMode m : modes) std::printf(" %12s %7s", (std::string(to_string(m)) + " ms").c_str(), "ratio");
    std::printf("\n");
  }
  auto row = [&](const char* name, double mb, double blocking, const std::vector<double>& by_mode) {
    if (!root) return;
    std::printf("%-11s %10.2f %14.2f", name, mb, blocking * 1e3);
    for (double t : by_mode) std::printf(" %12.2f %6.2fx", t * 1e3, t / blocking);
    std::printf("\n");
    std::fflush(stdout);
  };
  for (const double mb : o.sizes_mb) {
    const auto count = static_cast<std::size_t>(mb * 1e6 / sizeof(float));
    std::vector<float> data(count, 1.0f);
    const std::span<float> span(data);
    const std::span<std::byte> bytes(reinterpret_cast<std::byte*>(data.data()), count * sizeof(float));

    // allreduce, every rank together
    const double blocking = together(world, o.reps, [&](int) { pair.allreduce(span, Reduce::sum); });
    std::vector<double> t, by_mode, tied_by_mode;
    for (ProgressMode m : modes) {
      Progress progress(m, o.poll_us * 1e-6, std::max(4, PairSum::requests(count)), spin_waits);
      by_mode.push_back(together(world, o.reps, [&](int r) {
        Progress::Ticket ticket = progress.track(pair.iallreduce(span, Reduce::sum), false);
        progress.wait(ticket, 600, "allreduce", r);
      }));
      // tied sum: the pair's second rank starts at once and waits; the first computes,
      // then starts; the time counts from the first rank's start
      t.clear();
      PairSum sum(pair, 1 - pair.rank(), progress, MessagePath{}, span, 0);
      for (int r = 0; r < o.reps; ++r) {
        sum.post_receive();
        world.barrier();
        if (pair.rank() == 1) sum.start();
        else compute_for(o.compute_ms * 1e-3, work, progress);
        const auto a = Clock::now();
        if (pair.rank() == 0) sum.start();
        sum.finish(600, "tied sum", r);
        double late = seconds(a, Clock::now());  // the first rank's time is the one that counts
        pair.broadcast(std::span<double>(&late, 1), 0);
        t.push_back(late);
      }
      tied_by_mode.push_back(median(t));
    }
    row("allreduce", mb, blocking, by_mode);

    // bucket sum over every rank, against the blocking allreduce over every rank
    const double world_blocking = together(world, o.reps, [&](int) { world.allreduce(span, Reduce::sum); });
    std::vector<double> bucket_by_mode;
    for (ProgressMode m : modes) {
      Progress progress(m, o.poll_us * 1e-6, GroupSum::requests(world.size()), spin_waits);
      GroupSum sum(world, progress, MessagePath{}, span, 20);
      bucket_by_mode.push_back(together(world, o.reps, [&](int r) {
        sum.start();
        sum.finish(600, "bucket sum", r);
      }));
    }
    row(world.size() == 2 ? "bucket sum" : "bucket sum*", mb, world_blocking, bucket_by_mode);
    row("tied sum", mb, blocking, tied_by_mode);

    // point to point: blocking, then posted by a sender that computes
    const double p2p = together(world, o.reps, [&](int) {
      if (pair.rank() == 0) MPI_CHECK(MPI_Send(bytes.data(), mpi_count(bytes.size()), MPI_BYTE, partner, 7, pair.get()));
      else MPI_CHECK(MPI_Recv(bytes.data(), mpi_count(bytes.size()), MPI_BYTE, partner, 7, pair.get(), MPI_STATUS_IGNORE));
    });
    by_mode.clear();
    for (ProgressMode m : modes) {
      Progress progress(m, o.poll_us * 1e-6, 4, spin_waits);
      t.clear();
      for (int r = 0; r < o.reps; ++r) {
        // The receive is posted after the barrier: posted before it, MPI could move the
        // message inside the barrier, before the clock starts.
        Progress::Ticket ticket = Progress::none;
        world.barrier();
        const auto a = Clock::now();
        if (pair.rank() == 1) ticket = progress.track(pair.irecv(bytes, partner, 8), true);
        if (pair.rank() == 0) {
          ticket = progress.track(pair.isend(bytes, partner, 8), true);
          compute_for(o.compute_ms * 1e-3, work, progress);  // the next micro-batch
          progress.wait(ticket, 600, "send", r);
        } else {
          progress.wait(ticket, 600, "receive", r, static_cast<long>(bytes.size()));
        }
        // the receiver's time: post to arrival (the sender's clock started together)
        double arrival = seconds(a, Clock::now());
        pair.broadcast(std::span<double>(&arrival, 1), 1);
        t.push_back(arrival);
      }
      by_mode.push_back(median(t));
    }
    row("send", mb, p2p, by_mode);
  }
  MPI_Finalize();
  return 0;
}
