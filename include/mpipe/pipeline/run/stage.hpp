// A model stage on this rank: a contiguous run of the model's layers, the state and the
// buffers of each of its micro-batches from F to B (to W where the schedule splits
// backwards), and its F, B and W actions. A rank holds one stage, or several with virtual
// stages (interleaved, zbv); its stages share the rank's parameter store (one flat
// buffer: one pass zeroes, sums, updates and checkpoints it), its pool of activation
// slots and the rest of StageShared. What a stage tells the rank (its compute times, its
// waits, the gradients it has finished) goes through StageHooks, so a stage never reaches
// back into the executor.
#pragma once
#include <chrono>
#include <memory>
#include <vector>

#include "mpipe/core/arena.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/pipeline/plan/plan.hpp"
#include "mpipe/pipeline/comm/progress.hpp"
#include "mpipe/pipeline/run/step_device.hpp"
#include "mpipe/pipeline/comm/transport.hpp"

namespace mpipe {

// The arenas a training forward's activations live in from its F to its B (its W, with
// what W needs, where the stage splits backwards), when the slot is reset for another
// micro-batch: as many as the schedule holds micro-batches at once on the rank (M for
// gpipe, K - stage for 1f1b, K for zb-h1, up to 2K model stages for zbv), so 1F1B's
// saving is real.
class SlotPool {
 public:
  SlotPool(int slots, Device device, Gauge* gauge = nullptr);
  int take();  // a free slot's index; Error when the schedule holds more than there are
  Arena& slot(int index) { return *slots_[static_cast<std::size_t>(index)]; }
  void release(int index);
  void reset();  // every slot free and empty: a step begins
  std::size_t size() const { return slots_.size(); }

 private:
  std::vector<std::unique_ptr<Arena>> slots_;
  std::vector<int> free_;
};

// Kinds of compute action, as the phase times and the trace count them (the first of
// TraceEvent's kinds, executor.hpp).
enum class ComputeKind : int { forward = 0, backward = 1, recompute = 2, weight = 12 };

// What a stage tells the rank as it works.
class StageHooks {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~StageHooks() = default;
  // Around each compute action of micro-batch `micro_batch` on model stage `stage`: its
  // time goes into the phase times and the trace (on a GPU the device times it).
  virtual void begin_compute(ComputeKind kind, int micro_batch, int stage) = 0;
  virtual void end_compute(ComputeKind kind, int micro_batch, int stage, Clock::time_point start) = 0;
  // Seconds blocked until a send completed, so that its buffer could be used again.
  virtual void waited(double seconds) = 0;
  // The step's gradient of layer `layer` is complete (the last micro-batch's backward, or
  // W, has run): its sums over replicas and tied weights may start.
  virtual void gradients_final(int layer) = 0;
};

// What a rank's stages share: set up once by the executor, after allocation.
struct StageShared {
  const Plan* plan = nullptr;
  const std::vector<Shape>* shapes = nullptr;  // every layer's input, for one micro-batch
  DType dtype = DType::f32;                    // of activations, their gradients and the messages
  int replica = 0;                             // this rank's: which samples of the step it reads
  bool split = false;                          // the rank's schedule splits backwards into B and W
  Transport* transport = nullptr;
  Progress* progress = nullptr;
  StepDevice* device_ops = nullptr;            // the batch, the loss sum, copies
  SlotPool* slots = nullptr;
  Arena* persistent = nullptr;                 // lives for the step
  Arena* scratch = nullptr;                    // lives for one action
  StageHooks* hooks = nullptr;
};

class Stage {
 public:
  // One micro-batch's state on this stage.
  struct MicroBatch {
    Tensor output;               // what F sends on (in its slot, or kept whole under remat)
    Tensor input_grad;           // what B sends back (not on the model's first stage)
    Context* contexts = nullptr; // the forward's, per layer; null when rematerialized (until recomputed)
    int slot = -1;               // the SlotPool slot holding its activations, or -1
  };

  // Model stage `index`: layers [begin, end) of `model`; `channel` is its index among the
  // rank's stages (the transport's channel).
  Stage(Model& model, int index, int channel, int begin, int end, int model_stages, int micro_batches);
  int index() const { return index_; }
  int begin() const { return begin_; }
  int end() const { return end_; }
  bool first() const { return first_; }      // the model's first stage: reads the inputs
  bool last() const { return last_; }        // the model's last: its last layer is the loss
  bool targets() const { return targets_; }  // a layer reads the targets (the loss, a vocabulary chunk)
  MicroBatch& micro_batch(int mb) { return micro_batches_[static_cast<std::size_t>(mb)]; }

  // Once, after the rank has allocated: what the stage shares with the rank's others,
  // and its send buffers: for each B's input gradient, and under remat for each
  // forward's output, min(M, in-flight + 2) of them taken in turn (a send posted two
  // actions ago has found its receive by the time its buffer comes round again).
  void attach(const StageShared& shared);
  // A pass begins (a step, or an evaluation batch): every micro-batch's state gone, and
  // for a training pass the send buffers taken anew in the (reset) persistent arena.
  void begin_pass(bool training);
  // The loss and right predictions the loss layer summed over the pass (the model's last
  // stage, where the host adds them up).
  double loss_sum() const { return loss_sum_; }
  double correct_sum() const { return correct_sum_; }

  // F of micro-batch `mb` in `step`: from its share of the batch's inputs (the model's
  // first stage) or what the previous stage sent; training keeps its activations in a
  // slot until B (under remat only its output), evaluation keeps nothing.
  // `backward_next`: this micro-batch's B is the stage's next compute (the model's last
  // stage, whose rematerialized forwards the plan moves to just before their backwards,
  // Plan::deferred_from): a rematerialized forward then keeps its contexts for that B
  // (in the scratch arena, where the recomputation would have put the same bits, or
  // where the backward splits in a slot until W) instead of running again.
  void forward(std::int64_t step, int mb, bool training, bool backward_next = false);
  // B (where the schedule splits backwards, the input gradients alone, with what W needs
  // kept in the micro-batch's slot), its forward recomputed first where rematerialized.
  void backward(std::int64_t step, int mb);
  // A rematerialized micro-batch's forward, recomputed for its B (nothing if it kept its
  // contexts or has them already): B calls it first; the executor earlier, while the rank
  // would otherwise wait for B's gradient, where B is its next compute.
  void recompute(std::int64_t step, int mb);
  // W: the weight gradients B left, in the same layer order; the slot is free after it.
  // Ws run in ascending micro-batch order (validate()), so every gradient sums its
  // micro-batches in the same order as under the fused backward: bitwise equal.
  void weight(std::int64_t step, int mb);

  // The layers' calls, for tests and for the actions above.
  // F: the layers' forwards from `x`; returns their contexts (in pass.arena) and sets
  // *output to the last layer's output. Messages keep moving between layers.
  // `skips`: by Model::skips() index, the stashed tensors: a skip from another stage
  // given, each of this stage's producers' set here as it runs (empty: an array of the
  // arena's for a stage whose skips are all its own).
  Context* run_forward(const Pass& pass, Tensor x, Tensor* output, Progress& progress,
                       std::span<Tensor> skips = {}) const;
  // B: from `dy`, the gradient of the stage's output (the loss layer ignores it), each
  // layer's input gradient, for the first layer in `dx` (empty on the model's first
  // stage), for the others in memory the forwards of the layers after it allocated where
  // `spent` (its arena, top and live output; null: none) has room, else in `scratch`;
  // with pass.stash (a split backward) each weight layer keeps what its W needs there.
  // `hooks`: this is the step's last micro-batch and the backward fused, so each layer's
  // gradient is final after it; null otherwise. Split, the layers from
  // weights_in_backward_from() on compute their weight gradients here, and where
  // `forward_memory` is the arena the contexts' forward allocated in, what those layers
  // allocated is given back to it as the backward passes them.
  // `skip_grads`: by Model::skips() index, the gradients of skips that cross stages (a
  // consumer's written here, a producer's received), each added to its producer's output
  // gradient; a skip within the stage gets a buffer of `scratch` here (empty: all of them).
  void run_backward(Context* contexts, Tensor dy, const Tensor& dx, const Pass& pass, Arena& scratch,
                    const std::vector<Shape>& shapes, DType dtype, StageHooks* hooks, Progress& progress,
                    const Spent* spent = nullptr, Arena* forward_memory = nullptr,
                    std::span<Tensor> skip_grads = {}) const;
  // W: the weight gradients B left, in the same layer order; `hooks` as for run_backward().
  void run_weight(Context* contexts, const Pass& pass, StageHooks* hooks, Progress& progress) const;

 private:
  // What a stage sends and keeps until the send completes, in turn from a ring.
  struct SendRing {
    std::vector<Tensor> buffers;
    std::vector<int> owner;  // the micro-batch whose send a buffer holds, or -1
    int next = 0;
  };
  Tensor take_send_buffer(SendRing& ring, Direction direction, int mb);
  Arena* take_slot(int mb);
  void release_slot(int mb);
  Pass make_pass(std::int64_t step, int mb, Arena* arena) const;
  // Skips of micro-batch mb that cross into this stage: forward, the stashed tensors
  // received (waiting for them); backward, the gradients of this stage's stashes from
  // their consumers, and the buffers its joins write theirs into.
  void receive_skips(Direction direction, int mb, bool wait);
  void send_skips(Direction direction, int mb);
  Tensor input(const Pass& pass, int mb);
  // Runs `work`, an action's host code, with what it queues on the GPU recorded and then
  // launched as one CUDA graph where the step device graphs this pass, else as it comes.
  // Not `allowed`: an action whose layers tell the rank's hooks as their gradients become
  // final (the step's last B or W), which start sums on other streams mid-action.
  enum class Graphed : int { forward, recompute, backward, weight };
  template <class Work>
  void graphed(Graphed kind, int mb, bool allowed, Work&& work);

  Model& model_;
  int index_, channel_, begin_, end_;
  // Split, layers from here on compute their weight gradients in B, and their forward
  // memory is given back as B passes them (weights_in_backward_from): end_ but on the
  // model's last stage.
  int weights_in_backward_from_;
  bool first_, last_, targets_ = false;
  std::vector<MicroBatch> micro_batches_;
  StageShared shared_;
  SendRing gradients_, outputs_;
  // Skips (Model::skips()) by index: how each touches this stage (its producer and
  // consumer layers here: within; only the producer: out; only the consumer: in), the
  // skip each layer stashes (-1: none), and an action's tensors and gradients.
  enum class SkipRole : std::uint8_t { none, within, out, in };
  std::vector<SkipRole> skip_roles_;
  std::vector<int> stashes_;  // per layer of the stage
  std::vector<bool> gradient_over_input_;  // per layer: gradient_in_place(), its input gradient over its input
  std::vector<Tensor> skips_, skip_grads_;
  double loss_sum_ = 0, correct_sum_ = 0;
};

}  // namespace mpipe
