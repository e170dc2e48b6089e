// Layer: the unit a model is a flat list of, and a pipeline stage a range of.
//
// forward(x) returns y and fills a per-call Context with what backward needs, so many
// micro-batches can be in flight at once; both live in the pass's Arena. backward(ctx,
// dy, dx) writes dx per GradMode and *accumulates* (+=) into the parameter gradients.
// Split backward (zero-bubble schedules): with Pass::stash set, backward() computes dx
// and the layers whose weight gradient is a GEMM of their own (Linear) keep their dy
// in the stash (or where a composite says, Pass::stash_into: a forward buffer B is done
// with) and leave that gradient to backward_weight(ctx), called later with the
// same context; every other gradient is still accumulated in backward().
// The public forward/backward check shapes and call the virtual *_impl (as in
// tiny-cuda-nn's object.h). Each layer reports its cost for the partitioner and `plan`.
//
// The layer kinds live in files by family, each kind's class beside its registry entry
// (nn/registry.hpp): dense_layers (linear, activations, layernorm, dropout, the loss),
// transformer_layers (embedding, attention, block), conv_layers, residual, vocab_layers.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mpipe/backend/ops.hpp"
#include "mpipe/core/arena.hpp"
#include "mpipe/core/tensor.hpp"

namespace mpipe {


enum class Init { normal, zeros, ones };

// A parameter a layer declares. A tied parameter names the (layer, parameter) that owns
// it, and which of the owner's rows it is (all of them, or a range: one vocabulary chunk
// of a language-model head tied to the token table); the stage holding both shares one
// storage, otherwise it keeps a copy whose gradient is summed with the owner's rows.
struct ParamSpec {
  std::string name;
  Shape shape;
  Init init = Init::zeros;
  float std = 0.0f;          // for Init::normal
  bool decay = false;        // AdamW weight decay applies
  int tied_layer = -1;       // owner's global layer index, or -1
  std::string tied_name;     // owner's parameter name
  // A buffer, not trained: state the layer itself writes (BatchNorm's running
  // statistics). Stored, checkpointed and resharded like a parameter; its gradient stays
  // zero, so no optimizer moves it, and with D > 1 the replicas average it every step.
  bool buffer = false;
  // A tie to rows [tied_rows_begin, tied_rows_end) of the owner's (rows, ...) parameter;
  // tied_rows_end -1: all of them.
  std::int64_t tied_rows_begin = 0, tied_rows_end = -1;
};

struct Cost {
  double forward_flops = 0;    // per call at the given input shape
  double backward_flops = 0;
  double param_bytes = 0;
  double activation_bytes = 0;  // what the context keeps between forward and backward
  // Split backward (zero-bubble schedules): the part of backward_flops that
  // backward_weight() runs, and the output gradient kept for it until then.
  double weight_flops = 0, weight_stash_bytes = 0;
  // --remat selective: the part of activation_bytes a forward does not keep, and the
  // FLOPs its backward spends to recompute it (elementwise work: LayerNorm, GELU).
  double recomputable_bytes = 0, recompute_flops = 0;
  // The temporaries its backward allocates beyond its dx (for the plan's peak: the
  // stage's backward scratch holds one layer's at a time). Composites set their own.
  double backward_scratch_bytes = 0;
  // Of backward_scratch_bytes: what an unsplit backward puts in spent memory where that
  // has room (Spent): a composite's parts' input gradients (ChainGradients) and their
  // columns, a convolution's columns. The rest comes from the scratch arena.
  double backward_spent_bytes = 0;
  // The most its forward holds at once above what came before it: what it keeps so far
  // and the temporaries it gives back as it returns (a conv's im2col columns); 0: its
  // activation_bytes. A micro-batch's arena grows to the largest such moment. Composites
  // set their own (not a sum).
  double forward_peak_bytes = 0;
  double forward_peak() const { return std::max(forward_peak_bytes, activation_bytes); }
  // Contexts its forward takes from the micro-batch's arena (its own, and a composite's
  // for its parts: the sum), each sizeof(Context), which a small layer's activations
  // may not outweigh.
  double contexts = 1;
  // Byte figures count 4-byte elements (fp32, the CPU's). In bf16 training the plan halves
  // them, but for this part of activation_bytes, kept in fp32 or int32 whatever the
  // precision: statistics (BatchNorm's, LayerNorm's, attention's log-sum-exp, the loss's
  // rows) and a max pool's indices.
  double fixed_bytes = 0;
  Cost& operator+=(const Cost& c) {  // composite layers: the sum of their parts
    forward_flops += c.forward_flops;
    backward_flops += c.backward_flops;
    param_bytes += c.param_bytes;
    activation_bytes += c.activation_bytes;
    weight_flops += c.weight_flops;
    weight_stash_bytes += c.weight_stash_bytes;
    recomputable_bytes += c.recomputable_bytes;
    recompute_flops += c.recompute_flops;
    contexts += c.contexts;
    fixed_bytes += c.fixed_bytes;
    return *this;
  }
};

// An unsplit backward's spent memory: what forwards allocated in `arena` between marks
// `from` and `to` (of layers whose backward has run, so nothing reads it again) but the
// `live` tensors, which may lie in it. The gradients between layers go there, where it has
// room, instead of into new scratch.
struct Spent {
  static constexpr int max_live = 5;
  Arena* arena = nullptr;
  Arena::Mark from, to;
  // The layer's dy and dx, the stage's output; a composite's part's dy and dx (empty: none).
  Tensor live[max_live];
  // A tensor of `shape` in it overlapping none of `live` and `also`; empty where none fits.
  Tensor take(Shape shape, DType dtype, std::initializer_list<Tensor> also = {}) const;
};

// Generation (`mpipe generate`): a forward of the new tokens at positions [position,
// position + T) of B sequences whose earlier positions went through before. The layers
// that look across positions keep what they need of the earlier ones in a cache: an
// attention layer the q, k, v rows of every position so far, caches[its global index]
// (B, capacity, 3C); the embedding adds the positions' own rows of its table.
struct Decode {
  std::int64_t position = 0;
  std::span<const Tensor> caches;  // by global layer index (empty for the others)
};

// One forward or backward pass over a micro-batch: where memory comes from and where in
// training it is (for dropout masks and the loss).
struct Pass {
  Arena* arena = nullptr;
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
  std::uint64_t sample_begin = 0;  // index within the step of the micro-batch's first sample
  bool training = true;
  bool recompute = false;          // a forward again for backward (remat): no state updates
  bool deferred_statistics = false;  // --batchnorm deferred: gather a step's sums, apply them at its end
  // --channels-last on: images (N, C, H, W) lie in memory as NHWC, each position's channels
  // side by side (the image layers pass it to their ops; a flatten swaps back to the
  // channels-first order its (N, C H W) features have). Shapes stay (N, C, H, W).
  bool channels_last = false;
  Tensor targets;                  // (B, T) or (B) int32, for the loss layer
  float loss_scale = 1.0f;         // d(total loss)/d(per-row loss): 1 / rows in the step
  DType dtype = DType::f32;        // of activations and their gradients (bf16 on a GPU)
  double* device_loss_sum = nullptr;  // on a GPU the loss layer adds its sum here (not in a recompute)
  // Split backward: where backward() keeps what backward_weight() needs (it must live
  // until then); null: the full backward, weight gradients included.
  Arena* stash = nullptr;
  // Split backward, set by a composite for the one part it calls next: a buffer of that
  // part's dy shape and type, in memory that lives until W (the forward's), whose contents
  // the backward no longer needs (GELU's saved input, attention's q, k, v, the block's
  // residual sum): the Linear that receives that dy (the part, or an attention's output
  // projection) keeps it there instead of taking more stash memory.
  Tensor stash_into;
  // --remat selective, in a training forward: where a layer that supports it puts what
  // its backward recomputes (dead once the forward returns); null: keep everything.
  Arena* transient = nullptr;
  // The stage's input (a received message, the data, or what remat keeps to run the
  // forward again): no layer writes its output over it (Layer::allow_in_place).
  const void* stage_input = nullptr;
  // An unsplit backward, the layer's: where a composite may put its parts' input
  // gradients (null: none; its scratch then, in turns), and a layer its temporaries (a
  // convolution's columns; else from `arena`).
  const Spent* spent = nullptr;
  // Generation: the positions this forward's tokens are at, and the attention caches
  // (Decode); null: a sequence from position 0 with nothing cached (training, evaluation).
  const Decode* decode = nullptr;
  // Skips (nn/skip_layers.hpp), by the model's skip index (Model::skips()): in a forward
  // the stashed tensors the stage holds so far (a consumer's `from`), in a backward where
  // a consumer writes the gradient of its skip (overwritten); the stage adds it to the
  // producer's output gradient before the producer's backward runs.
  std::span<const Tensor> skips;
  std::span<const Tensor> skip_grads;
};

// What backward needs from one forward call. Trivially destructible: it lives in the
// arena. Composite layers keep their children's contexts in `children`.
struct Context {
  static constexpr int max_saved = 8;
  Tensor input;
  Arena::Mark begin;  // where the forward's allocations began in pass.arena (Spent)
  Tensor saved[max_saved];
  Context* children = nullptr;
  double value = 0.0;  // the loss layer's summed loss (on the CPU; see Pass)
  double correct = 0.0;  // evaluation: the loss layer's rows predicted right
  Tensor output_grad;    // split backward: the dy kept for backward_weight() (in Pass::stash)
  bool recompute_parts = false;  // --remat selective: backward recomputes what the forward let go
};

class Layer {
 public:
  virtual ~Layer() = default;

  virtual std::string kind() const = 0;
  virtual Shape output_shape(const Shape& in) const = 0;
  virtual DType input_dtype() const { return DType::f32; }
  // Reads Pass::targets (the loss, a vocabulary chunk of the head): the stage holding it
  // loads the batch's targets.
  virtual bool needs_targets() const { return false; }
  virtual Cost cost(const Shape& in) const = 0;
  virtual std::vector<ParamSpec> param_specs() const { return {}; }
  // Receives views of this layer's parameters and gradients, in param_specs() order.
  virtual void bind(std::span<const Tensor> params, std::span<const Tensor> grads) {}

  Tensor forward(const Tensor& x, Context& ctx, const Pass& pass);
  // dx may be empty when no input gradient is wanted (the first layer).
  void backward(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                const Pass& pass);
  // After a split backward(ctx, ...): the weight gradients it left, accumulated (+=).
  void backward_weight(Context& ctx, const Pass& pass) { backward_weight_impl(ctx, pass); }
  // Whether backward_weight() has work: it then reads what the forward kept (its input,
  // a composite's parts' inputs) until it runs. The others' forward memory is free once
  // their backward has run.
  virtual bool defers_weight() const { return false; }
  // Whether a split backward keeps this layer's own dy for its W (a Linear; composite
  // layers keep their parts'): keeps_dy_in_output() may then lend it its output's buffer.
  virtual bool keeps_dy() const { return false; }
  // Whether this layer's output is dead to it once the next layer has read it: its
  // backward reads neither the output nor memory the output shares. The next layer may
  // then write its own output over it (mark_in_place).
  virtual bool output_reusable() const { return false; }
  // Whether its backward reads its own output (or memory it shares). Unless a layer says
  // otherwise, those that are not output_reusable() do.
  virtual bool reads_output_in_backward() const { return !output_reusable(); }
  // Whether its backward may write its input gradient over its input (of shape `in`): it
  // reads each element before it writes it, and nothing of the input after.
  // gradient_in_place() decides where a stage lets it (a loss over its logits).
  virtual bool gradient_over_input(const Shape& in) const { return false; }
  // Whether its training forward allocates its output last (what else it allocates comes
  // first, or is given back): once that output is dead, a composite may give it back
  // (a residual block's skip path, after the sum).
  virtual bool output_last() const { return false; }
  // Told by mark_in_place that it may write its output over its input (where that input
  // is not Pass::stage_input); writes_over_input() says whether it does. A ReLU does.
  virtual void allow_in_place(bool allowed) {}
  virtual bool writes_over_input() const { return false; }
  // A fusion of neighbours in a chain (mark_fusions): a layer that can rectify its training
  // output as it writes it (a BatchNorm), followed by a ReLU that writes over its input,
  // rectifies instead of the ReLU, which then keeps its input as its output: one pass fewer
  // over the activation, and the same bits (ReLU is exact, and idempotent where the two
  // fall on different stages).
  virtual bool can_rectify_output() const { return false; }
  virtual void rectify_output(bool on) {}
  virtual bool rectifies_in_place() const { return false; }  // a ReLU over its input
  virtual void input_rectified(bool on) {}
  // The pairs fused inside a composite layer (its own chains'), for Model::fusions().
  virtual int fusions() const { return 0; }
  // Whether its training output is cheap to compute again from its input and needs
  // nothing else (elementwise work; a BatchNorm's statistics come from its input): under
  // --remat selective a composite keeps its input instead and recomputes it in backward
  // (a residual block's inner BatchNorm and ReLU).
  virtual bool output_recomputable() const { return false; }
  // Generation (Decode): the width of a row of this layer's key/value cache, one row a
  // position (0: it keeps none).
  virtual std::int64_t cache_width() const { return 0; }

  int global_index() const { return global_index_; }
  // Composite layers pass the index on to their parts (it keys dropout masks).
  virtual void set_global_index(int index) { global_index_ = index; }
  // This layer and, for a composite one, its parts, depth first.
  virtual void parts(std::vector<Layer*>& out) { out.push_back(this); }

  // Statistics gathered over a step's micro-batches and applied once at its end
  // (--batchnorm deferred): the sums (empty: none), which the executor adds up over the
  // replicas before apply_step_sums(); clear_step_sums() starts a step.
  virtual std::span<double> step_sums() { return {}; }
  virtual void apply_step_sums() {}
  virtual void clear_step_sums() {}

 protected:
  // What forward() does before forward_impl(), for a layer's other ways in (a LayerNorm's
  // forward_sum): checks the input's type, and keeps it and the arena's mark in ctx.
  void enter_forward(const Tensor& x, Context& ctx, const Pass& pass);
  virtual Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) = 0;
  virtual void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx,
                             GradMode mode, const Pass& pass) = 0;
  // Layers that leave work to backward_weight() (Linear) and composites of them.
  virtual void backward_weight_impl(Context& ctx, const Pass& pass) {}

 private:
  int global_index_ = -1;
};

// A chain of layers each feeding the next (a model's, a residual block's inner ones):
// each layer after the first may write its output over its input where the layer before
// it has output_reusable(). Activations then hold one buffer where they held two.
void mark_in_place(std::span<const std::unique_ptr<Layer>> chain);
// After mark_in_place and whatever else decides in-place writing (a stash keeps its
// producer's output): each BatchNorm followed by a ReLU that writes over its input
// rectifies for it (Layer::can_rectify_output). Returns the pairs fused. MPIPE_FUSE=off
// in the environment fuses none (for comparisons).
int mark_fusions(std::span<const std::unique_ptr<Layer>> chain);
// Whether fusions are on: not MPIPE_FUSE=off in the environment. Fused and unfused ops
// give the same bits; only their speed differs.
bool fusions_on();

// The input gradients of parts 1 .. n-1 of a chain run backward (part 0 writes the
// caller's dx): part i's, of shape_of(i), where find(i, shape, above) has room for it
// beside `above`, the gradient part i reads (spent memory), else in one of two buffers of
// `scratch` the parts take in turns, each as large as the largest it holds. The
// placements depend on the marks and shapes alone: a first look sizes the buffers, and
// operator() finds the same places again (no per-part array: more parts add nothing).
template <class ShapeOf, class Find>
class ChainGradients {
 public:
  ChainGradients(std::size_t n, const Tensor& dy, DType dtype, Arena& scratch, ShapeOf shape_of, Find find)
      : n_(n), dtype_(dtype), shape_of_(shape_of), find_(find) {
    std::size_t need[2] = {0, 0};
    Tensor above = dy;
    for (std::size_t i = n; i-- > 1;) {
      above = find_(i, shape_of_(i), above);  // a turn's, outside the spent memory, is empty here
      if (above.empty()) need[turn(i)] = std::max(need[turn(i)], shape_of_(i).numel() * dtype_size(dtype));
    }
    for (int t = 0; t < 2; ++t)
      if (need[t] > 0) turns_[t] = scratch.tensor(Shape{static_cast<std::int64_t>(need[t] / dtype_size(dtype))}, dtype);
  }
  // Part i's input gradient; `above` the one part i reads (what this gave part i + 1).
  Tensor operator()(std::size_t i, const Tensor& above) {
    const Shape shape = shape_of_(i);
    const Tensor t = find_(i, shape, above);
    return t.empty() ? turns_[turn(i)].head(shape) : t;
  }

 private:
  std::size_t turn(std::size_t i) const { return (n_ - 1 - i) % 2; }
  std::size_t n_;
  DType dtype_;
  ShapeOf shape_of_;
  Find find_;
  Tensor turns_[2];
};

// ChainGradients' placements in bytes, for the plan: part i's forward allocated from
// offset start[i] (start[n]: where the chain's end), and part i's input gradient of
// grad[i] bytes (i >= 1) takes the lowest offset from start[i + 1] on that fits below
// start[n] beside the one part i reads; the last part's, where none does, `spare` bytes
// outside (offset start[n]). Each offset, or -1 where a turn buffer takes it; and the
// two turn buffers' bytes (`turns`).
std::vector<double> first_fit(const std::vector<double>& start, const std::vector<double>& grad, double spare,
                              double turns[2]);

// For layers of a weight and an optional bias (param_specs in that order).
void bind_weight_bias(std::span<const Tensor> params, std::span<const Tensor> grads, Tensor& weight, Tensor& dweight,
                      Tensor& bias, Tensor& dbias);
// For composite layers: their parts' parameters under a prefix, and consecutive slices
// of params/grads handed to the parts in param_specs() order.
void append_specs(std::vector<ParamSpec>& out, const std::string& prefix, const Layer& part);
void bind_parts(std::span<const Tensor> params, std::span<const Tensor> grads, std::span<Layer* const> parts);
void bind_parts(std::span<const Tensor> params, std::span<const Tensor> grads, std::initializer_list<Layer*> parts);

}  // namespace mpipe
