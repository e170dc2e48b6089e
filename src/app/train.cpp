// The train command: start-up in phases every rank agrees on (no rank left waiting in a
// collective), the step loop with its log, checkpoints, evaluations and stop, and the
// closing report.
#include "mpipe/app/train.hpp"

#include <malloc.h>
#include <mpi.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <optional>

#include "mpipe/app/config_file.hpp"
#include "mpipe/app/plan.hpp"
#include "mpipe/app/process.hpp"
#include "mpipe/app/startup.hpp"
#include "mpipe/app/report.hpp"
#include "mpipe/app/sample.hpp"
#include "mpipe/app/tokenize.hpp"
#include "mpipe/io/checkpoint_async.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/version.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/io/checkpoint.hpp"
#include "mpipe/io/metrics.hpp"
#include "mpipe/io/trace.hpp"
#include "mpipe/io/init_from.hpp"
#include "mpipe/pipeline/comm/hosts.hpp"
#include "mpipe/pipeline/comm/watchdog.hpp"

namespace mpipe {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// One rank's training from its first step to its summary, once start-up is done.
class Training {
 public:
  Training(const TrainConfig& config, const Communicator& world, Executor& exec, CheckpointDir& checkpoint_dir,
           Watchdog& watchdog, MetricsWriter* metrics, Clock::time_point started, double time_limit_s,
           std::int64_t first_step, bool resumed, std::unique_ptr<AsyncCheckpoint> async)
      : async_(std::move(async)), config_(config), world_(world), root_(world.rank() == 0), exec_(exec), checkpoint_dir_(checkpoint_dir),
        watchdog_(watchdog), metrics_(metrics), started_(started), time_limit_s_(time_limit_s), first_step_(first_step),
        last_saved_(resumed ? first_step : -1), tokens_per_sample_(exec.model().tokens()),
        progress_(root_ && show_progress(config.progress)) {
    stats_.stage = exec.grid().stage();
    step_seconds_.reserve(static_cast<std::size_t>(config.steps));
  }

  // The step loop; the exit code of a run that ends early (a failed checkpoint), or 0.
  int run();
  // After the loop: the final checkpoint, the phase table, the trace and the summary.
  int finish();

 private:
  std::unique_ptr<AsyncCheckpoint> async_;  // --checkpoint-async on: the writes in the background
  // On every rank; false if it failed. `background`: with --checkpoint-async, written
  // while training goes on (else the write in flight is waited for first).
  bool checkpoint(std::int64_t done, bool background = false);
  bool background_written();
  void saved(const SaveResult& result, bool background);  // its times and its line
  bool time_is_up() const;
  template <class Write>
  void to_metrics(Write&& write);
  void report(const StepResult& r);  // one validated step
  void evaluate(std::int64_t step);
  void advise_kill_grace(double need_s);  // rank 0

  const TrainConfig& config_;
  const Communicator& world_;
  const bool root_;
  Executor& exec_;
  CheckpointDir& checkpoint_dir_;
  Watchdog& watchdog_;
  MetricsWriter* metrics_;  // rank 0 with --metrics; else null
  const Clock::time_point started_;  // --time-limit counts from here
  const double time_limit_s_;
  const std::int64_t first_step_;
  std::int64_t last_saved_;  // the step of the last checkpoint (or the one resumed from), or -1
  const std::int64_t tokens_per_sample_;
  const bool progress_;  // the live progress line
  const Clock::time_point run_start_ = Clock::now();
  PhaseStats stats_;
  std::vector<double> step_seconds_;  // rank 0, for the summary's median
  double longest_step_ = 0, checkpoint_seconds_ = 0;  // for --time-limit
  bool preempted_ = false, advised_ = false;
  std::string output_error_;  // rank 0: an output file that could not be written
  TrainingSample sample_{config_};  // --sample-every
};

// Waits for a background write in flight and reports it; false (said on rank 0) when it failed.
bool Training::background_written() {
  if (!async_) return true;
  try {
    if (const auto previous = async_->wait(&watchdog_)) saved(*previous, true);
    return true;
  } catch (const std::exception& e) {
    if (root_) std::fprintf(stderr, "mpipe: error: %s\n", e.what());
    return false;
  }
}

bool Training::checkpoint(std::int64_t done, bool background) {
  if (config_.checkpoint_dir.empty()) return true;
  try {
    if (async_ && background && done != last_saved_) {
      if (const auto previous = async_->start(checkpoint_dir_, done, &watchdog_)) saved(*previous, true);
      last_saved_ = done;
      if (root_)
        std::printf("checkpoint step %lld: writing in the background (training waited %.3f s)\n", static_cast<long long>(done),
                    async_->stall_seconds());
      return true;
    }
    if (!background_written()) return false;
    if (done == last_saved_) return true;
    saved(save_checkpoint(exec_, checkpoint_dir_, done, &watchdog_), false);
    last_saved_ = done;
    return true;
  } catch (const std::exception& e) {
    if (root_) std::fprintf(stderr, "mpipe: error: %s\n", e.what());
    return false;
  }
}

void Training::saved(const SaveResult& result, bool background) {
  checkpoint_seconds_ = result.write_seconds + result.verify_seconds;
  if (!root_) return;
  std::printf("checkpoint %s written%s: %s in %.2f s (%.0f MB/s), verified in %.2f s", result.path.c_str(),
              background ? " in the background" : "", human_bytes(result.bytes).c_str(), result.write_seconds,
              result.bytes / 1e6 / result.write_seconds, result.verify_seconds);
  // Rank 0's figure: what of the copy the thread had not done when the next update came.
  if (background) std::printf("; the next update waited %.3f s for the copy", result.copy_wait_seconds);
  std::printf("\n");
  advise_kill_grace(longest_step_ + checkpoint_seconds_);
}

// --time-limit: stop once the next step plus a checkpoint would not fit. Each rank asks
// on its own clock; the step's allreduce makes every rank stop after the same step.
bool Training::time_is_up() const {
  if (time_limit_s_ <= 0) return false;
  // With a background write in flight a stop waits for it before its own checkpoint.
  const double save = (checkpoint_seconds_ > 0 ? checkpoint_seconds_ : longest_step_) * (async_ && async_->in_flight() ? 2 : 1);
  return since(started_) + longest_step_ + save >= time_limit_s_;
}

// A metrics line that cannot be written (a full disk) stops the run with the others at
// the next step boundary, with a checkpoint.
template <class Write>
void Training::to_metrics(Write&& write) {
  if (!metrics_ || !output_error_.empty()) return;
  try {
    write(*metrics_);
  } catch (const UserError& e) {
    output_error_ = cat("mpipe: error: ", e.what(), "; hint: ", e.hint());
    exec_.request_stop();
  }
}

// One validated step's result: statistics, the log line, metrics, the progress line.
void Training::report(const StepResult& r) {
  const std::int64_t step = r.step;
  longest_step_ = std::max(longest_step_, r.seconds);
  if (step > first_step_) stats_.add(exec_.last_times(), r.bubble_fraction);  // the first step sizes the arenas
  if (!root_) return;
  if (step > first_step_) step_seconds_.push_back(r.seconds);
  const double samples_per_s = config_.batch_size / r.seconds;
  const double tokens_per_s = samples_per_s * static_cast<double>(tokens_per_sample_);
  to_metrics([&](MetricsWriter& out) { out.write(r, samples_per_s, tokens_per_s); });
  if (r.skipped)
    std::printf("step %lld: non-finite loss or gradients (norm %g); update skipped on every rank\n",
                static_cast<long long>(step + 1), r.grad_norm);
  if (progress_) std::printf("\r\033[K");  // the progress line gives way to a log line
  if ((step + 1) % config_.log_every == 0 || step == first_step_ || step + 1 == config_.steps) {
    std::printf("step %6lld/%d | loss %.6f | lr %.3e | grad norm %8.4f | %8.2f ms | ",
                static_cast<long long>(step + 1), config_.steps, r.loss, r.lr, r.grad_norm, r.seconds * 1e3);
    // A bubble is a pipeline's: with one stage nothing waits on a neighbour, so none is shown.
    if (exec_.grid().stages() > 1) std::printf("bubble %4.1f%% | ", 100 * r.bubble_fraction);
    if (tokens_per_sample_ > 0) std::printf("%.0f tok/s\n", tokens_per_s);
    else std::printf("%.0f samples/s\n", samples_per_s);
    std::fflush(stdout);
  }
  if (!config_.checkpoint_dir.empty()) advise_kill_grace(longest_step_);
  if (progress_ && step + 1 < config_.steps) {
    // On a terminal: one line that updates in place. Batch logs get plain lines only.
    const double eta = since(run_start_) / static_cast<double>(step + 1 - first_step_) *
                       static_cast<double>(config_.steps - step - 1);
    std::printf("step %lld/%d | loss %.4f | %.0f %s | ETA %d:%02d", static_cast<long long>(step + 1), config_.steps,
                r.loss, tokens_per_sample_ > 0 ? tokens_per_s : samples_per_s, tokens_per_sample_ > 0 ? "tok/s" : "samples/s",
                static_cast<int>(eta) / 60, static_cast<int>(eta) % 60);
    std::fflush(stdout);
  }
}

// Under mpirun, a SIGTERM (timeout, a scheduler without --signal) gives the ranks
// odls_base_sigkill_timeout seconds (1 by default) to finish their step and write the
// checkpoint before SIGKILL: say so, once, when this run needs more.
void Training::advise_kill_grace(double need_s) {
  if (advised_) return;
  const double grace = mpirun_kill_grace();
  if (grace < 0 || need_s <= grace) return;
  advised_ = true;
  if (progress_) std::printf("\r\033[K");
  std::printf("note: a SIGTERM to mpirun leaves the ranks %g s (odls_base_sigkill_timeout) before its SIGKILL; a step "
              "and a checkpoint take %.1f s or more here: launch with 'mpirun --mca odls_base_sigkill_timeout %.0f' to "
              "keep the checkpoint (SIGUSR1 to mpirun has no such limit)\n",
              grace, need_s, std::max(10.0, std::ceil(3 * need_s)));
  std::fflush(stdout);
}

void Training::evaluate(std::int64_t step) {
  const EvalResult e = exec_.evaluate();  // every rank
  if (!root_) return;
  if (progress_) std::printf("\r\033[K");
  std::printf("eval step %lld | loss %.6f | %s %.2f%% | %lld samples", static_cast<long long>(step + 1), e.loss,
              tokens_per_sample_ > 0 ? "token accuracy" : "accuracy", 100 * e.accuracy, static_cast<long long>(e.samples));
  if (e.available > e.samples)  // whole batches only: say what the file had beyond them
    std::printf(" (of %lld in the file: %lld left out, %s)", static_cast<long long>(e.available),
                static_cast<long long>(e.available - e.samples),
                config_.eval_batches > 0 ? "beyond --eval-batches" : "less than a batch");
  if (tokens_per_sample_ > 0) std::printf(" | perplexity %.3f", std::exp(e.loss));
  std::printf("\n");
  std::fflush(stdout);
  to_metrics([&](MetricsWriter& out) { out.write_eval(step, e); });
}

int Training::run() {
  if (config_.profile_ops > first_step_) ops::OpProfile::prepare(exec_.device());
  else if (config_.profile_ops > 0 && root_)
    std::printf("--profile-ops %d: this run resumes after that step, so no op profile\n", config_.profile_ops);
  try {
    for (std::int64_t step = first_step_; step < config_.steps; ++step) {
      // A signal, or a background checkpoint write that failed (at once, not at the next
      // checkpoint): every rank stops together after this step's agreement.
      if (stop_signalled() || (async_ && async_->failed())) exec_.request_stop();
      if (time_is_up()) exec_.request_stop(true);  // every rank learns it: the message names the time limit
      // With --overlap-steps the results are of earlier steps (this one's once settled).
      bool stop = false, time_limit = false;
      const bool profiled = step + 1 == config_.profile_ops;
      const Clock::time_point step_start = Clock::now();
      if (profiled) ops::OpProfile::begin();
      for (const StepResult& r : exec_.advance(step)) {
        report(r);
        stop = stop || r.stop;
        time_limit = time_limit || r.time_limit;
      }
      if (profiled) {
        const ops::OpTimes times = ops::OpProfile::end();  // after the GPU's last timed op
        const double seconds = since(step_start);
        if (progress_) std::printf("\r\033[K");
        op_profile_table(step + 1, times, seconds, exec_.grid().stage(), exec_.device(), world_);
      }
      const bool save = config_.checkpoint_every > 0 && (step + 1) % config_.checkpoint_every == 0 && step + 1 < config_.steps;
      const bool eval = !config_.eval_data.empty() &&
                        ((config_.eval_every > 0 && (step + 1) % config_.eval_every == 0) || step + 1 == config_.steps);
      const bool sample = config_.sample_every > 0 && (step + 1) % config_.sample_every == 0;
      // A checkpoint, an evaluation, a sample, a stop and the end need this step's agreed update.
      if (stop || save || eval || sample || step + 1 == config_.steps)
        if (const std::optional<StepResult> r = exec_.settle()) {
          report(*r);
          stop = stop || r->stop;
          time_limit = time_limit || r->time_limit;
        }
      if (stop) {
        // Every rank saw the same flag in the step's allreduce: stop here, together.
        preempted_ = true;
        // A background write in flight ends first; when it failed, that is the reason.
        if (!background_written()) {
          if (root_)
            std::printf("step %lld: the background checkpoint write failed; exiting with code %d\n",
                        static_cast<long long>(step + 1), exit_internal_error);
          return exit_internal_error;
        }
        // Rank 0 says why: its own reason, a time limit up on any rank (each asks its own
        // clock), or else a signal that reached another rank.
        if (root_)
          std::printf("step %lld: %s; %s and exiting with code %d\n", static_cast<long long>(step + 1),
                      !output_error_.empty() ? "an output file cannot be written"
                      : stop_signalled()     ? "stop signal received"
                      : time_limit           ? "--time-limit reached"
                                             : "a stop signal reached another rank",
                      config_.checkpoint_dir.empty() ? "no --checkpoint-dir, so nothing is saved," : "checkpointing",
                      output_error_.empty() ? exit_preempted : exit_user_error);
        if (!checkpoint(step + 1)) return exit_internal_error;
        break;
      }
      if (save && !checkpoint(step + 1, true)) return exit_internal_error;
      if (eval) evaluate(step);
      if (sample) {
        if (const std::string line = sample_(exec_, step); !line.empty()) {
          if (progress_) std::printf("\r\033[K");
          std::printf("%s\n", line.c_str());
          std::fflush(stdout);
        }
      }
    }
  } catch (const TimeoutError& e) {
    // A wait passed --p2p-timeout: name the ranks that stopped answering, once.
    std::fflush(stdout);
    roll_call(world_.get(), e.what(), std::min(config_.pipeline.p2p_timeout, 3.0), &watchdog_);
  } catch (const UserError& e) {
    // Bad input found mid-run (a data file changed under it): the others may be waiting
    // on this rank, so end the whole job, with a user's error's exit code.
    std::fflush(stdout);
    std::fprintf(stderr, "mpipe: error: %s; hint: %s\n", e.what(), e.hint().c_str());
    std::fflush(stderr);
    MPI_Abort(world_.get(), exit_user_error);
  } catch (const std::exception& e) {
    // One rank failed mid-run: the others may be waiting on it, so end the whole job.
    std::fflush(stdout);
    std::fprintf(stderr, "mpipe: error: %s\n", e.what());
    std::fflush(stderr);
    MPI_Abort(world_.get(), exit_internal_error);
  }
  return 0;
}

int Training::finish() {
  if (!preempted_ && !checkpoint(config_.steps)) return exit_internal_error;
  // An output that failed mid-run ends the run as an error on every rank, after its checkpoint.
  int output_failed = root_ && !output_error_.empty() ? 1 : 0;
  world_.broadcast(std::span<int>(&output_failed, 1), 0);
  if (output_failed) {
    if (root_) {
      std::fflush(stdout);
      std::fprintf(stderr, "%s\n", output_error_.c_str());
    }
    return exit_user_error;
  }
  // The closing gathers are collectives: a rank stopped by now is named, not waited for.
  rendezvous(world_, "the end of training", config_.pipeline.p2p_timeout, &watchdog_);
  const Plan& plan = exec_.plan();
  double simulated = 0;
  std::vector<StagePhases> phases = phase_table(stats_, world_, plan.schedule, config_.micro_batches,
                                                plan.unit_cost_bubble, plan.options.overlap_steps, &simulated);
  const std::vector<double> peaks = world_.gather(static_cast<double>(exec_.peak_activation_bytes()), 0);
  const bool gpu = exec_.device() == Device::cuda;
  const std::vector<double> device_peaks = world_.gather(static_cast<double>(gpu ? cuda::device_bytes_peak() : 0), 0);
  const cuda::GraphCounts g = gpu ? cuda::graph_counts() : cuda::GraphCounts{};
  const auto graphs = world_.gather(std::array<double, 4>{static_cast<double>(g.launched), static_cast<double>(g.made),
                                                          static_cast<double>(g.updated), static_cast<double>(g.nodes)}, 0);
  // The weights as allocated, the optimizer's state apart (1/D of it with
  // --shard-optimizer), against the plan's figures (without --overlap-steps' copies), and
  // the process's peak resident memory (Linux: KiB).
  const Optimizer& optimizer = exec_.optimizer();
  const ParamStore& store = exec_.params();
  const double copies = plan.options.overlap_steps ? 2.0 : 1.0;
  const Plan::WeightMemory planned = plan.weight_memory(exec_.grid().stage(), optimizer.sharded());
  const double weights[4] = {
      static_cast<double>((store.params().size() + store.grads().size()) * sizeof(float) +
                          (store.compute_dtype() == DType::bf16 ? store.params().size() * 2 : 0)),
      static_cast<double>((optimizer.state(0).size() + optimizer.state(1).size()) * sizeof(float)),
      (planned.values + planned.gradients) / copies, planned.state / copies};
  const std::vector<std::array<double, 4>> allocated = world_.gather(std::array<double, 4>{weights[0], weights[1], weights[2], weights[3]}, 0);
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const std::vector<double> resident = world_.gather(1024.0 * static_cast<double>(usage.ru_maxrss), 0);
  const auto cpu = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  const std::vector<double> cpu_s = world_.gather(cpu(usage.ru_utime) + cpu(usage.ru_stime), 0);
  const std::vector<double> progress_cpu_s = world_.gather(exec_.progress().thread_cpu_seconds(), 0);
  const std::vector<std::array<double, 2>> sent = world_.gather(
      std::array<double, 2>{static_cast<double>(exec_.transport().bytes_sent()), static_cast<double>(exec_.transport().skip_bytes_sent())}, 0);
  // And now, after the last step: what the rank keeps, without the transient buffers of
  // a step (MPI's non-blocking reductions allocate their own, freed when they end; the
  // heap's free memory handed back first).
  malloc_trim(0);
  const std::vector<double> resident_now = world_.gather(resident_bytes(), 0);
  if (!config_.trace.empty()) {
    if (const int code = agree(world_, [&] { write_trace(exec_, config_.trace); })) return code;
    if (root_)
      std::printf("trace of steps 2-%d written to %s\n", std::min(config_.trace_steps + 1, config_.steps), config_.trace.c_str());
  }
  if (root_) {
    std::printf("peak activation memory per rank:");
    for (double p : peaks) std::printf(" %s", human_bytes(p).c_str());
    std::printf("\n");
    std::printf("weights per rank, values and gradients + %s state%s, as allocated (plan):", plan.options.optimizer.kind.c_str(),
                optimizer.sharded() ? " (sharded)" : "");
    for (const auto& w : allocated)
      std::printf(" %s + %s (%s + %s)", human_bytes(w[0]).c_str(), human_bytes(w[1]).c_str(), human_bytes(w[2]).c_str(),
                  human_bytes(w[3]).c_str());
    std::printf("\npeak resident memory per rank:");
    for (double p : resident) std::printf(" %s", human_bytes(p).c_str());
    std::printf("\nresident memory per rank after the last step:");
    for (double p : resident_now) std::printf(" %s", human_bytes(p).c_str());
    std::printf("\n");
    if (gpu) {
      std::printf("peak GPU memory per rank (all mpipe allocated: weights, state, activations, scratch):");
      for (double p : device_peaks) std::printf(" %s", human_bytes(p).c_str());
      std::printf("\n");
    }
    if (plan.options.cuda_graphs) {
      std::printf("CUDA graphs per rank, actions launched as one (graphs made, updated in place; nodes a graph):");
      for (const auto& n : graphs) std::printf(" %.0f (%.0f, %.0f; %.0f)", n[0], n[1], n[2], n[0] > 0 ? n[3] / n[0] : 0.0);
      std::printf("\n");
    }
    if (plan.options.overlap_steps)
      std::printf("overlap-steps: %lld updates made ahead of their agreement, %lld undone and redone (clipping or "
                  "non-finite)\n",
                  static_cast<long long>(exec_.speculated()), static_cast<long long>(exec_.rolled_back()));
    RunSummary summary;
    summary.steps = static_cast<long long>(step_seconds_.size());
    if (!step_seconds_.empty()) {
      std::sort(step_seconds_.begin(), step_seconds_.end());
      summary.median_step_s = step_seconds_[step_seconds_.size() / 2];
      summary.samples_per_s = config_.batch_size / summary.median_step_s;
      summary.tokens_per_s = summary.samples_per_s * static_cast<double>(tokens_per_sample_);
    }
    summary.bubble = stats_.steps > 0 ? stats_.bubble / stats_.steps : 0.0;
    summary.theoretical_bubble = plan.unit_cost_bubble;
    summary.simulated_bubble = simulated;
    summary.peak_bytes_per_rank = peaks;
    if (gpu) summary.device_peak_bytes_per_rank = device_peaks;
    summary.phases = std::move(phases);
    summary.cpu_s_per_rank = cpu_s;
    summary.progress_thread_cpu_s_per_rank = progress_cpu_s;
    for (const auto& [stages, skips] : sent) {
      summary.sent_bytes_per_rank.push_back(stages);
      summary.skip_bytes_per_rank.push_back(skips);
    }
    const std::string json = summary_json(exec_, summary);
    try {
      if (metrics_) metrics_->write_line(json);
      if (!config_.summary.empty()) write_summary(config_.summary, json);
    } catch (const UserError& e) {
      std::fflush(stdout);
      std::fprintf(stderr, "mpipe: error: %s; hint: %s\n", e.what(), e.hint().c_str());
      return exit_user_error;
    }
  }
  return preempted_ ? exit_preempted : 0;
}

// Whether a run may resume a checkpoint (--resume a file, or auto over a checkpoint
// directory holding one), which --init-from then gives way to.
bool may_resume(const TrainConfig& config) {
  if (config.resume == "never") return false;
  if (config.resume != "auto") return true;
  return !config.checkpoint_dir.empty() && !checkpoint_files(config.checkpoint_dir).empty();
}

}  // namespace

int run_train(const TrainConfig& options, const Communicator& world) {
  const auto started = Clock::now();  // --time-limit counts from here
  const bool root = world.rank() == 0;
  TrainConfig config = options;
  double time_limit_s = 0;
  // Heartbeats from the first collective to the end: a rank stopped in start-up, in a
  // checkpoint or before the end of training is named within --p2p-timeout (an invalid
  // timeout, refused below, runs no heartbeats until then). The ranks come to it
  // together, out of MPI_Init.
  // The hosts first (a collective): the lines that name a rank name its node.
  fault_point("hosts", world.rank());
  learn_hosts(world);
  Watchdog watchdog(world, rank_on_host(world.rank()), options.pipeline.p2p_timeout);
  disarm_startup_deadline();  // the watchdog names a stopped rank from here on
  std::optional<StartUp> start_up(std::in_place, world, watchdog);
  // The plan, made by each rank alone: a bad schedule, --balance or model is said before
  // anything is created or locked. It stands unless --partition time measures (below).
  Plan plan;
  // --tokenizer: what turns text: data into ids, and the file each checkpoint keeps.
  std::shared_ptr<const Tokenizer> tokenizer;
  std::optional<TokenizerFile> tokenizer_kept;
  int code = start_up->phase("options", [&] {
    validate(config, world.size());
    const RunOptions run = run_options(config);
    const Model model(run.model);
    if (config.sample_every > 0)
      if (const std::string problem = sampling_problem(config, model); !problem.empty())
        throw UserError(cat("--sample-every: ", problem), sampling_hint(problem));
    plan = make_plan(run, world.size(), Model(run.model));
    time_limit_s = parse_time_limit(config.time_limit);
    if (root) check_checkpoint_options(config, /*create=*/true);
    if (root) check_output_files(config);
    // --init-from's files, before anything is allocated, where no checkpoint can stand in
    // for them (one that will be resumed makes them unused: they need not exist any more).
    if (!config.init_from.empty() && !may_resume(config)) check_weights(model, config.init_from);
    // Every rank reads --tokenizer, checked as the data file is, before anything is made.
    if (!config.tokenizer.empty()) tokenizer = load_run_tokenizer(config.tokenizer, model.classes(), &tokenizer_kept.emplace());
  });
  if (code) return code;
  // --rank-order auto on several hosts: the order that sends fewer bytes between them.
  std::string order_line;
  if (config.pipeline.grid.rank_order == "auto" && host_count() > 1 && plan.grid.stages > 1 && plan.grid.replicas > 1 &&
      (code = start_up->phase("rank order", [&] {
         std::string why;
         // The link between hosts as --link-bandwidth gives it, or measured (auto).
         double link = plan.options.link_seconds_per_byte;
         if (link < 0) link = measure_host_link(world);
         config.pipeline.grid.rank_order = choose_rank_order(plan, Model(plan.options.model), hosts(), &why, link);
         const RunOptions run = run_options(config);
         const Model model(run.model);
    if (config.sample_every > 0)
      if (const std::string problem = sampling_problem(config, model); !problem.empty())
        throw UserError(cat("--sample-every: ", problem), sampling_hint(problem));
    plan = make_plan(run, world.size(), Model(run.model));
         order_line = cat("rank order ", plan.grid.rank_order, " (--rank-order auto; bytes a step sends out of its busiest host: ",
                          why, ")");
       })))
    return code;
  // Every rank sees the directory rank 0 made (a shared file system), or says it does not.
  if ((code = start_up->phase("directory", [&] { check_checkpoint_options(config); }))) return code;
  // One job per checkpoint directory, and a run id for the checkpoints this run writes.
  CheckpointDir checkpoint_dir(checkpoint_options(config));
  if ((code = start_up->phase("lock", [&] {
         if (root) checkpoint_dir.lock();
       })))
    return code;
  checkpoint_dir.begin(world);
  // Collective, and only once every rank's options are known good.
  std::string device_line;
  if ((code = start_up->phase("device", [&] { device_line = resolve_device(config, world); }))) return code;
  // The device is known now (auto resolved to cpu or cuda); the model is the one planned.
  if ((code = start_up->phase("resolve", [&] {
         const RunOptions resolved = run_options(config);
         MPIPE_CHECK(resolved.model == plan.options.model, "resolving the device changed the model");
         plan.options = resolved;
       })))
    return code;
  // Each checkpoint says how to continue it: the options as resolved (the device, the grid).
  config.pipeline.grid = plan.grid;
  checkpoint_dir.set_config_text(to_toml(config));
  checkpoint_dir.set_tokenizer(std::move(tokenizer_kept));
  std::unique_ptr<MetricsWriter> metrics;
  cpu::set_threads(rank_threads(config.threads, world));
  if (needs_measurement(plan.options) && (code = start_up->phase("measure", [&] {
                                             plan = make_plan(plan.options, world.size(), Model(plan.options.model),
                                                              measure_costs(plan.options, world));
                                           })))
    return code;
  const int node_ranks = world.size() > 1 ? Communicator::node(world).size() : 1;
  std::unique_ptr<Executor> exec;
  if ((code = start_up->phase("executor", [&] {
         // Before the executor allocates anything (synthetic data included): a data file's
         // problems first (an input), then whether this rank's share fits.
         const Model model(plan.options.model);
         plan.options.tokens.tokenizer = tokenizer;  // text: data encoded by it, on every rank that reads it
         for (const auto& [spec, held_out] : {std::pair{config.data, false}, std::pair{config.eval_data, true}})
           if (!data_file(spec).empty()) make_dataset(spec, model, plan.options.seed, held_out, plan.options.tokens);
         check_memory(plan, world.rank(), node_ranks);
         if (root && !config.metrics.empty()) metrics = std::make_unique<MetricsWriter>(config.metrics);
         exec = std::make_unique<Executor>(plan, world);
       })))
    return code;
  if ((code = start_up->phase("connect", [&] { exec->connect(); }))) return code;
  watchdog.rename(exec->grid().name());  // the grid exists from connect on
  if ((code = start_up->phase("allocate", [&] { exec->allocate(); }))) return code;
  std::int64_t first_step = 0;
  std::string resumed_from;
  double load_seconds = 0;
  if ((code = start_up->phase("resume", [&] {
         const auto start = Clock::now();
         resumed_from = resume(*exec, checkpoint_dir, &first_step);
         load_seconds = since(start);
       })))
    return code;
  // Checkpoints of another run in the directory: refused, or replaced under --overwrite.
  if ((code = start_up->phase("claim", [&] {
         if (root) checkpoint_dir.claim();
       })))
    return code;
  // A fresh run may start from weights written elsewhere; a resumed one goes on from its checkpoint.
  if (resumed_from.empty() && !config.init_from.empty() &&
      (code = start_up->phase("init-from", [&] { load_weights(*exec, config.init_from); })))
    return code;
  std::unique_ptr<AsyncCheckpoint> async;
  if (background_checkpoints(config) && (config.checkpoint_async == "on" || AsyncCheckpoint::possible()) &&
      (code = start_up->phase("checkpoint-async", [&] { async = std::make_unique<AsyncCheckpoint>(*exec); })))
    return code;
  start_up.reset();  // from here the steps' waits have --p2p-timeout, checkpoints their own guard
  if (!config.trace.empty()) exec->start_trace_clock();
  if (root) print_header(config, *exec, device_line, order_line, time_limit_s, resumed_from, first_step, load_seconds);
  Training training(config, world, *exec, checkpoint_dir, watchdog, metrics.get(), started, time_limit_s, first_step,
                    !resumed_from.empty(), std::move(async));
  if ((code = training.run())) return code;
  return training.finish();
}

}  // namespace mpipe
