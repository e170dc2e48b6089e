// A model stage's layers and micro-batches, and the pool of activation slots.
#include "mpipe/pipeline/stage.hpp"

#include "mpipe/backend/ops.hpp"

namespace mpipe {

SlotPool::SlotPool(int slots, Device device) {
  for (int s = 0; s < slots; ++s) slots_.push_back(std::make_unique<Arena>(ops::device_memory(device)));
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

std::size_t SlotPool::high_water() const {
  std::size_t bytes = 0;
  for (const auto& slot : slots_) bytes += slot->high_water();
  return bytes;
}

Stage::Stage(Model& model, int index, int begin, int end, int model_stages, int micro_batches)
    : model_(model), index_(index), begin_(begin), end_(end), first_(index == 0), last_(index == model_stages - 1),
      micro_batches_(static_cast<std::size_t>(micro_batches)) {
  for (int i = begin; i < end; ++i) targets_ = targets_ || model.layer(i).needs_targets();
}

void Stage::reset() {
  for (MicroBatch& m : micro_batches_) m = MicroBatch{};
}

Context* Stage::forward(const Pass& pass, Tensor x, Tensor* output, Progress& progress) const {
  const int n = end_ - begin_;
  Context* contexts = pass.arena->objects<Context>(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    x = model_.layer(begin_ + i).forward(x, contexts[i], pass);
    progress.poll();  // messages keep moving between layers
  }
  *output = x;
  return contexts;
}

void Stage::backward(Context* contexts, Tensor dy, const Tensor& dx_first, const Pass& pass, Arena& scratch,
                     const std::vector<Shape>& shapes, DType dtype, Reducer* reducer, Progress& progress) const {
  const int n = end_ - begin_;
  for (int i = n - 1; i >= 0; --i) {
    Tensor dx;
    if (i > 0) dx = scratch.tensor(shapes[static_cast<std::size_t>(begin_ + i)], dtype);
    else dx = dx_first;
    Layer& layer = model_.layer(begin_ + i);
    // What the layer's backward allocates beyond dx is dead when it returns (its dy, below
    // the mark, stays): the next layer's backward reuses that memory.
    const Arena::Mark temporaries = scratch.mark();
    if (pass.stash && keeps_dy_in_output(model_, begin_ + i, end_)) {
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
      layer.backward(contexts[i], dy, dx, GradMode::overwrite, pass);
    }
    scratch.rewind(temporaries);
    dy = dx;
    if (reducer) reducer->gradients_final(begin_ + i);
    progress.poll();  // messages and sums keep moving between layers
  }
}

void Stage::weight(Context* contexts, const Pass& pass, Reducer* reducer, Progress& progress) const {
  for (int i = end_ - begin_ - 1; i >= 0; --i) {
    model_.layer(begin_ + i).backward_weight(contexts[i], pass);
    if (reducer) reducer->gradients_final(begin_ + i);
    progress.poll();
  }
}

}  // namespace mpipe
