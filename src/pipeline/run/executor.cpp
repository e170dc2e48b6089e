// The executor: the step around one action loop, a switch over action kinds driving the
// rank's stages, the transport, the reducer and the step device.
#include "mpipe/pipeline/run/executor.hpp"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/ops.hpp"

namespace mpipe {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

void Executor::start_trace_clock() {
  world_.barrier();  // every rank leaves the barrier within microseconds: a shared origin
  timeline_.start_clock();
}

Executor::Executor(const Plan& plan, const Communicator& world)
    : plan_(plan), world_(world), model_(plan.options.model), micro_(plan.micro_batch_size) {
  MPIPE_CHECK(plan.grid.stages * plan.grid.replicas == world.size(), "a plan for ", plan.grid.stages * plan.grid.replicas,
              " ranks on ", world.size());
  shapes_ = model_.shapes(micro_);
  if (plan.options.device == Device::cuda) {
    MPIPE_CHECK(cuda::active(), "--device cuda without cuda::init()");
    device_ = Device::cuda;
    dtype_ = plan.options.precision;
    cuda_aware_ = mpi_cuda_aware();
  }
  persistent_ = std::make_unique<Arena>(ops::device_memory(device_));
  scratch_ = std::make_unique<Arena>(ops::device_memory(device_));
  persistent_->count_in(&activations_);
  scratch_->count_in(&activations_);
}

// Requests a failed step left behind are cancelled by Progress.
Executor::~Executor() = default;

void Executor::connect() {
  grid_ = std::make_unique<Grid>(world_, plan_.grid);
  stages_.clear();
  local_of_.assign(static_cast<std::size_t>(partition_.stages()), -1);
  for (const int m : schedule_.stages_of(grid_->stage())) {
    local_of_[static_cast<std::size_t>(m)] = static_cast<int>(stages_.size());
    stages_.emplace_back(model_, m, static_cast<int>(stages_.size()), partition_.begin(m), partition_.end(m),
                         partition_.stages(), plan_.options.micro_batches);
  }
  // Tied weights: the stages holding an owner or a copy (GPT: the embedding and the
  // head, or each of the head's vocabulary chunks) form one group per replica.
  std::vector<int> tied_stages;
  for (const Model::Tie& tie : model_.ties())
    for (const int layer : {tie.owner_layer, tie.copy_layer})
      tied_stages.push_back(partition_.pipeline_stage(partition_.stage_of(layer)));
  grid_->connect_tied(tied_stages);
  // The data is an input: its problems are said before anything large is allocated.
  if (needs_batch()) {
    dataset_ = make_dataset(plan_.options.data, model_, plan_.options.seed, false, plan_.options.tokens);
    if (!plan_.options.eval_data.empty())
      eval_dataset_ = make_dataset(plan_.options.eval_data, model_, plan_.options.seed, true, plan_.options.tokens);
  }
  // A held-out file is evaluated in whole batches, each sample at most once: it must
  // hold one batch, and every batch asked for.
  if (eval_dataset_ && eval_dataset_->size() > 0) {
    const std::int64_t size = eval_dataset_->size(), batch = plan_.options.batch_size;
    const std::int64_t asked = static_cast<std::int64_t>(plan_.options.eval_batches) * batch;
    MPIPE_REQUIRE(size >= batch, cat("give a --batch-size of at most ", size, ", or more held-out samples"), "--eval-data has ",
                  size, " samples, fewer than one batch of ", batch, ": evaluation would repeat samples");
    MPIPE_REQUIRE(asked <= size, cat("give --eval-batches at most ", size / batch, " (0: every whole batch)"), "--eval-batches ",
                  plan_.options.eval_batches, " of ", batch, " samples need ", asked, " held-out samples, --eval-data has ",
                  size, ": evaluation would repeat samples");
  }
}

void Executor::allocate() {
  const int M = plan_.options.micro_batches;
  const int C = static_cast<int>(stages_.size());
  params_ = std::make_unique<ParamStore>(model_, layers(), plan_.options.seed);
  // --shard-optimizer: replica r of D keeps and updates piece r of each view.
  const bool shard = plan_.options.shard_optimizer && grid_->replicas() > 1;
  optimizer_ = std::make_unique<Optimizer>(*params_, plan_.options.optimizer, shard ? grid_->replica() : 0,
                                           shard ? grid_->replicas() : 1);
  if (device_ == Device::cuda) {
    params_->to_device(dtype_);
    optimizer_->to_device();
  }
  // Forward, backward, weight gradient and recompute of every micro-batch on every stage.
  device_ops_ = StepDevice::make(device_, cuda_aware_, 4 * M * C);
  if (needs_batch()) {
    const int share = plan_.replica_batch();
    // --prefetch: where every dataset this rank reads may fill on another thread.
    const PrefetchMode mode = plan_.options.prefetch;
    const bool aside = dataset_->fills_aside() && (!eval_dataset_ || eval_dataset_->fills_aside());
    const bool prefetch = aside && mode != PrefetchMode::off;
    device_ops_->allocate_batch(model_.input_shape(share), model_.input_dtype(), model_.target_shape(share), prefetch);
    if (prefetch)
      prefetch_ = std::make_unique<Prefetch>(
          [this](std::int64_t step, bool training, const Tensor& inputs, const Tensor& targets, std::int64_t begin,
                 std::int64_t end) { fill_batch(step, training, inputs, targets, begin, end); },
          // A GPU's rank leaves the host idle: the reader takes the rank's threads and the
          // whole batch. On the CPU it shares the cores with compute: one thread, of the
          // idle class, in eighths of the batch, so that take() fills what it did not reach
          // with the rank's threads (on cores that compute kept busy, that is all of it).
          device_ == Device::cuda ? cpu::threads() : 1, device_ == Device::cpu,
          device_ == Device::cpu ? std::max(1, share / 8) : 0);
  }
  slots_ = std::make_unique<SlotPool>(in_flight(schedule_, grid_->stage()), device_, &activations_);
  reducer_ = std::make_unique<Reducer>(*grid_, model_, partition_, *params_, layers(), *device_ops_,
                                       plan_.options.batchnorm == BatchNormRule::deferred, shard,
                                       plan_.options.p2p_timeout);
  if (plan_.options.overlap_steps) backup_ = std::make_unique<UpdateBackup>(*params_, *optimizer_, *device_ops_);
  // Skips that cross model stages, with an end on this rank: messages of their own.
  std::vector<int> here;
  for (const Stage& stage : stages_) here.push_back(stage.index());
  std::vector<Transport::SkipLink> skip_links = Transport::skip_links(model_, partition_, here, micro_);
  // Every request in flight at once: each micro-batch's two receives and two sends on
  // every stage, the skips', and the reducer's.
  const int requests = 4 * M * C + Transport::skip_requests(skip_links, M) + reducer_->requests() + 2;
  // Waits sleep between tests once nothing moves, unless asked to spin (docs/communication.md).
  const bool spin_waits = plan_.options.comm_wait == CommWait::spin;
  // auto: layers on one node with single-copy shared memory, a thread elsewhere (collective).
  const ProgressChoice progress = choose_progress(plan_.options.comm_progress, world_, device_ == Device::cuda);
  progress_ = std::make_unique<Progress>(
      progress.mode, plan_.options.comm_poll_s, requests, spin_waits,
      [] {
        if (cuda::active()) cuda::bind_thread();
      },
      progress.why);
  progress_->leave_dense_loops(device_ == Device::cpu);
  reducer_->connect(*progress_);
  std::vector<Transport::Channel> channels;
  for (const Stage& c : stages_)
    channels.push_back({c.index(), shapes_[static_cast<std::size_t>(c.begin())], shapes_[static_cast<std::size_t>(c.end())],
                        c.first(), c.last(), c.first() ? -1 : schedule_.list_of(c.index() - 1),
                        c.last() ? -1 : schedule_.list_of(c.index() + 1)});
  transport_ = std::make_unique<Transport>(*grid_, *progress_, device_ops_->path(), dtype_, M, std::move(channels),
                                           partition_.stages(), plan_.options.p2p_timeout, std::move(skip_links));
  const StageShared shared{.plan = &plan_,
                           .shapes = &shapes_,
                           .dtype = dtype_,
                           .replica = grid_->replica(),
                           .split = schedule_.splits(grid_->stage()),
                           .transport = transport_.get(),
                           .progress = progress_.get(),
                           .device_ops = device_ops_.get(),
                           .slots = slots_.get(),
                           .persistent = persistent_.get(),
                           .scratch = scratch_.get(),
                           .hooks = this};
  for (Stage& stage : stages_) stage.attach(shared);
  // Every action and transfer of every traced step, plus the reductions: sized once, here.
  const std::size_t per_step = schedule_.actions[static_cast<std::size_t>(grid_->stage())].size() +
                               3 * static_cast<std::size_t>(M * C) + static_cast<std::size_t>(reducer_->requests()) + 8;
  timeline_.reserve(per_step * static_cast<std::size_t>(plan_.options.trace_steps), plan_.options.trace_steps);
  if (const char* fail = std::getenv("MPIPE_TEST_FAIL")) {
    // Test hook: MPIPE_TEST_FAIL=RANK:STEP[:stall] makes that world rank throw (or hang)
    // in its first forward of that step, to check that one failing or stuck rank ends
    // the whole job; :gather stops it (SIGSTOP) after its update of that step, before
    // --shard-optimizer's gather; :lose-skip drops the first skip its first forward of that
    // step sends (a message lost: the job must still end promptly, with one line).
    char mode[16] = "";
    if (std::sscanf(fail, "%d:%d:%15s", &fail_rank_, &fail_step_, mode) < 2) fail_rank_ = fail_step_ = -1;
    fail_stall_ = std::strcmp(mode, "stall") == 0;
    fail_gather_ = std::strcmp(mode, "gather") == 0;
    fail_lose_skip_ = std::strcmp(mode, "lose-skip") == 0;
  }
}

// On the CPU the host's copy is the only one: both are no-ops there.
void Executor::download_state() {
  params_->download();
  optimizer_->download();
}

void Executor::upload_state() {
  params_->upload();
  optimizer_->upload();
}

std::size_t Executor::peak_activation_bytes() const {
  return activations_.peak;
}

bool Executor::needs_batch() const {
  return holds_first() || std::any_of(stages_.begin(), stages_.end(), [](const Stage& c) { return c.targets(); });
}

bool Executor::holds_first() const { return stages_.front().first(); }

bool Executor::holds_last() const { return stages_.back().last(); }

std::vector<int> Executor::layers() const {
  std::vector<int> out;
  for (const Stage& c : stages_)
    for (int i = c.begin(); i < c.end(); ++i) out.push_back(i);
  return out;
}

// A compute action's time: on the CPU measured now, into its phase and the trace; on a
// GPU the device times it between events, read once the step's work is done.
void Executor::begin_compute(ComputeKind kind, int micro_batch, int stage) {
  device_ops_->begin_compute(static_cast<int>(kind), micro_batch, traced_stage(stage));
}

void Executor::end_compute(ComputeKind kind, int micro_batch, int stage, Clock::time_point start) {
  device_ops_->end_compute();
  if (!device_ops_->host_timed()) return;
  timeline_.account(static_cast<int>(kind), since(start));
  timeline_.record(step_, static_cast<int>(kind), micro_batch, start, Clock::now(), -1, traced_stage(stage));
}

// This replica's share of the step's batch (of the held-out data's batch `step`), read
// on the host and moved to the device.
void Executor::fill_batch(std::int64_t step, bool training, const Tensor& inputs, const Tensor& targets,
                          std::int64_t begin, std::int64_t end) const {
  const Dataset* data = training ? dataset_.get() : eval_dataset_.get();
  const int share = plan_.replica_batch();
  if (end < 0) end = share;
  const Tensor in = holds_first() || !data->targets_alone() ? inputs : Tensor{};
  data->fill(static_cast<std::uint64_t>(step) * plan_.options.batch_size + static_cast<std::uint64_t>(grid_->replica() * share) +
                 static_cast<std::uint64_t>(begin),
             end - begin, in.samples(begin, end), targets.samples(begin, end));
}

void Executor::read_batch(std::int64_t step, bool training) {
  if (!(training ? dataset_ : eval_dataset_)) return;
  try {
    // A read ahead fails here, at the batch that needed it, as a read now would.
    if (prefetch_ && prefetch_->take(step, training)) device_ops_->swap_batch();
    else fill_batch(step, training, device_ops_->host_inputs(), device_ops_->host_targets());
  } catch (const std::exception& e) {
    rethrow_as(e, cat(grid_->name(), " at ", training ? "step " : "evaluation batch ", step, " reading the batch: ", e.what()));
  }
  device_ops_->upload_batch();
  // The next batch, into the other half while this step computes (and, on a GPU, while
  // this half is copied over: the copy is queued ahead of the step's work).
  if (prefetch_)
    prefetch_->start(step + 1, training, device_ops_->spare_inputs(), device_ops_->spare_targets(), plan_.replica_batch());
}

void Executor::run_pipeline(std::int64_t step, bool training) {
  const auto start = Clock::now();
  step_ = step;
  persistent_->reset();  // also when compute_gradients() is called without step()
  slots_->reset();
  for (Stage& stage : stages_) stage.begin_pass(training);
  if (training) params_->zero_grads();
  read_batch(step, training);
  device_ops_->begin_step(holds_last());
  if (training) ++training_passes_;
  device_ops_->graph_pass(training && plan_.options.cuda_graphs && training_passes_ > 2);
  // Every receive of the step is posted before any compute.
  transport_->post_receives(training);
  if (training) reducer_->begin_step();
  run_actions(step, training);
  const auto sends_start = Clock::now();
  timeline_.times().p2p_wait += transport_->finish_sends();
  timeline_.record(step, TraceEvent::send_wait, -1, sends_start);
  for (const Transport::Transfer& t : transport_->sent())
    timeline_.record(step, t.direction == Direction::forward ? TraceEvent::send_act : TraceEvent::send_grad, t.micro_batch,
                     t.posted, t.completed, -1, traced_stage(stages_[static_cast<std::size_t>(t.channel)].index()));
  loss_sum_ = correct_sum_ = 0.0;
  for (const Stage& stage : stages_) loss_sum_ += stage.loss_sum(), correct_sum_ += stage.correct_sum();
  // The step's compute is queued on a GPU: wait for it, read the loss and the action times.
  const double device_loss = device_ops_->finish_step(holds_last());
  if (!device_ops_->host_timed()) {
    if (holds_last()) loss_sum_ = device_loss;
    timeline_.read_device(step, *device_ops_);
  }
  pipeline_seconds_ = since(start);
}

void Executor::run_actions(std::int64_t step, bool training) {
  const int list = grid_->stage();
  const std::vector<Action>& actions = schedule_.actions[static_cast<std::size_t>(list)];
  // Whether B of micro-batch `mb` on model stage `model_stage` is the next compute after
  // action `at` (nothing that uses the scratch arena runs between).
  const auto backward_next = [&](std::size_t at, int model_stage, int mb) {
    for (std::size_t i = at + 1; i < actions.size(); ++i) {
      const Action& next = actions[i];
      if (next.kind != ActionKind::forward && next.kind != ActionKind::backward && next.kind != ActionKind::weight) continue;
      return next.kind == ActionKind::backward && next.micro_batch == mb && schedule_.stage_of(list, next) == model_stage;
    }
    return false;
  };
  for (std::size_t at = 0; at < actions.size(); ++at) {
    const Action& action = actions[at];
    const int mb = action.micro_batch;
    const int c = local_of_[static_cast<std::size_t>(schedule_.stage_of(list, action))];  // this rank's stage
    Stage& stage = stages_[static_cast<std::size_t>(c)];
    if (!training && (action.kind == ActionKind::backward || action.kind == ActionKind::weight ||
                      action.kind == ActionKind::recv_grad || action.kind == ActionKind::send_grad))
      continue;
    const auto action_start = Clock::now();
    try {
      transport_->between_actions();
      progress_->poll();
      switch (action.kind) {
        case ActionKind::forward:
          if (world_.rank() == fail_rank_ && step == fail_step_ && fail_lose_skip_) {
            transport_->lose_next_skip();
            fail_step_ = -1;
          } else if (world_.rank() == fail_rank_ && step == fail_step_ && !fail_gather_) {
            if (fail_stall_)
              for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
            throw Error("injected failure (MPIPE_TEST_FAIL)");
          }
          stage.forward(step, mb, training, training && backward_next(at, schedule_.stage_of(list, action), mb));
          break;
        case ActionKind::backward: stage.backward(step, mb); break;
        case ActionKind::weight: stage.weight(step, mb); break;
        case ActionKind::recv_act:
          timeline_.times().p2p_wait += transport_->receive(Direction::forward, c, mb);
          timeline_.record(step, TraceEvent::recv_act, mb, action_start, Clock::now(), -1, traced_stage(stage.index()));
          break;
        case ActionKind::recv_grad:
          // A rematerialized micro-batch's forward runs while its gradient is on the way
          // (GPipe's and 1F1B's waits for the next stage's B), not after it arrives.
          if (training && backward_next(at, schedule_.stage_of(list, action), mb)) stage.recompute(step, mb);
          {
            const auto wait_start = Clock::now();
            timeline_.times().p2p_wait += transport_->receive(Direction::backward, c, mb);
            timeline_.record(step, TraceEvent::recv_grad, mb, wait_start, Clock::now(), -1, traced_stage(stage.index()));
          }
          break;
        case ActionKind::send_act: transport_->send(Direction::forward, c, mb, stage.micro_batch(mb).output); break;
        case ActionKind::send_grad: transport_->send(Direction::backward, c, mb, stage.micro_batch(mb).input_grad); break;
      }
    } catch (const std::exception& e) {
      rethrow_as(e, cat(grid_->name(), " at step ", step, " during ", to_string(action), ": ", e.what()));
    }
  }
}

void Executor::reduce_and_agree(std::int64_t step, double pipeline_seconds, double dropped) {
  const auto reduce_start = Clock::now();
  reducer_->reduce();
  for (const Reducer::Done& d : reducer_->done())
    timeline_.record(step, d.sum == Reducer::Sum::replicas ? TraceEvent::gradient_sum : TraceEvent::tied_sum, -1,
                     d.completion.posted, d.completion.completed, d.layer);
  reducer_->start_agree(holds_last() ? loss_sum_ : 0.0, timeline_.times().compute() - dropped, pipeline_seconds,
                        stop_requested_, time_limit_reached_);
  timeline_.times().allreduce += since(reduce_start);
}

void Executor::finish_agree(std::int64_t step) {
  const auto agree_start = Clock::now();
  agreed_ = reducer_->finish_agree(step);
  timeline_.times().allreduce += since(agree_start);
  timeline_.record(step, TraceEvent::allreduce, -1, agree_start);
}

double Executor::compute_gradients(std::int64_t step) {
  MPIPE_CHECK(!pending_, "compute_gradients() with a step in flight (settle() it first)");
  reducer_->clear_step_sums();  // a step's sums begin with its forward
  run_pipeline(step);
  reduce_and_agree(step, pipeline_seconds_, 0.0);
  finish_agree(step);
  return agreed_loss();
}

double Executor::agreed_loss() const {
  return agreed_.loss_sum / static_cast<double>(static_cast<std::int64_t>(plan_.options.batch_size) * model_.rows_per_sample());
}

StepResult Executor::agreed_result(std::int64_t step) const {
  StepResult r;
  r.step = step;
  r.loss = agreed_loss();
  r.grad_norm = std::sqrt(agreed_.norm_squared);
  r.bubble_fraction = agreed_.bubble;
  r.stop = agreed_.stop;
  r.time_limit = agreed_.time_limit;
  r.lr = learning_rate(plan_.options.optimizer, step, plan_.options.steps);
  return r;
}

bool Executor::plain_update(const StepResult& r) const {
  const float clip = plan_.options.optimizer.clip_grad;
  return std::isfinite(r.grad_norm) && std::isfinite(r.loss) && !(clip > 0.0f && r.grad_norm > clip);
}

void Executor::update(StepResult& r) {
  // Every rank sees the same loss and norm, so every rank skips or steps alike.
  if (!std::isfinite(r.grad_norm) || !std::isfinite(r.loss)) {
    r.skipped = true;
    reducer_->settle_buffers(false, updates_);
    return;
  }
  const auto opt_start = Clock::now();
  const float clip = plan_.options.optimizer.clip_grad;
  if (clip > 0.0f && r.grad_norm > clip) {
    const auto factor = static_cast<float>(clip / r.grad_norm);
    params_->scale_grads(factor);
  }
  if (state_reader_) state_reader_->finish();
  optimizer_->update(r.lr, ++updates_);
  if (fail_gather_ && world_.rank() == fail_rank_ && r.step == fail_step_) std::raise(SIGSTOP);
  reducer_->start_gather(updates_);  // --shard-optimizer: the other replicas' pieces
  reducer_->settle_buffers(true, updates_);
  reducer_->finish_gather();
  device_ops_->synchronize();  // honest step times on a GPU
  timeline_.times().optimizer += since(opt_start);
  timeline_.record(r.step, TraceEvent::optimizer, -1, opt_start);
}


EvalResult Executor::evaluate() {
  MPIPE_CHECK(!plan_.options.eval_data.empty(), "evaluate() without --eval-data");
  MPIPE_CHECK(!pending_, "evaluate() with a step in flight (settle() it first)");
  try {
    return evaluate_unchecked();
  } catch (const std::exception& e) {
    // Name this rank as a step's errors do (a wait's timeout says only what it waited for).
    const std::string what = e.what();
    if (what.rfind("rank ", 0) == 0) throw;
    rethrow_as(e, cat(grid_->name(), " in evaluation: ", what));
  }
}

EvalResult Executor::evaluate_unchecked() {
  // The file's size, the same on every rank (the ranks that read it know it; 0 for
  // synthetic data); agreed within --p2p-timeout like every other wait.
  double size = eval_dataset_ ? static_cast<double>(eval_dataset_->size()) : 0.0;
  Progress::Ticket agreed = progress_->track(world_.iallreduce(std::span<double>(&size, 1), Reduce::max), false);
  progress_->wait(agreed, plan_.options.p2p_timeout, "the evaluation's size agreement, batch", 0);
  int batches = plan_.options.eval_batches;
  if (batches == 0)  // a file's whole batches
    batches = size > 0 ? std::max(1, static_cast<int>(size / plan_.options.batch_size)) : 8;
  timeline_.begin_quiet();
  double sums[2] = {0, 0};
  for (int b = 0; b < batches; ++b) {
    run_pipeline(b, false);
    sums[0] += loss_sum_;
    sums[1] += correct_sum_;
  }
  persistent_->reset();
  Progress::Ticket ticket = progress_->track(world_.iallreduce(std::span<double>(sums), Reduce::sum), false);
  progress_->wait(ticket, plan_.options.p2p_timeout, "the evaluation's allreduce, batch", batches);
  timeline_.end_quiet();
  EvalResult r;
  r.samples = static_cast<std::int64_t>(batches) * plan_.options.batch_size;
  r.available = static_cast<std::int64_t>(size);
  const double rows = static_cast<double>(r.samples * model_.rows_per_sample());
  r.loss = sums[0] / rows;
  r.accuracy = sums[1] / rows;
  return r;
}

StepResult Executor::step(std::int64_t step) {
  return named_errors(*grid_, step, [&] { return step_unchecked(step); });
}

StepResult Executor::step_unchecked(std::int64_t step) {
  MPIPE_CHECK(!pending_, "step() with a step in flight (settle() it first)");
  const auto start = Clock::now();
  timeline_.times() = PhaseTimes{};
  compute_gradients(step);
  StepResult r = agreed_result(step);
  update(r);
  persistent_->reset();
  r.seconds = since(start);
  timeline_.close(r.seconds);
  return r;
}

}  // namespace mpipe
