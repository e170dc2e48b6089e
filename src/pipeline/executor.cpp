// The executor: one switch over action kinds, the communication around it, and the
// gradient reductions that make every stage count and replica agree.
#include "mpipe/pipeline/executor.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace mpipe {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

const char* TraceEvent::name(int kind) {
  static const char* names[count] = {"forward", "backward", "recompute", "send activation", "wait activation",
                                     "send gradient", "wait gradient", "wait sends", "allreduce", "optimizer"};
  return names[kind];
}

void Executor::start_trace_clock() {
  world_.barrier();  // every rank leaves the barrier within microseconds: a shared origin
  trace_origin_ = Clock::now();
}

void Executor::record(std::int64_t step, int kind, int micro_batch, Clock::time_point start) {
  if (!tracing(step)) return;
  TraceEvent e;
  e.start = std::chrono::duration<double>(start - trace_origin_).count();
  e.end = std::chrono::duration<double>(Clock::now() - trace_origin_).count();
  e.step = static_cast<std::int32_t>(step);
  e.kind = static_cast<std::int16_t>(kind);
  e.micro_batch = static_cast<std::int16_t>(micro_batch);
  trace_.push_back(e);
}

const char* PhaseTimes::name(int i) {
  static const char* names[count] = {"forward", "backward", "recompute", "p2p wait", "allreduce", "optimizer", "idle", "step"};
  return names[i];
}

void validate(const TrainConfig& c, int world) {
  validate(c.model);
  validate(c.optimizer);
  const auto& p = c.pipeline;
  MPIPE_REQUIRE(c.batch_size > 0, "e.g. --batch-size 32", "--batch-size must be positive, got ", c.batch_size);
  MPIPE_REQUIRE(c.micro_batches > 0, "e.g. --micro-batches 4", "--micro-batches must be positive, got ", c.micro_batches);
  MPIPE_REQUIRE(c.steps > 0, "e.g. --steps 100", "--steps must be positive, got ", c.steps);
  MPIPE_REQUIRE(c.threads >= 0, "e.g. --threads 2, or 0 for every core", "--threads must be >= 0, got ", c.threads);
  MPIPE_REQUIRE(c.log_every > 0, "e.g. --log-every 10", "--log-every must be positive, got ", c.log_every);
  MPIPE_REQUIRE(p.remat == "always" || p.remat == "except-last" || p.remat == "never",
                "use --remat always, except-last or never", "unknown --remat '", p.remat, "'");
  MPIPE_REQUIRE(p.p2p_timeout > 0, "e.g. --p2p-timeout 600", "--p2p-timeout must be positive, got ", p.p2p_timeout);
  make_schedule(p.schedule, 1, 1);  // throws UserError for an unknown name
  GridShape grid = p.grid;
  if (world > 0) grid = resolve_grid(grid, world);
  const int replicas = std::max(1, grid.replicas);
  // Tags are 2 * micro-batch + direction; MPI promises tags up to 32767.
  MPIPE_REQUIRE(c.micro_batches <= 16383, "use at most 16383 micro-batches", "--micro-batches ", c.micro_batches,
                " is too many");
  MPIPE_REQUIRE(c.micro_batches <= c.batch_size, "use at most one micro-batch per sample",
                "--micro-batches ", c.micro_batches, " exceeds --batch-size ", c.batch_size);
  if (replicas == 1)
    MPIPE_REQUIRE(c.batch_size % c.micro_batches == 0, "pick --micro-batches dividing --batch-size",
                  "--batch-size ", c.batch_size, " is not divisible by --micro-batches ", c.micro_batches);
  else
    MPIPE_REQUIRE(c.batch_size % (static_cast<std::int64_t>(c.micro_batches) * replicas) == 0,
                  cat("pick a --batch-size that is a multiple of ", c.micro_batches * replicas),
                  "--batch-size ", c.batch_size, " does not split into --micro-batches ", c.micro_batches, " x ",
                  replicas, " replicas");
  const int layers = Model(c.model).size();
  if (!p.balance.empty()) {
    const Partition part = partition_from_balance(parse_balance(p.balance), layers);
    MPIPE_REQUIRE(grid.stages == 0 || part.stages() == grid.stages, "give one count per stage",
                  "--balance has ", part.stages(), " stages, the grid has ", grid.stages);
  } else {
    MPIPE_REQUIRE(p.partition == "uniform" || p.partition == "params" || p.partition == "flops" || p.partition == "time",
                  "use --partition uniform, params, flops or time", "unknown --partition '", p.partition, "'");
  }
  MPIPE_REQUIRE(grid.stages <= layers, "use fewer stages or a deeper model", "more stages (", grid.stages,
                ") than layers (", layers, "); see 'mpipe plan' for the layer list");
}

Executor::Executor(const TrainConfig& config, const Communicator& world)
    : config_(config), world_(world), model_(config.model) {
  validate(config, world.size());
  config_.pipeline.grid = resolve_grid(config.pipeline.grid, world.size());
  micro_ = config.batch_size / (config.micro_batches * config_.pipeline.grid.replicas);
  shapes_ = model_.shapes(micro_);
}

Executor::~Executor() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // Point-to-point requests left by a failed step; collectives may not be cancelled.
  for (auto* list : {&recv_act_req_, &recv_grad_req_, &send_req_})
    for (MPI_Request& r : *list)
      if (r != MPI_REQUEST_NULL) {
        MPI_Cancel(&r);
        MPI_Request_free(&r);
      }
}

void Executor::connect() {
  grid_ = std::make_unique<Grid>(world_, config_.pipeline.grid);
  const auto& p = config_.pipeline;
  const int K = grid_->stages();
  if (!p.balance.empty()) {
    partition_ = partition_from_balance(parse_balance(p.balance), model_.size());
  } else if (p.partition == "time") {
    // Measured once, on world rank 0, so every rank cuts at the same layers.
    // Measured once, on a model of its own (its layers' views die with the probe), and
    // a failure is broadcast as NaN so that no rank is left in the broadcast.
    std::vector<double> costs(model_.size(), 0.0);
    std::string problem;
    if (world_.rank() == 0) {
      try {
        Model probe(config_.model);
        costs = measure_layer_times(probe, micro_, config_.seed);
      } catch (const std::exception& e) {
        problem = e.what();
        costs.assign(costs.size(), std::nan(""));
      }
    }
    world_.broadcast(std::span<double>(costs), 0);
    if (std::isnan(costs[0])) throw Error(cat("measuring layer times on rank 0 failed", problem.empty() ? "" : ": " + problem));
    partition_ = partition_min_max(costs, K);
  } else {
    partition_ = partition_min_max(layer_costs(model_, p.partition, micro_), K);
  }
  begin_ = partition_.begin(grid_->stage());
  end_ = partition_.end(grid_->stage());
  // Tied weights: every tie must join the same two stages (GPT has one tie).
  int owner_stage = 0, copy_stage = 0;
  bool found = false;
  for (const Model::Tie& tie : model_.ties()) {
    const int a = partition_.stage_of(tie.owner_layer), b = partition_.stage_of(tie.copy_layer);
    MPIPE_CHECK(!found || (a == owner_stage && b == copy_stage), "tied weights across different stage pairs");
    owner_stage = a;
    copy_stage = b;
    found = true;
  }
  grid_->connect_tied(owner_stage, copy_stage);
}

void Executor::allocate() {
  const int M = config_.micro_batches, K = grid_->stages(), D = grid_->replicas();
  schedule_ = lower(make_schedule(config_.pipeline.schedule, K, M));
  if (auto problem = validate(schedule_)) throw Error(cat("schedule ", schedule_.name, " is invalid: ", *problem));
  params_ = std::make_unique<ParamStore>(model_, begin_, end_, config_.seed);
  optimizer_ = std::make_unique<Optimizer>(*params_, config_.optimizer);

  const bool first = grid_->first_stage(), last = grid_->last_stage();
  if (first || last) {
    dataset_ = make_dataset(config_.data, config_.model, config_.seed);
    const int share = config_.batch_size / D;
    const Shape in = model_.input_shape(share), tg = model_.target_shape(share);
    batch_memory_ = std::make_unique<std::byte[]>(static_cast<std::size_t>(in.numel() + tg.numel()) * 4);
    inputs_ = {batch_memory_.get(), in, model_.input_dtype(), Device::cpu};
    targets_ = {batch_memory_.get() + in.numel() * 4, tg, DType::i32, Device::cpu};
  }
  recv_act_.clear();
  recv_grad_.clear();
  for (int mb = 0; mb < M; ++mb) {
    if (!first) recv_act_.emplace_back(static_cast<std::size_t>(shapes_[begin_].numel()));
    if (!last) recv_grad_.emplace_back(static_cast<std::size_t>(shapes_[end_].numel()));
  }
  recv_act_req_.assign(M, MPI_REQUEST_NULL);
  recv_grad_req_.assign(M, MPI_REQUEST_NULL);
  send_req_.reserve(2 * static_cast<std::size_t>(M));
  outputs_.assign(M, Tensor{});
  input_grads_.assign(M, Tensor{});
  contexts_.assign(M, nullptr);
  reduce_buffer_.assign(model_.size() + 3, 0.0);  // per layer, loss, bubble, stop

  // One bucket per layer with parameters, from the last layer down: gradients become
  // final in that order during the last micro-batch's backward. Whole layers, and never
  // more than one, so every message is the same whatever K is: MPI's reduction order
  // may depend on the message size, and promise 1 must hold for any D too.
  buckets_.clear();
  if (D > 1) {
    const auto entries = params_->entries();
    std::size_t hi = params_->grads().size();
    for (int layer = end_ - 1; layer >= begin_; --layer) {
      std::size_t lo = hi;
      for (const ParamEntry& e : entries)
        if (e.layer == layer) lo = std::min(lo, e.offset);
      if (lo < hi) {
        buckets_.push_back({layer, lo, hi});
        hi = lo;
      }
    }
  }
  bucket_req_.assign(buckets_.size(), MPI_REQUEST_NULL);

  // Tied weights split over stages: the owner's and the copy's gradient spans, in entry
  // order (the owner and the copy each hold one entry per tie, so the two ranks agree).
  tied_spans_.clear();
  if (K > 1) {
    for (const ParamEntry& e : params_->entries()) {
      // A copy held apart from its owner, or an owner whose copy is on a later stage (an
      // alias copy is summed locally).
      const bool tied = (e.tied_copy && !e.alias) || model_.copy_layer_of(e.layer, e.name) >= end_;
      if (tied) {
        MPIPE_CHECK(!grid_->tied().null(), "stage ", grid_->stage(), " holds a tied weight but no tied group");
        tied_spans_.emplace_back(e.offset, static_cast<std::size_t>(e.numel()));
      }
    }
  }

  trace_.clear();
  if (!config_.trace.empty()) {
    // Every action of every traced step, plus the reductions: sized once, here.
    std::size_t per_step = schedule_.actions[grid_->stage()].size() + static_cast<std::size_t>(M) + 8;
    trace_.reserve(per_step * static_cast<std::size_t>(std::max(0, config_.trace_steps)));
  }
  if (const char* fail = std::getenv("MPIPE_TEST_FAIL")) {
    // Test hook: MPIPE_TEST_FAIL=RANK:STEP[:stall] makes that world rank throw (or hang)
    // in its first forward of that step, to check that one failing or stuck rank ends
    // the whole job.
    char mode[16] = "";
    if (std::sscanf(fail, "%d:%d:%15s", &fail_rank_, &fail_step_, mode) < 2) fail_rank_ = fail_step_ = -1;
    fail_stall_ = std::strcmp(mode, "stall") == 0;
  }
}

std::size_t Executor::peak_activation_bytes() const { return persistent_.high_water() + scratch_.high_water(); }

bool Executor::rematerialize(int micro_batch) const {
  const std::string& mode = config_.pipeline.remat;
  return mode == "always" || (mode == "except-last" && micro_batch != config_.micro_batches - 1);
}

Pass Executor::make_pass(std::int64_t step, int mb, Arena* arena) const {
  Pass pass;
  pass.arena = arena;
  pass.seed = config_.seed;
  pass.step = static_cast<std::uint64_t>(step);
  const int share = config_.batch_size / grid_->replicas();
  pass.sample_begin = static_cast<std::uint64_t>(grid_->replica() * share + mb * micro_);
  pass.training = true;
  if (grid_->last_stage()) {
    const Shape tg = model_.target_shape(micro_);
    pass.targets = {static_cast<std::byte*>(targets_.data) + static_cast<std::size_t>(mb) * tg.numel() * 4, tg,
                    DType::i32, Device::cpu};
  }
  pass.loss_scale = 1.0f / static_cast<float>(static_cast<std::int64_t>(config_.batch_size) * model_.rows_per_sample());
  return pass;
}

Context* Executor::forward_layers(const Pass& pass, int mb, Tensor* output) {
  const int n = end_ - begin_;
  Tensor x;
  if (grid_->first_stage()) {
    const Shape in = shapes_[0];
    x = {static_cast<std::byte*>(inputs_.data) + static_cast<std::size_t>(mb) * in.numel() * 4, in,
         model_.input_dtype(), Device::cpu};
  } else {
    x = make_tensor(recv_act_[mb].data(), shapes_[begin_]);
  }
  Context* contexts = pass.arena->objects<Context>(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) x = model_.layer(begin_ + i).forward(x, contexts[i], pass);
  *output = x;
  return contexts;
}

void Executor::run_forward(std::int64_t step, int mb) {
  if (world_.rank() == fail_rank_ && step == fail_step_) {
    if (fail_stall_)
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    throw Error("injected failure (MPIPE_TEST_FAIL)");
  }
  const auto start = Clock::now();
  const bool remat = rematerialize(mb);
  Tensor out;
  Context* contexts = forward_layers(make_pass(step, mb, remat ? &scratch_ : &persistent_), mb, &out);
  if (grid_->last_stage()) loss_sum_ += contexts[end_ - begin_ - 1].value;
  if (remat) {
    // Keep only what leaves the stage; the contexts die with the scratch arena.
    if (!grid_->last_stage()) {
      Tensor kept = persistent_.tensor(out.shape);
      std::memcpy(kept.data, out.data, out.bytes());
      out = kept;
    }
    scratch_.reset();
    contexts = nullptr;
  }
  outputs_[mb] = out;
  contexts_[mb] = contexts;
  times_.forward += since(start);
  record(step, TraceEvent::forward, mb, start);
}

void Executor::run_backward(std::int64_t step, int mb) {
  const int n = end_ - begin_;
  Context* contexts = contexts_[mb];
  if (!contexts) {
    // Recompute the forward with the same pass, hence the same dropout masks.
    const auto start = Clock::now();
    Tensor unused;
    contexts = forward_layers(make_pass(step, mb, &scratch_), mb, &unused);
    times_.recompute += since(start);
    record(step, TraceEvent::recompute, mb, start);
  }
  const auto start = Clock::now();
  const Pass pass = make_pass(step, mb, &scratch_);
  static float loss_gradient = 1.0f;  // the loss layer ignores its incoming gradient
  Tensor dy = grid_->last_stage() ? make_tensor(&loss_gradient, Shape{1})
                                  : make_tensor(recv_grad_[mb].data(), shapes_[end_]);
  const bool last_micro_batch = mb == config_.micro_batches - 1;
  std::size_t next_bucket = 0;
  for (int i = n - 1; i >= 0; --i) {
    const Shape& in = shapes_[begin_ + i];
    Tensor dx;
    if (i > 0) dx = scratch_.tensor(in);
    else if (!grid_->first_stage()) dx = input_grads_[mb] = persistent_.tensor(in);
    model_.layer(begin_ + i).backward(contexts[i], dy, dx, GradMode::overwrite, pass);
    dy = dx;
    // This layer's gradients are final after the last micro-batch: start the buckets
    // it completes, so the allreduce overlaps the rest of the backward.
    while (last_micro_batch && next_bucket < buckets_.size() && buckets_[next_bucket].lowest_layer == begin_ + i) {
      const Bucket& b = buckets_[next_bucket];
      bucket_req_[next_bucket++] = grid_->data().iallreduce(params_->grads().subspan(b.begin, b.end - b.begin), Reduce::sum);
    }
  }
  scratch_.reset();
  times_.backward += since(start);
  record(step, TraceEvent::backward, mb, start);
}

void Executor::run_pipeline(std::int64_t step) {
  const auto start = Clock::now();
  const int M = config_.micro_batches;
  const int stage = grid_->stage();
  const Communicator& pipe = grid_->pipeline();
  const double timeout = config_.pipeline.p2p_timeout;
  loss_sum_ = 0.0;
  persistent_.reset();  // also when compute_gradients() is called without step()
  params_->zero_grads();
  if (dataset_) {
    const int share = config_.batch_size / grid_->replicas();
    dataset_->fill(static_cast<std::uint64_t>(step) * config_.batch_size + static_cast<std::uint64_t>(grid_->replica() * share),
                   share, inputs_, targets_);
  }
  // Every receive of the step is posted before any compute.
  for (int mb = 0; mb < M; ++mb) {
    if (!grid_->first_stage())
      recv_act_req_[mb] = pipe.irecv(recv_act_[mb].span(), stage - 1, message_tag(mb, Direction::forward));
    if (!grid_->last_stage())
      recv_grad_req_[mb] = pipe.irecv(recv_grad_[mb].span(), stage + 1, message_tag(mb, Direction::backward));
  }
  send_req_.clear();
  for (const Action& action : schedule_.actions[stage]) {
    const int mb = action.micro_batch;
    const auto action_start = Clock::now();
    try {
      switch (action.kind) {
        case ActionKind::forward: run_forward(step, mb); break;
        case ActionKind::backward: run_backward(step, mb); break;
        case ActionKind::recv_act:
          times_.p2p_wait += wait_for(recv_act_req_[mb], timeout, "the activation of micro-batch", mb,
                                      static_cast<long>(recv_act_[mb].size()));
          record(step, TraceEvent::recv_act, mb, action_start);
          break;
        case ActionKind::recv_grad:
          times_.p2p_wait += wait_for(recv_grad_req_[mb], timeout, "the gradient of micro-batch", mb,
                                      static_cast<long>(recv_grad_[mb].size()));
          record(step, TraceEvent::recv_grad, mb, action_start);
          break;
        case ActionKind::send_act:
          send_req_.push_back(pipe.isend(outputs_[mb].span(), stage + 1, message_tag(mb, Direction::forward)));
          record(step, TraceEvent::send_act, mb, action_start);
          break;
        case ActionKind::send_grad:
          send_req_.push_back(pipe.isend(input_grads_[mb].span(), stage - 1, message_tag(mb, Direction::backward)));
          record(step, TraceEvent::send_grad, mb, action_start);
          break;
      }
    } catch (const std::exception& e) {
      throw Error(cat("rank ", world_.rank(), " (stage ", stage, ", replica ", grid_->replica(), ") at step ", step,
                      " during ", to_string(action), ": ", e.what()));
    }
  }
  const auto sends_start = Clock::now();
  times_.p2p_wait += wait_all(send_req_, timeout, "a send to a neighbour stage, request");
  record(step, TraceEvent::send_wait, -1, sends_start);
  const double pipeline_time = since(start);
  const double busy = times_.forward + times_.backward + times_.recompute;
  reduce_buffer_[model_.size() + 1] = pipeline_time > 0 ? std::max(0.0, 1.0 - busy / pipeline_time) : 0.0;
}

void Executor::reduce_gradients() {
  const auto start = Clock::now();
  const double timeout = config_.pipeline.p2p_timeout;
  wait_all(bucket_req_, timeout, "the gradient allreduce of bucket");
  // Tied weights: owner (first stage) and copy (last stage) end with the sum of both.
  params_->sum_local_tied_grads();
  for (const auto& [offset, count] : tied_spans_) {
    MPI_Request request = grid_->tied().iallreduce(params_->grads().subspan(offset, count), Reduce::sum);
    wait_for(request, timeout, "the tied-weight gradient sum, span", static_cast<int>(offset), -1);
  }
  times_.allreduce += since(start);
}

double Executor::compute_gradients(std::int64_t step) {
  run_pipeline(step);
  const auto reduce_start = Clock::now();
  reduce_gradients();
  // One allreduce over the world agrees on the loss, the per-layer gradient norms and
  // the bubble. Each per-layer entry has exactly one non-zero contributor (replica 0 of
  // the owning stage) and x + 0 = x, so the norm is bitwise the same for every K and D.
  const auto start = Clock::now();
  const int L = model_.size();
  std::span<double> per_layer(reduce_buffer_.data(), static_cast<std::size_t>(L));
  std::fill(per_layer.begin(), per_layer.end(), 0.0);
  if (grid_->replica() == 0) params_->grad_sum_squares(per_layer.subspan(begin_, end_ - begin_));
  reduce_buffer_[L] = grid_->last_stage() ? loss_sum_ : 0.0;
  reduce_buffer_[L + 2] = stop_requested_ ? 1.0 : 0.0;
  // Non-blocking and waited on with wait_for: a rank that finished early sleeps instead
  // of spinning in MPI while its neighbour still computes.
  MPI_Request request = world_.iallreduce(std::span<double>(reduce_buffer_), Reduce::sum);
  wait_for(request, config_.pipeline.p2p_timeout, "the loss and gradient-norm allreduce, step", static_cast<int>(step), -1);
  times_.allreduce += since(start);
  record(step, TraceEvent::allreduce, -1, reduce_start);
  return reduce_buffer_[L] / static_cast<double>(static_cast<std::int64_t>(config_.batch_size) * model_.rows_per_sample());
}

StepResult Executor::step(std::int64_t step) {
  try {
    return step_unchecked(step);
  } catch (const std::exception& e) {
    // The action loop names its action already; everything else gets rank and stage.
    const std::string what = e.what();
    if (what.rfind("rank ", 0) == 0) throw;
    throw Error(cat("rank ", world_.rank(), " (stage ", grid_->stage(), ", replica ", grid_->replica(), ") at step ",
                    step, " during the gradient reduction or update: ", what));
  }
}

StepResult Executor::step_unchecked(std::int64_t step) {
  const auto start = Clock::now();
  times_ = PhaseTimes{};
  StepResult r;
  r.step = step;
  r.loss = compute_gradients(step);
  const int L = model_.size();
  double total = 0.0;
  for (int i = 0; i < L; ++i) total += reduce_buffer_[i];  // global layer order
  r.grad_norm = std::sqrt(total);
  r.bubble_fraction = reduce_buffer_[L + 1] / world_.size();
  r.stop = reduce_buffer_[L + 2] > 0.0;
  r.lr = learning_rate(config_.optimizer, step, config_.steps);
  // Every rank sees the same loss and norm, so every rank skips or steps alike.
  if (!std::isfinite(r.grad_norm) || !std::isfinite(r.loss)) {
    r.skipped = true;
  } else {
    const auto opt_start = Clock::now();
    const float clip = config_.optimizer.clip_grad;
    if (clip > 0.0f && r.grad_norm > clip) {
      const auto factor = static_cast<float>(clip / r.grad_norm);
      cpu::scale(params_->grads().data(), factor, static_cast<int64_t>(params_->grads().size()));
    }
    optimizer_->update(r.lr, ++updates_);
    times_.optimizer += since(opt_start);
    record(step, TraceEvent::optimizer, -1, opt_start);
  }
  persistent_.reset();
  r.seconds = since(start);
  times_.step = r.seconds;
  times_.idle = std::max(0.0, r.seconds - (times_.forward + times_.backward + times_.recompute + times_.p2p_wait +
                                           times_.allreduce + times_.optimizer));
  return r;
}

}  // namespace mpipe
