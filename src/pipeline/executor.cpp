// The executor: one switch over action kinds, driving the rank's stages, the transport,
// the reducer and the step device.
#include "mpipe/pipeline/executor.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "mpipe/backend/ops.hpp"

namespace mpipe {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

const char* TraceEvent::name(int kind) {
  static const char* names[count] = {"forward",       "backward",      "recompute", "send activation",
                                     "wait activation", "send gradient", "wait gradient", "wait sends",
                                     "allreduce",     "optimizer",     "gradient sum", "tied-weight sum",
                                     "weight gradient"};
  return names[kind];
}

void Executor::start_trace_clock() {
  world_.barrier();  // every rank leaves the barrier within microseconds: a shared origin
  trace_origin_ = Clock::now();
}

void Executor::record(std::int64_t step, int kind, int micro_batch, Clock::time_point start, Clock::time_point end,
                      int layer) {
  if (evaluating_ || !tracing(step)) return;
  TraceEvent e;
  e.start = std::chrono::duration<double>(start - trace_origin_).count();
  e.end = std::chrono::duration<double>(end - trace_origin_).count();
  e.step = static_cast<std::int32_t>(step);
  e.kind = static_cast<std::int16_t>(kind);
  e.micro_batch = static_cast<std::int16_t>(micro_batch);
  e.layer = layer;
  if (micro_batch >= 0) e.stage = trace_stage_;
  trace_.push_back(e);
}

const char* PhaseTimes::name(int i) {
  static const char* names[count] = {"forward", "backward", "recompute", "p2p wait", "allreduce", "optimizer", "idle", "step"};
  return names[i];
}

Executor::Executor(const Plan& plan, const Communicator& world)
    : plan_(plan), world_(world), model_(plan.options.model), micro_(plan.micro_batch_size) {
  MPIPE_CHECK(plan.ranks == world.size(), "a plan for ", plan.ranks, " ranks on ", world.size());
  shapes_ = model_.shapes(micro_);
  if (plan.options.device == Device::cuda) {
    for (int i = 0; i < model_.size(); ++i) {
      const LayerKind* kind = find_layer_kind(model_.layer(i).kind());
      MPIPE_REQUIRE(!kind || kind->gpu, "run this model with --device cpu", "layer ", i, " (", model_.layer(i).kind(),
                    ") has no GPU kernels yet");
    }
    MPIPE_CHECK(cuda::active(), "--device cuda without cuda::init()");
    device_ = Device::cuda;
    dtype_ = plan.options.precision;
    cuda_aware_ = mpi_cuda_aware();
  }
  persistent_ = std::make_unique<Arena>(ops::device_memory(device_));
  scratch_ = std::make_unique<Arena>(ops::device_memory(device_));
}

// Requests a failed step left behind are cancelled by Progress.
Executor::~Executor() = default;

void Executor::connect() {
  grid_ = std::make_unique<Grid>(world_, plan_.grid);
  stages_.clear();
  chunk_of_.assign(static_cast<std::size_t>(partition_.stages()), -1);
  for (const int m : schedule_.stages_of(grid_->stage())) {
    chunk_of_[static_cast<std::size_t>(m)] = static_cast<int>(stages_.size());
    stages_.emplace_back(model_, m, partition_.begin(m), partition_.end(m), partition_.stages(), plan_.options.micro_batches);
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
    dataset_ = make_dataset(plan_.options.data, model_, plan_.options.seed);
    if (!plan_.options.eval_data.empty())
      eval_dataset_ = make_dataset(plan_.options.eval_data, model_, plan_.options.seed, true);
  }
}

void Executor::allocate() {
  const int M = plan_.options.micro_batches, D = grid_->replicas();
  const int C = static_cast<int>(stages_.size());
  split_ = schedule_.splits(grid_->stage());
  params_ = std::make_unique<ParamStore>(model_, layers(), plan_.options.seed);
  optimizer_ = std::make_unique<Optimizer>(*params_, plan_.options.optimizer);
  if (device_ == Device::cuda) {
    params_->to_device(dtype_);
    optimizer_->to_device();
  }
  // Forward, backward, weight gradient and recompute of every micro-batch on every stage.
  device_ops_ = StepDevice::make(device_, cuda_aware_, 4 * M * C);
  if (needs_batch()) {
    const int share = plan_.replica_batch;
    device_ops_->allocate_batch(model_.input_shape(share), model_.input_dtype(), model_.target_shape(share));
  }
  slots_ = std::make_unique<SlotPool>(in_flight(schedule_, grid_->stage()), device_);
  // Two more buffers than micro-batches in flight: a send posted two of the stage's Bs
  // (forwards) ago has found its posted receive and completed by the time its buffer
  // comes round again, so taking it rarely waits.
  const int ring = std::min(M, in_flight(schedule_, grid_->stage()) + 2);
  const bool remat = plan_.options.remat != Remat::never;
  gradient_rings_.assign(static_cast<std::size_t>(C), SendRing{});
  output_rings_.assign(static_cast<std::size_t>(C), SendRing{});
  for (int c = 0; c < C; ++c) {
    const Stage& stage = stages_[static_cast<std::size_t>(c)];
    for (auto [rings, used] : {std::pair{&gradient_rings_, !stage.first()}, std::pair{&output_rings_, remat && !stage.last()}})
      if (used) {
        (*rings)[static_cast<std::size_t>(c)].buffers.resize(static_cast<std::size_t>(ring));
        (*rings)[static_cast<std::size_t>(c)].owner.assign(static_cast<std::size_t>(ring), -1);
      }
  }
  reducer_ = std::make_unique<Reducer>(*grid_, model_, partition_, *params_, layers(), *device_ops_,
                                       plan_.options.batchnorm == BatchNormRule::deferred, plan_.options.p2p_timeout);
  if (plan_.options.overlap_steps) {
    buffer_spans_.clear();
    std::size_t buffers = 0;
    for (const ParamEntry& e : params_->entries())
      if (e.buffer && !e.alias) {
        buffer_spans_.emplace_back(e.param_offset, static_cast<std::size_t>(e.numel()));
        buffers += static_cast<std::size_t>(e.numel());
      }
    const std::size_t sizes[saved_parts] = {params_->master().size(), params_->grads().size(),
                                            optimizer_->live_state(0).size(), optimizer_->live_state(1).size(), buffers};
    for (int part = 0; part < saved_parts; ++part) saved_at_[part + 1] = saved_at_[part] + sizes[part];
    if (device_ == Device::cuda) {
      saved_device_ = cuda::DeviceBuffer(std::max<std::size_t>(1, saved_at_[saved_parts]) * sizeof(float));
      saved_ = saved_device_.as<float>();
    } else {
      saved_host_.resize(saved_at_[saved_parts]);
      saved_ = saved_host_.data();
    }
  }
  // Every request in flight at once: each micro-batch's two receives and two sends on
  // every stage, and the reducer's.
  const int requests = 4 * M * C + reducer_->requests() + 2;
  // Waits sleep between tests once nothing moves, unless asked to spin (docs/communication.md).
  const bool spin_waits = plan_.options.comm_wait == CommWait::spin;
  progress_ = std::make_unique<Progress>(plan_.options.comm_progress, plan_.options.comm_poll_s, requests, spin_waits, [] {
                                           if (cuda::active()) cuda::bind_thread();
                                         });
  reducer_->connect(*progress_);
  std::vector<Transport::Channel> channels;
  for (const Stage& c : stages_)
    channels.push_back({c.index(), shapes_[static_cast<std::size_t>(c.begin())], shapes_[static_cast<std::size_t>(c.end())],
                        c.first(), c.last(), c.first() ? -1 : schedule_.list_of(c.index() - 1),
                        c.last() ? -1 : schedule_.list_of(c.index() + 1)});
  transport_ = std::make_unique<Transport>(*grid_, *progress_, device_, dtype_, cuda_aware_, M, std::move(channels),
                                           partition_.stages(), plan_.options.p2p_timeout);

  trace_.clear();
  if (plan_.options.trace_steps > 0) {
    // Every action and transfer of every traced step, plus the reductions: sized once, here.
    std::size_t per_step = schedule_.actions[grid_->stage()].size() + 3 * static_cast<std::size_t>(M * C) +
                           static_cast<std::size_t>(reducer_->requests()) + 8;
    trace_.reserve(per_step * static_cast<std::size_t>(plan_.options.trace_steps));
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

void Executor::download_state() {
  if (device_ == Device::cpu) return;  // the host's copy is the only one
  params_->download();
  optimizer_->download();
}

void Executor::upload_state() {
  if (device_ == Device::cpu) return;
  params_->upload();
  optimizer_->upload();
}

std::size_t Executor::peak_activation_bytes() const {
  return persistent_->high_water() + scratch_->high_water() + slots_->high_water();
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

void Executor::fill_send_rings() {
  for (std::size_t c = 0; c < stages_.size(); ++c) {
    const Stage& stage = stages_[c];
    for (auto [ring, shape] : {std::pair{&gradient_rings_[c], shapes_[static_cast<std::size_t>(stage.begin())]},
                               std::pair{&output_rings_[c], shapes_[static_cast<std::size_t>(stage.end())]}}) {
      for (Tensor& t : ring->buffers) t = persistent_->tensor(shape, dtype_);
      std::fill(ring->owner.begin(), ring->owner.end(), -1);
      ring->next = 0;
    }
  }
}

Tensor Executor::take_send_buffer(SendRing& ring, Direction direction, int c, int mb) {
  const std::size_t r = static_cast<std::size_t>(ring.next);
  ring.next = (ring.next + 1) % static_cast<int>(ring.buffers.size());
  if (ring.owner[r] >= 0) times_.p2p_wait += transport_->wait_sent(direction, c, ring.owner[r]);
  ring.owner[r] = mb;
  return ring.buffers[r];
}

Arena* Executor::take_slot(Stage& stage, int mb) {
  const int slot = slots_->take();
  stage.micro_batch(mb).slot = slot;
  return &slots_->slot(slot);
}

// After micro-batch mb's backward (its W): its activations are dead once the send of its
// output (which lives in the slot) has completed; by now the next stage has used it.
void Executor::release_slot(int c, int mb) {
  Stage& stage = stages_[static_cast<std::size_t>(c)];
  Stage::MicroBatch& m = stage.micro_batch(mb);
  if (m.slot < 0) return;
  if (!stage.last()) times_.p2p_wait += transport_->wait_sent(Direction::forward, c, mb);
  slots_->release(m.slot);
  m = Stage::MicroBatch{.input_grad = m.input_grad};  // the gradient B sent lives in the persistent arena
}

Pass Executor::make_pass(std::int64_t step, const Stage& stage, int mb, Arena* arena) const {
  Pass pass;
  pass.arena = arena;
  pass.seed = plan_.options.seed;
  pass.step = static_cast<std::uint64_t>(step);
  const int share = plan_.replica_batch;
  pass.sample_begin = static_cast<std::uint64_t>(grid_->replica() * share + mb * micro_);
  pass.training = true;
  pass.deferred_statistics = plan_.options.batchnorm == BatchNormRule::deferred;
  pass.dtype = dtype_;
  if (stage.targets()) {
    const Shape tg = model_.target_shape(micro_);
    pass.targets = {static_cast<std::byte*>(device_ops_->targets().data) + static_cast<std::size_t>(mb) * tg.numel() * 4,
                    tg, DType::i32, device_};
    if (stage.last()) pass.device_loss_sum = device_ops_->loss_sum();
  }
  pass.loss_scale = 1.0f / static_cast<float>(static_cast<std::int64_t>(plan_.options.batch_size) * model_.rows_per_sample());
  return pass;
}

// What stage c's forward of micro-batch mb reads: its share of the batch's inputs on the
// model's first stage (tokens, or features converted for bf16 training), else what the
// previous model stage sent.
Tensor Executor::stage_input(const Pass& pass, int c, int mb) {
  if (!stages_[static_cast<std::size_t>(c)].first()) return transport_->received(Direction::forward, c, mb);
  const Shape in = shapes_[0];
  Tensor x = {static_cast<std::byte*>(device_ops_->inputs().data) + static_cast<std::size_t>(mb) * in.numel() * 4, in,
              model_.input_dtype(), device_};
  if (x.dtype == DType::f32 && dtype_ != DType::f32) {  // the MLP's features, in bf16 training
    const Tensor converted = pass.arena->tensor(in, dtype_);
    ops::convert(converted, x);
    x = converted;
  }
  return x;
}

// A compute action's time: on the CPU measured now, into its phase and the trace; on a
// GPU the device times it between events, read once the step's work is done.
void Executor::begin_compute(int kind, int micro_batch) { device_ops_->begin_compute(kind, micro_batch, trace_stage_); }

void Executor::end_compute(std::int64_t step, int kind, int micro_batch, Clock::time_point start) {
  device_ops_->end_compute();
  if (!device_ops_->host_timed()) return;
  account(kind, since(start));
  record(step, kind, micro_batch, start);
}

void Executor::account(int kind, double seconds) {
  (kind == TraceEvent::forward     ? times_.forward
   : kind == TraceEvent::recompute ? times_.recompute
                                   : times_.backward) += seconds;
  if (kind == TraceEvent::weight) times_.weight += seconds;
}

void Executor::read_device_times(std::int64_t step) {
  const double origin = std::chrono::duration<double>(device_ops_->origin() - trace_origin_).count();
  for (const StepDevice::Timed& t : device_ops_->timed()) {
    account(t.kind, t.end - t.start);
    if (evaluating_ || !tracing(step)) continue;
    TraceEvent e;
    e.start = origin + t.start;
    e.end = origin + t.end;
    e.step = static_cast<std::int32_t>(step);
    e.kind = static_cast<std::int16_t>(t.kind);
    e.micro_batch = static_cast<std::int16_t>(t.micro_batch);
    e.stage = t.stage;
    trace_.push_back(e);
  }
}

void Executor::run_forward(std::int64_t step, int c, int mb, bool training) {
  if (world_.rank() == fail_rank_ && step == fail_step_) {
    if (fail_stall_)
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    throw Error("injected failure (MPIPE_TEST_FAIL)");
  }
  Stage& stage = stages_[static_cast<std::size_t>(c)];
  const auto start = Clock::now();
  begin_compute(TraceEvent::forward, mb);
  const bool remat = training && plan_.rematerialize(mb);
  Pass pass = make_pass(step, stage, mb, remat ? scratch_.get() : training ? take_slot(stage, mb) : persistent_.get());
  pass.training = training;
  Tensor out;
  Context* contexts = stage.forward(pass, stage_input(pass, c, mb), &out, *progress_);
  if (stage.last()) {
    const Context& loss = contexts[stage.end() - stage.begin() - 1];
    loss_sum_ += loss.value;
    correct_sum_ += loss.correct;
  }
  if (remat) {
    // Keep only what leaves the stage; the contexts die with the scratch arena (whose
    // memory the GPU stream reuses only after this copy, in stream order).
    if (!stage.last()) {
      const Tensor kept = take_send_buffer(output_rings_[static_cast<std::size_t>(c)], Direction::forward, c, mb);
      device_ops_->copy(kept.data, out.data, out.bytes());
      out = kept;
    }
    scratch_->reset();
    contexts = nullptr;
  }
  Stage::MicroBatch& m = stage.micro_batch(mb);
  m.output = out;
  m.contexts = contexts;
  end_compute(step, TraceEvent::forward, mb, start);
}

// Where the schedule splits the backward (split_), this is B: the input gradients, with
// what W needs (each Linear's dy) kept in the micro-batch's slot, which lives on until
// its W; a rematerialized forward is recomputed into a slot too, for W's sake.
void Executor::run_backward(std::int64_t step, int c, int mb) {
  Stage& stage = stages_[static_cast<std::size_t>(c)];
  Stage::MicroBatch& m = stage.micro_batch(mb);
  Context* contexts = m.contexts;
  if (!contexts) {
    // Recompute the forward with the same pass, hence the same dropout masks.
    const auto start = Clock::now();
    begin_compute(TraceEvent::recompute, mb);
    Tensor unused;
    Pass recompute = make_pass(step, stage, mb, split_ ? take_slot(stage, mb) : scratch_.get());
    recompute.recompute = true;
    recompute.device_loss_sum = nullptr;  // the forward counted this micro-batch's loss
    contexts = stage.forward(recompute, stage_input(recompute, c, mb), &unused, *progress_);
    if (split_) m.contexts = contexts;
    end_compute(step, TraceEvent::recompute, mb, start);
  }
  const auto start = Clock::now();
  begin_compute(TraceEvent::backward, mb);
  Pass pass = make_pass(step, stage, mb, scratch_.get());
  if (split_) pass.stash = &slots_->slot(m.slot);
  static float loss_gradient = 1.0f;  // the loss layer ignores its incoming gradient
  const Tensor dy = stage.last() ? make_tensor(&loss_gradient, Shape{1}) : transport_->received(Direction::backward, c, mb);
  if (!stage.first()) m.input_grad = take_send_buffer(gradient_rings_[static_cast<std::size_t>(c)], Direction::backward, c, mb);
  const bool final = mb == plan_.options.micro_batches - 1 && !split_;
  stage.backward(contexts, dy, m.input_grad, pass, *scratch_, shapes_, dtype_, final ? reducer_.get() : nullptr, *progress_);
  scratch_->reset();
  end_compute(step, TraceEvent::backward, mb, start);
  if (!split_) release_slot(c, mb);
}

// W: the weight gradients B left, in the same layer order; the micro-batch's slot is
// free after it. Ws run in ascending micro-batch order (validate()), so every gradient
// sums its micro-batches in the same order as under the fused backward: bitwise equal.
void Executor::run_weight(std::int64_t step, int c, int mb) {
  Stage& stage = stages_[static_cast<std::size_t>(c)];
  Context* contexts = stage.micro_batch(mb).contexts;
  MPIPE_CHECK(split_ && contexts, "W", mb, " without its split backward");
  const auto start = Clock::now();
  begin_compute(TraceEvent::weight, mb);
  const Pass pass = make_pass(step, stage, mb, scratch_.get());
  const bool final = mb == plan_.options.micro_batches - 1;
  stage.weight(contexts, pass, final ? reducer_.get() : nullptr, *progress_);
  scratch_->reset();
  end_compute(step, TraceEvent::weight, mb, start);
  release_slot(c, mb);
}

void Executor::run_pipeline(std::int64_t step, bool training) {
  const auto start = Clock::now();
  const int list = grid_->stage();
  loss_sum_ = correct_sum_ = 0.0;
  persistent_->reset();  // also when compute_gradients() is called without step()
  if (training) fill_send_rings();
  slots_->reset();
  for (Stage& stage : stages_) stage.reset();
  if (training) params_->zero_grads();
  if (const Dataset* data = training ? dataset_.get() : eval_dataset_.get()) {
    const int share = plan_.replica_batch;
    try {
      data->fill(static_cast<std::uint64_t>(step) * plan_.options.batch_size + static_cast<std::uint64_t>(grid_->replica() * share),
                 share, holds_first() || !data->targets_alone() ? device_ops_->host_inputs() : Tensor{},
                 device_ops_->host_targets());
    } catch (const std::exception& e) {
      rethrow_as(e, cat(grid_->name(), " at ", training ? "step " : "evaluation batch ", step, " reading the batch: ", e.what()));
    }
    device_ops_->upload_batch();
  }
  device_ops_->begin_step(holds_last());
  // Every receive of the step is posted before any compute.
  transport_->post_receives(training);
  if (training) reducer_->begin_step();
  for (const Action& action : schedule_.actions[list]) {
    const int mb = action.micro_batch;
    const int c = chunk_of_[static_cast<std::size_t>(schedule_.stage_of(list, action))];  // this rank's stage
    if (schedule_.virtual_stages > 1) trace_stage_ = stages_[static_cast<std::size_t>(c)].index();
    if (!training && (action.kind == ActionKind::backward || action.kind == ActionKind::weight ||
                      action.kind == ActionKind::recv_grad || action.kind == ActionKind::send_grad))
      continue;
    const auto action_start = Clock::now();
    try {
      transport_->between_actions();
      progress_->poll();
      switch (action.kind) {
        case ActionKind::forward: run_forward(step, c, mb, training); break;
        case ActionKind::backward: run_backward(step, c, mb); break;
        case ActionKind::weight: run_weight(step, c, mb); break;
        case ActionKind::recv_act:
          times_.p2p_wait += transport_->receive(Direction::forward, c, mb);
          record(step, TraceEvent::recv_act, mb, action_start);
          break;
        case ActionKind::recv_grad:
          times_.p2p_wait += transport_->receive(Direction::backward, c, mb);
          record(step, TraceEvent::recv_grad, mb, action_start);
          break;
        case ActionKind::send_act:
          transport_->send(Direction::forward, c, mb, stages_[static_cast<std::size_t>(c)].micro_batch(mb).output);
          break;
        case ActionKind::send_grad:
          transport_->send(Direction::backward, c, mb, stages_[static_cast<std::size_t>(c)].micro_batch(mb).input_grad);
          break;
      }
    } catch (const std::exception& e) {
      rethrow_as(e, cat(grid_->name(), " at step ", step,
                        " during ", to_string(action), ": ", e.what()));
    }
  }
  const auto sends_start = Clock::now();
  times_.p2p_wait += transport_->finish_sends();
  record(step, TraceEvent::send_wait, -1, sends_start);
  for (const Transport::Transfer& t : transport_->sent()) {
    if (schedule_.virtual_stages > 1) trace_stage_ = stages_[static_cast<std::size_t>(t.channel)].index();
    record(step, t.direction == Direction::forward ? TraceEvent::send_act : TraceEvent::send_grad, t.micro_batch,
           t.posted, t.completed);
  }
  trace_stage_ = -1;
  // The step's compute is queued on a GPU: wait for it, read the loss and the action times.
  const double device_loss = device_ops_->finish_step(holds_last());
  if (!device_ops_->host_timed()) {
    if (holds_last()) loss_sum_ = device_loss;
    read_device_times(step);
  }
  pipeline_seconds_ = since(start);
}

void Executor::reduce_and_agree(std::int64_t step, double pipeline_seconds, double dropped) {
  const auto reduce_start = Clock::now();
  reducer_->reduce();
  for (const Reducer::Done& d : reducer_->done())
    record(step, d.sum == Reducer::Sum::replicas ? TraceEvent::gradient_sum : TraceEvent::tied_sum, -1, d.completion.posted,
           d.completion.completed, d.layer);
  reducer_->start_agree(holds_last() ? loss_sum_ : 0.0, times_.forward + times_.backward + times_.recompute - dropped,
                        pipeline_seconds, stop_requested_);
  times_.allreduce += since(reduce_start);
}

void Executor::finish_agree(std::int64_t step) {
  const auto agree_start = Clock::now();
  agreed_ = reducer_->finish_agree(step);
  times_.allreduce += since(agree_start);
  record(step, TraceEvent::allreduce, -1, agree_start);
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
  optimizer_->update(r.lr, ++updates_);
  reducer_->settle_buffers(true, updates_);
  device_ops_->synchronize();  // honest step times on a GPU
  times_.optimizer += since(opt_start);
  record(r.step, TraceEvent::optimizer, -1, opt_start);
}

void Executor::close_times(double seconds) {
  times_.step = seconds;
  times_.idle = std::max(0.0, seconds - (times_.forward + times_.backward + times_.recompute + times_.p2p_wait +
                                         times_.allreduce + times_.optimizer));
}

EvalResult Executor::evaluate() {
  MPIPE_CHECK(!plan_.options.eval_data.empty(), "evaluate() without --eval-data");
  MPIPE_CHECK(!pending_, "evaluate() with a step in flight (settle() it first)");
  int batches = plan_.options.eval_batches;
  if (batches == 0) {  // a file's whole batches (the same on every rank: rank 0 knows the size)
    double size = eval_dataset_ ? static_cast<double>(eval_dataset_->size()) : 0.0;
    world_.broadcast(std::span<double>(&size, 1), 0);
    batches = size > 0 ? std::max(1, static_cast<int>(size) / plan_.options.batch_size) : 8;
  }
  const PhaseTimes saved = times_;
  evaluating_ = true;
  double sums[2] = {0, 0};
  for (int b = 0; b < batches; ++b) {
    run_pipeline(b, false);
    sums[0] += loss_sum_;
    sums[1] += correct_sum_;
  }
  persistent_->reset();
  Progress::Ticket ticket = progress_->track(world_.iallreduce(std::span<double>(sums), Reduce::sum), false);
  progress_->wait(ticket, plan_.options.p2p_timeout, "the evaluation's allreduce, batch", batches);
  evaluating_ = false;
  times_ = saved;
  EvalResult r;
  r.samples = static_cast<std::int64_t>(batches) * plan_.options.batch_size;
  const double rows = static_cast<double>(r.samples * model_.rows_per_sample());
  r.loss = sums[0] / rows;
  r.accuracy = sums[1] / rows;
  return r;
}

namespace {

// Runs `f`, naming this rank and stage on an error that does not name them yet (the
// action loop names its action already).
template <class F>
auto named(const Grid& grid, std::int64_t step, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (what.rfind("rank ", 0) == 0) throw;
    rethrow_as(e, cat(grid.name(), " at step ", step, " during the gradient reduction or update: ", what));
  }
}

}  // namespace

std::span<float> Executor::live(Saved part) const {
  switch (part) {
    case values:
    case statistics: return params_->master();
    case gradients: return params_->grads();
    case first: return optimizer_->live_state(0);
    case second: return optimizer_->live_state(1);
    default: break;
  }
  MPIPE_CHECK(false, "no saved part ", static_cast<int>(part));
  return {};
}

void Executor::copy_saved(Saved part, bool back) {
  const std::span<float> state = live(part);
  float* saved = saved_ + saved_at_[part];
  const auto copy = [&](float* at, std::size_t count) {
    if (count == 0) return;  // SGD has no second state
    device_ops_->copy(back ? at : saved, back ? saved : at, count * sizeof(float));
    saved += count;
  };
  if (part != statistics) {
    copy(state.data(), state.size());
    return;
  }
  for (const auto& [offset, count] : buffer_spans_) copy(state.data() + offset, count);
}

StepResult Executor::step(std::int64_t step) {
  return named(*grid_, step, [&] { return step_unchecked(step); });
}

StepResult Executor::step_unchecked(std::int64_t step) {
  MPIPE_CHECK(!pending_, "step() with a step in flight (settle() it first)");
  const auto start = Clock::now();
  times_ = PhaseTimes{};
  compute_gradients(step);
  StepResult r = agreed_result(step);
  update(r);
  persistent_->reset();
  r.seconds = since(start);
  close_times(r.seconds);
  return r;
}

// --overlap-steps (post-validation, Qi et al. 2023, section 4): a rank updates its
// parameters as soon as its own part of a step is done, on the bet that the world's
// agreement will find the loss and norm finite and the norm within --clip-grad, and goes
// on with the next step's pipeline while the agreement moves. The first stages start the
// next step while the last ones finish this one, so the warm-up of one step fills the
// cool-down of the one before (ZB-H2's parallelogram). The bet is checked once this
// rank's next pipeline pass is done: won, the update stands, and it is the very update
// the agreement would have made; lost (every rank sees the same sum, so every rank
// alike), the pass is dropped, the state goes back to before the update, the agreed
// update (clipped, or none) is made, and the pass runs again. After a lost bet the next
// step waits for its agreement; the one after a step within the limits bets again.
std::span<const StepResult> Executor::advance(std::int64_t step) {
  if (!plan_.options.overlap_steps) {
    results_[0] = this->step(step);
    return {results_.data(), 1};
  }
  return named(*grid_, step, [&] { return advance_unchecked(step); });
}

std::span<const StepResult> Executor::advance_unchecked(std::int64_t step) {
  const auto start = Clock::now();
  times_ = PhaseTimes{};
  std::size_t n = 0;
  reducer_->clear_step_sums();
  run_pipeline(step);
  double dropped = 0;  // compute of a pass that was dropped: not busy, but bubble
  if (pending_) {
    results_[n++] = validate_pending(/*pass_done=*/true);
    if (results_[n - 1].rolled_back) {  // again, with the parameters the world agreed on
      dropped = times_.forward + times_.backward + times_.recompute;
      reducer_->clear_step_sums();
      run_pipeline(step);
    }
  }
  // The bubble as without --overlap-steps: each rank's pipeline pass, which starts as soon
  // as the rank is done with the step before and includes its wait for the first input.
  reduce_and_agree(step, pipeline_seconds_, dropped);
  if (speculate_) {
    const auto opt_start = Clock::now();
    for (const Saved part : {values, gradients, first, second}) copy_saved(part, /*back=*/false);
    optimizer_->update(learning_rate(plan_.options.optimizer, step, plan_.options.steps), ++updates_);
    reducer_->settle_buffers(true, updates_);
    copy_saved(statistics, /*back=*/false);
    times_.optimizer += since(opt_start);
    record(step, TraceEvent::optimizer, -1, opt_start);
    pending_ = true;
    pending_step_ = step;
    ++speculated_;
  }
  if (!pending_) {
    finish_agree(step);
    StepResult r = agreed_result(step);
    update(r);
    speculate_ = plain_update(r);
    r.seconds = since(start);
    results_[n++] = r;
  }
  persistent_->reset();
  // A step's time is this rank's cycle, from its pass's start to its update's end: steps
  // back to back follow each other at that pace.
  pending_seconds_ = since(start);
  close_times(pending_seconds_);
  return {results_.data(), n};
}

std::optional<StepResult> Executor::settle() {
  if (!pending_) return std::nullopt;
  return named(*grid_, pending_step_, [&] { return validate_pending(/*pass_done=*/false); });
}

StepResult Executor::validate_pending(bool pass_done) {
  pending_ = false;
  finish_agree(pending_step_);
  StepResult r = agreed_result(pending_step_);
  r.seconds = pending_seconds_;
  if (plain_update(r)) {
    speculate_ = true;
    return r;  // the update made ahead is the one the agreement makes
  }
  // The bet is lost: the next pass (if it ran) saw parameters the world does not agree
  // on. Its sums finish as on every other rank, then it is dropped.
  if (pass_done) reducer_->reduce();
  for (const Saved part : {values, gradients, first, second}) copy_saved(part, /*back=*/true);
  params_->refresh_compute_copy();  // a GPU's bf16 copy of the values
  --updates_;
  r.rolled_back = true;
  ++rolled_back_;
  speculate_ = false;
  update(r);  // the agreed one, as without --overlap-steps
  // Running statistics as the update made ahead left them (the dropped pass moved them,
  // and with --batchnorm deferred its sums replaced the step's); a skip settles them itself.
  if (!r.skipped) copy_saved(statistics, /*back=*/true);
  return r;
}

}  // namespace mpipe
