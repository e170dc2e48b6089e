// A model stage's layers, its micro-batches' state and buffers, and its F, B and W
// actions; the pool of activation slots.
#include "mpipe/pipeline/run/stage.hpp"

#include <algorithm>

#include "mpipe/backend/conv_ops.hpp"
#include "mpipe/backend/ops.hpp"

namespace mpipe {

SlotPool::SlotPool(int slots, Device device, Gauge* gauge) {
  for (int s = 0; s < slots; ++s) {
    slots_.push_back(std::make_unique<Arena>(ops::device_memory(device)));
    slots_.back()->count_in(gauge);
  }
  free_.reserve(slots_.size());
  reset();
}

int SlotPool::take() {
  MPIPE_CHECK(!free_.empty(), "more micro-batches in flight than the schedule's ", slots_.size());
  const int slot = free_.back();
  free_.pop_back();
  return slot;
}

void SlotPool::release(int index) {
  slots_[static_cast<std::size_t>(index)]->reset();
  free_.push_back(index);
}

void SlotPool::reset() {
  free_.clear();
  for (std::size_t s = slots_.size(); s-- > 0;) {
    slots_[s]->reset();
    free_.push_back(static_cast<int>(s));
  }
}

Stage::Stage(Model& model, int index, int channel, int begin, int end, int model_stages, int micro_batches)
    : model_(model), index_(index), channel_(channel), begin_(begin), end_(end),
      weights_in_backward_from_(weights_in_backward_from(model, begin, end)), first_(index == 0),
      last_(index == model_stages - 1), micro_batches_(static_cast<std::size_t>(micro_batches)) {
  for (int i = begin; i < end; ++i) targets_ = targets_ || model.layer(i).needs_targets();
  const auto& skips = model.skips();
  skip_roles_.assign(skips.size(), SkipRole::none);
  stashes_.assign(static_cast<std::size_t>(end - begin), -1);
  for (std::size_t k = 0; k < skips.size(); ++k) {
    const bool makes = skips[k].producer >= begin && skips[k].producer < end;
    const bool takes = skips[k].consumer >= begin && skips[k].consumer < end;
    skip_roles_[k] = makes && takes ? SkipRole::within : makes ? SkipRole::out : takes ? SkipRole::in : SkipRole::none;
    if (makes) stashes_[static_cast<std::size_t>(skips[k].producer - begin)] = static_cast<int>(k);
  }
  skips_.assign(skips.size(), Tensor{});
  skip_grads_.assign(skips.size(), Tensor{});
  // Which layers write their input gradient over their input: a property of the layers'
  // kinds and ranks, the same at any micro-batch size.
  const std::vector<Shape> shapes = model.shapes(1);
  for (int i = begin; i < end; ++i)
    gradient_over_input_.push_back(gradient_in_place(model, i, begin, shapes[static_cast<std::size_t>(i)]));
}

void Stage::receive_skips(Direction direction, int mb, bool wait) {
  // Forward: what this stage's joins take from other stages; backward: the gradients of
  // what it stashed for them, and where its own joins write theirs.
  const bool forward = direction == Direction::forward;
  for (std::size_t k = 0; k < skip_roles_.size(); ++k) {
    const SkipRole role = skip_roles_[k];
    const int skip = static_cast<int>(k);
    Tensor& here = forward ? skips_[k] : skip_grads_[k];
    here = {};
    if (role == (forward ? SkipRole::in : SkipRole::out)) {  // it arrives here
      if (wait) shared_.hooks->waited(shared_.transport->receive_skip(direction, skip, mb));
      here = shared_.transport->received_skip(direction, skip, mb);
    } else if (!forward && role == SkipRole::in) {  // a join's gradient, to send
      here = shared_.transport->skip_buffer(direction, skip, mb);
    }
  }
}

// Forward: a copy of each stashed output whose join is on another stage (the forward's
// memory may die before the message leaves: remat's scratch); backward: each join's
// gradient, written in place.
void Stage::send_skips(Direction direction, int mb) {
  for (std::size_t k = 0; k < skip_roles_.size(); ++k) {
    if (skip_roles_[k] != (direction == Direction::forward ? SkipRole::out : SkipRole::in)) continue;
    if (direction == Direction::forward) {
      const Tensor& kept = shared_.transport->skip_buffer(direction, static_cast<int>(k), mb);
      shared_.device_ops->copy(kept.data, skips_[k].data, kept.bytes());
    }
    shared_.transport->send_skip(direction, static_cast<int>(k), mb);
  }
}

void Stage::attach(const StageShared& shared) {
  shared_ = shared;
  const Plan& plan = *shared.plan;
  const int ring = plan.send_ring(in_flight(plan.schedule, plan.schedule.list_of(index_)));
  for (auto [r, used] : {std::pair{&gradients_, !first_}, std::pair{&outputs_, plan.rematerializes(index_) && !last_}}) {
    r->buffers.assign(used ? static_cast<std::size_t>(ring) : 0, Tensor{});
    r->owner.assign(r->buffers.size(), -1);
  }
}

void Stage::begin_pass(bool training) {
  for (MicroBatch& m : micro_batches_) m = MicroBatch{};
  loss_sum_ = correct_sum_ = 0.0;
  if (!training) return;
  const std::vector<Shape>& shapes = *shared_.shapes;
  for (auto [r, shape] : {std::pair{&gradients_, shapes[static_cast<std::size_t>(begin_)]},
                          std::pair{&outputs_, shapes[static_cast<std::size_t>(end_)]}}) {
    for (Tensor& t : r->buffers) t = shared_.persistent->tensor(shape, shared_.dtype);
    std::fill(r->owner.begin(), r->owner.end(), -1);
    r->next = 0;
  }
}

Tensor Stage::take_send_buffer(SendRing& ring, Direction direction, int mb) {
  const auto r = static_cast<std::size_t>(ring.next);
  ring.next = (ring.next + 1) % static_cast<int>(ring.buffers.size());
  if (ring.owner[r] >= 0) shared_.hooks->waited(shared_.transport->wait_sent(direction, channel_, ring.owner[r]));
  ring.owner[r] = mb;
  return ring.buffers[r];
}

Arena* Stage::take_slot(int mb) {
  const int slot = shared_.slots->take();
  micro_batch(mb).slot = slot;
  return &shared_.slots->slot(slot);
}

// After micro-batch mb's backward (its W): its activations are dead once the send of its
// output (which lives in the slot) has completed; by now the next stage has used it.
void Stage::release_slot(int mb) {
  MicroBatch& m = micro_batch(mb);
  if (m.slot < 0) return;
  if (!last_) shared_.hooks->waited(shared_.transport->wait_sent(Direction::forward, channel_, mb));
  shared_.slots->release(m.slot);
  m = MicroBatch{.input_grad = m.input_grad};  // the gradient B sent lives in the persistent arena
}

Pass Stage::make_pass(std::int64_t step, int mb, Arena* arena) const {
  const Plan& plan = *shared_.plan;
  Pass pass;
  pass.arena = arena;
  pass.seed = plan.options.seed;
  pass.step = static_cast<std::uint64_t>(step);
  pass.sample_begin = static_cast<std::uint64_t>(shared_.replica * plan.replica_batch() + mb * plan.micro_batch_size);
  pass.training = true;
  pass.deferred_statistics = plan.options.batchnorm == BatchNormRule::deferred;
  pass.channels_last = plan.options.channels_last;
  pass.dtype = shared_.dtype;
  if (targets_) {
    const Shape tg = model_.target_shape(plan.micro_batch_size);
    pass.targets = {static_cast<std::byte*>(shared_.device_ops->targets().data) + static_cast<std::size_t>(mb) * tg.numel() * word_bytes,
                    tg, DType::i32, shared_.device_ops->kind()};
    if (last_) pass.device_loss_sum = shared_.device_ops->loss_sum();
  }
  pass.loss_scale =
      1.0f / static_cast<float>(static_cast<std::int64_t>(plan.options.batch_size) * model_.rows_per_sample());
  return pass;
}

// What F of micro-batch mb reads: its share of the batch's inputs on the model's first
// stage (tokens, or features converted for bf16 training; images swapped to channels last
// under --channels-last on), else what the previous model stage sent.
Tensor Stage::input(const Pass& pass, int mb) {
  if (!first_) return shared_.transport->received(Direction::forward, channel_, mb);
  const Shape in = (*shared_.shapes)[0];
  Tensor x = {static_cast<std::byte*>(shared_.device_ops->inputs().data) + static_cast<std::size_t>(mb) * in.numel() * word_bytes,
              in, model_.input_dtype(), shared_.device_ops->kind()};
  if (x.dtype == DType::f32 && shared_.dtype != DType::f32) {  // the MLP's features, in bf16 training
    const Tensor converted = pass.arena->tensor(in, shared_.dtype);
    ops::convert(converted, x);
    x = converted;
  }
  if (pass.channels_last && in.rank == 4) {
    const Tensor swapped = pass.arena->tensor(in, x.dtype);
    ops::change_layout(swapped, x, true);
    x = swapped;
  }
  return x;
}

template <class Work>
void Stage::graphed(Graphed kind, int mb, bool allowed, Work&& work) {
  StepDevice& device = *shared_.device_ops;
  if (!allowed || !device.graphing()) {
    work();
    return;
  }
  device.begin_graph();
  try {
    work();
  } catch (...) {
    device.abandon_graph();
    throw;
  }
  const int M = static_cast<int>(micro_batches_.size());
  device.launch_graph((channel_ * 4 + static_cast<int>(kind)) * M + mb);
}

void Stage::forward(std::int64_t step, int mb, bool training, bool backward_next) {
  receive_skips(Direction::forward, mb, true);
  const auto start = StageHooks::Clock::now();
  shared_.hooks->begin_compute(ComputeKind::forward, mb, index_);
  const bool remat = training && shared_.plan->rematerialize(index_, mb);
  // A rematerialized forward whose B comes next keeps its contexts for it: in the scratch
  // arena, where the recomputation would have put the same bits, or where the backward
  // splits in a slot, until W.
  const bool keep = remat && backward_next;
  Pass pass = make_pass(step, mb, !training ? shared_.persistent
                                  : remat && !(keep && shared_.split) ? shared_.scratch
                                                                      : take_slot(mb));
  pass.training = training;
  // --remat selective: what the layers recompute in backward goes to the scratch arena,
  // free between actions, and dies with this forward.
  const bool selective = training && !remat && shared_.plan->selective(index_);
  if (selective) pass.transient = shared_.scratch;
  Tensor out;
  Context* contexts = nullptr;
  const Tensor x = input(pass, mb);
  graphed(Graphed::forward, mb, training, [&] { contexts = run_forward(pass, x, &out, *shared_.progress, skips_); });
  send_skips(Direction::forward, mb);  // before remat's scratch dies
  if (selective) shared_.scratch->reset();
  if (last_) {
    const Context& loss = contexts[end_ - begin_ - 1];
    loss_sum_ += loss.value;
    correct_sum_ += loss.correct;
  }
  if (remat) {
    // Keep only what leaves the stage; the contexts die with the scratch arena (whose
    // memory the GPU stream reuses only after this copy, in stream order), unless B comes
    // next: they then stay for it (B resets the arena, W frees the slot).
    if (!last_) {
      const Tensor kept = take_send_buffer(outputs_, Direction::forward, mb);
      shared_.device_ops->copy(kept.data, out.data, out.bytes());
      out = kept;
    }
    if (!keep) {
      shared_.scratch->reset();
      contexts = nullptr;
    }
  }
  MicroBatch& m = micro_batch(mb);
  m.output = out;
  m.contexts = contexts;
  shared_.hooks->end_compute(ComputeKind::forward, mb, index_, start);
}

void Stage::recompute(std::int64_t step, int mb) {
  MicroBatch& m = micro_batch(mb);
  if (m.contexts) return;
  // The forward again with the same pass, hence the same dropout masks: into the scratch
  // arena, which B resets once it is done (nothing runs between: B is this stage's next
  // compute), or under a split backward into a slot, which lives on until W.
  const auto start = StageHooks::Clock::now();
  shared_.hooks->begin_compute(ComputeKind::recompute, mb, index_);
  Tensor unused;
  Pass again = make_pass(step, mb, shared_.split ? take_slot(mb) : shared_.scratch);
  again.recompute = true;
  again.device_loss_sum = nullptr;  // the forward counted this micro-batch's loss
  receive_skips(Direction::forward, mb, false);  // arrived for the forward, kept for the step
  const Tensor x = input(again, mb);
  graphed(Graphed::recompute, mb, true, [&] { m.contexts = run_forward(again, x, &unused, *shared_.progress, skips_); });
  shared_.hooks->end_compute(ComputeKind::recompute, mb, index_, start);
}

void Stage::backward(std::int64_t step, int mb) {
  const bool split = shared_.split;
  MicroBatch& m = micro_batch(mb);
  recompute(step, mb);
  receive_skips(Direction::backward, mb, true);
  Context* contexts = m.contexts;
  const auto start = StageHooks::Clock::now();
  shared_.hooks->begin_compute(ComputeKind::backward, mb, index_);
  Pass pass = make_pass(step, mb, shared_.scratch);
  if (split) pass.stash = &shared_.slots->slot(m.slot);
  static float loss_gradient = 1.0f;  // the loss layer ignores its incoming gradient
  const Tensor dy = last_ ? make_tensor(&loss_gradient, Shape{1})
                          : shared_.transport->received(Direction::backward, channel_, mb);
  if (!first_) m.input_grad = take_send_buffer(gradients_, Direction::backward, mb);
  const bool final = mb == shared_.plan->options.micro_batches - 1 && !split;
  // Unsplit, the forward's memory (in the slot, or the scratch arena where recomputed)
  // holds the gradients between layers as it dies, but what is sent on from it.
  Spent spent;
  if (!split) {
    spent.arena = m.slot >= 0 ? &shared_.slots->slot(m.slot) : shared_.scratch;
    spent.to = spent.arena->mark();
    spent.live[2] = m.output;
  }
  graphed(Graphed::backward, mb, !final, [&] {
    run_backward(contexts, dy, m.input_grad, pass, *shared_.scratch, *shared_.shapes, shared_.dtype,
                 final ? shared_.hooks : nullptr, *shared_.progress, split ? nullptr : &spent,
                 split ? &shared_.slots->slot(m.slot) : nullptr, skip_grads_);
  });
  send_skips(Direction::backward, mb);
  shared_.scratch->reset();
  shared_.hooks->end_compute(ComputeKind::backward, mb, index_, start);
  if (!split) {
    release_slot(mb);
    m.contexts = nullptr;  // a recomputation's were in the scratch, gone with it
  }
}

void Stage::weight(std::int64_t step, int mb) {
  Context* contexts = micro_batch(mb).contexts;
  MPIPE_CHECK(shared_.split && contexts, "W", mb, " without its split backward");
  const auto start = StageHooks::Clock::now();
  shared_.hooks->begin_compute(ComputeKind::weight, mb, index_);
  const Pass pass = make_pass(step, mb, shared_.scratch);
  const bool final = mb == shared_.plan->options.micro_batches - 1;
  graphed(Graphed::weight, mb, !final, [&] { run_weight(contexts, pass, final ? shared_.hooks : nullptr, *shared_.progress); });
  shared_.scratch->reset();
  shared_.hooks->end_compute(ComputeKind::weight, mb, index_, start);
  release_slot(mb);
}

Context* Stage::run_forward(const Pass& pass, Tensor x, Tensor* output, Progress& progress, std::span<Tensor> skips) const {
  const int n = end_ - begin_;
  Context* contexts = pass.arena->objects<Context>(static_cast<std::size_t>(n));
  Pass kept = pass;  // the stage's input stays as it came (remat runs the forward from it again)
  kept.stage_input = x.data;
  if (skips.empty() && !skip_roles_.empty()) skips = {pass.arena->objects<Tensor>(skip_roles_.size()), skip_roles_.size()};
  kept.skips = skips;
  for (int i = 0; i < n; ++i) {
    x = model_.layer(begin_ + i).forward(x, contexts[i], kept);
    if (const int k = stashes_[static_cast<std::size_t>(i)]; k >= 0) skips[static_cast<std::size_t>(k)] = x;
    progress.poll();  // messages keep moving between layers
  }
  *output = x;
  return contexts;
}

void Stage::run_backward(Context* contexts, Tensor dy, const Tensor& dx_first, const Pass& given, Arena& scratch,
                         const std::vector<Shape>& shapes, DType dtype, StageHooks* hooks, Progress& progress,
                         const Spent* spent, Arena* forward_memory, std::span<Tensor> skip_grads) const {
  const int n = end_ - begin_;
  // A skip within the stage: its join's gradient waits in scratch for its producer,
  // outside the spent memory (allocated after its mark) and below every layer's
  // temporaries.
  if (skip_grads.empty() && !skip_roles_.empty()) skip_grads = {scratch.objects<Tensor>(skip_roles_.size()), skip_roles_.size()};
  for (std::size_t k = 0; k < skip_roles_.size(); ++k)
    if (skip_roles_[k] == SkipRole::within)
      skip_grads[k] = scratch.tensor(shapes[static_cast<std::size_t>(model_.skips()[k].producer) + 1], dtype);
  Pass pass = given;
  pass.skip_grads = skip_grads;
  // A layer's dy is dead once its backward returns (what W needs it keeps in the stash),
  // and so is, unsplit, what the forwards of the layers after it allocated: each input
  // gradient goes there where it has room, else the gradients take turns in two buffers,
  // the plan's dx + dy, not one per layer.
  const auto spent_from = [&](int i) { return i + 1 < n ? contexts[i + 1].begin : spent->to; };
  ChainGradients grads(
      static_cast<std::size_t>(n), dy, dtype, scratch,
      [&](std::size_t i) { return shapes[static_cast<std::size_t>(begin_) + i]; },
      [&](std::size_t i, Shape shape, const Tensor& above) -> Tensor {
        // A loss writes its logits' gradient over the logits, which the layer before it
        // does not read again (gradient_in_place).
        if (gradient_over_input_[i]) return contexts[i].input;
        if (!spent) return {};
        Spent here = *spent;
        here.from = spent_from(static_cast<int>(i));
        return here.take(shape, dtype, {above});
      });
  for (int i = n - 1; i >= 0; --i) {
    const Tensor dx = i > 0 ? grads(static_cast<std::size_t>(i), dy) : dx_first;
    Layer& layer = model_.layer(begin_ + i);
    // A stashed output's gradient: what came down the chain plus what its join sent back
    // (dy is dead after this layer's backward: summed in place).
    if (const int k = stashes_[static_cast<std::size_t>(i)]; k >= 0) ops::add(dy, skip_grads[static_cast<std::size_t>(k)]);
    Spent here;
    Pass pass_here = pass;
    if (spent) {
      here = *spent;
      here.from = spent_from(i);
      here.live[0] = dy;
      here.live[1] = dx;
      pass_here.spent = &here;
    }
    // What the layer's backward allocates beyond dx is dead when it returns (its dy, below
    // the mark, stays): the next layer's backward reuses that memory.
    const Arena::Mark temporaries = scratch.mark();
    const bool whole = pass.stash && begin_ + i >= weights_in_backward_from_;
    if (whole) {
      // Split, but this layer's weight gradients now (the fused backward's, the same
      // bits): what its forward and the layers' above it allocated in the slot is dead
      // once it returns, and nothing was stashed above it yet: given back to the slot,
      // where the stash of the layers below goes next.
      Pass fused = pass_here;
      fused.stash = nullptr;
      layer.backward(contexts[i], dy, dx, GradMode::overwrite, fused);
      if (forward_memory) forward_memory->rewind(contexts[i].begin);
    } else if (pass.stash && keeps_dy_in_output(model_, begin_ + i, end_)) {
      // Split: the Linear keeps its dy for W in its own output's buffer, where no later W
      // reads it through a view either: the same bits, and no more stash memory than the
      // fused backward's.
      Pass kept = pass;
      const Tensor& out = contexts[i + 1].input;
      bool free = out.shape == dy.shape && out.dtype == dy.dtype && out.device == dy.device;
      const auto* begin = static_cast<const std::byte*>(out.data);
      for (int j = i + 1; j < n && free; ++j) {
        const Tensor& in = contexts[j].input;
        const auto* at = static_cast<const std::byte*>(in.data);
        if (model_.layer(begin_ + j).defers_weight() && at < begin + out.bytes() && begin < at + in.bytes()) free = false;
      }
      if (free) kept.stash_into = out;
      layer.backward(contexts[i], dy, dx, GradMode::overwrite, kept);
    } else {
      layer.backward(contexts[i], dy, dx, GradMode::overwrite, pass_here);
    }
    scratch.rewind(temporaries);
    dy = dx;
    if (hooks) hooks->gradients_final(begin_ + i);
    progress.poll();  // messages and sums keep moving between layers
  }
}

void Stage::run_weight(Context* contexts, const Pass& pass, StageHooks* hooks, Progress& progress) const {
  for (int i = end_ - begin_ - 1; i >= 0; --i) {
    // The layers whose weight gradients B computed (weights_in_backward_from) have none here.
    if (begin_ + i < weights_in_backward_from_) model_.layer(begin_ + i).backward_weight(contexts[i], pass);
    if (hooks) hooks->gradients_final(begin_ + i);
    progress.poll();
  }
}

}  // namespace mpipe
