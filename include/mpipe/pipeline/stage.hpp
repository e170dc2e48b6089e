// A model stage on this rank: a contiguous run of the model's layers, the state of each of
// its micro-batches from F to B (to W where the schedule splits backwards), and its F, B
// and W calls. A rank holds one stage, or several with virtual stages (interleaved, zbv);
// its stages share the rank's parameter store (one flat buffer: one pass zeroes, sums,
// updates and checkpoints it) and its pool of activation slots.
#pragma once
#include <memory>
#include <vector>

#include "mpipe/core/arena.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/pipeline/progress.hpp"
#include "mpipe/pipeline/reducer.hpp"

namespace mpipe {

// The arenas a training forward's activations live in from its F to its B (its W, with
// what W needs, where the stage splits backwards), when the slot is reset for another
// micro-batch: as many as the schedule holds micro-batches at once on the rank (M for
// gpipe, K - stage for 1f1b, K for zb-h1, up to 2K model stages for zbv), so 1F1B's
// saving is real.
class SlotPool {
 public:
  SlotPool(int slots, Device device);
  int take();  // a free slot's index; Error when the schedule holds more than there are
  Arena& slot(int index) { return *slots_[static_cast<std::size_t>(index)]; }
  void release(int index);
  void reset();  // every slot free and empty: a step begins
  std::size_t high_water() const;  // bytes, summed over the slots
  std::size_t size() const { return slots_.size(); }

 private:
  std::vector<std::unique_ptr<Arena>> slots_;
  std::vector<int> free_;
};

class Stage {
 public:
  // One micro-batch's state on this stage.
  struct MicroBatch {
    Tensor output;               // what F sends on (in its slot, or kept whole under remat)
    Tensor input_grad;           // what B sends back (not on the model's first stage)
    Context* contexts = nullptr; // the forward's, per layer; null when rematerialized
    int slot = -1;               // the SlotPool slot holding its activations, or -1
  };

  // Model stage `index`: layers [begin, end) of `model`.
  Stage(Model& model, int index, int begin, int end, int model_stages, int micro_batches);
  int index() const { return index_; }
  int begin() const { return begin_; }
  int end() const { return end_; }
  bool first() const { return first_; }      // the model's first stage: reads the inputs
  bool last() const { return last_; }        // the model's last: its last layer is the loss
  bool targets() const { return targets_; }  // a layer reads the targets (the loss, a vocabulary chunk)
  MicroBatch& micro_batch(int mb) { return micro_batches_[static_cast<std::size_t>(mb)]; }
  // The step's state is gone (a step or an evaluation begins).
  void reset();

  // F: the layers' forwards from `x`; returns their contexts (in pass.arena) and sets
  // *output to the last layer's output. Messages keep moving between layers.
  Context* forward(const Pass& pass, Tensor x, Tensor* output, Progress& progress) const;
  // B: from `dy`, the gradient of the stage's output (the loss layer ignores it), each
  // layer's input gradient, in `scratch` and for the first layer in `dx` (empty on the
  // model's first stage); with pass.stash (a split backward) each weight layer keeps what
  // its W needs there. `reducer`: this is the step's last micro-batch and the backward
  // fused, so each layer's gradient is final after it; null otherwise.
  void backward(Context* contexts, Tensor dy, const Tensor& dx, const Pass& pass, Arena& scratch,
                const std::vector<Shape>& shapes, DType dtype, Reducer* reducer, Progress& progress) const;
  // W: the weight gradients B left, in the same layer order; `reducer` as for backward().
  void weight(Context* contexts, const Pass& pass, Reducer* reducer, Progress& progress) const;

 private:
  Model& model_;
  int index_, begin_, end_;
  bool first_, last_, targets_ = false;
  std::vector<MicroBatch> micro_batches_;
};

}  // namespace mpipe
