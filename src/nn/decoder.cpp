// Generation: a range of layers run forward over new tokens with key/value caches, and
// the sampling of the next token.
#include "mpipe/nn/decoder.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "mpipe/backend/ops.hpp"
#include "mpipe/nn/transformer_layers.hpp"
#include "mpipe/nn/vocab_layers.hpp"

namespace mpipe {

namespace {

// Layers that look across positions: what comes after the last of them works on each
// position alone (the head needs the last position only).
bool mixes_positions(const std::string& kind) { return kind == "embedding" || kind == "block" || kind == "attention"; }

int head_begin(const Model& model) {
  int head = 0;
  for (int i = 0; i < model.size(); ++i)
    if (mixes_positions(model.layer(i).kind())) head = i + 1;
  return head;
}

}  // namespace

std::string generation_problem(const Model& model) {
  if (model.tokens() <= 0) return "it is not a model of tokens (generation needs an embedding first)";
  static const std::set<std::string> kinds = {"embedding", "block", "attention", "layernorm", "rmsnorm", "linear",
                                              "gelu", "swiglu", "relu", "dropout", "vocab-chunk", "cross_entropy"};
  for (int i = 0; i < model.size(); ++i)
    if (!kinds.contains(model.layer(i).kind()))
      return cat("layer ", i, " is a ", model.layer(i).kind(), ", which generation does not run");
  return "";
}

std::vector<int> generation_stages(const Model& model, int stages) {
  const int head = head_begin(model), n = model.size();
  MPIPE_REQUIRE(stages >= 1 && stages <= head, cat("run it on at most ", head, " ranks"), "generation splits the model's ",
                head, " layers before its head over ranks, and ", stages, " ranks are more");
  // One token's forward FLOPs per layer; the head's with the last stage's share.
  std::vector<Shape> shapes = model.shapes(1);
  std::vector<double> flops(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    Shape in = shapes[static_cast<std::size_t>(i)];
    if (in.rank >= 2) in.dims[1] = 1;
    flops[static_cast<std::size_t>(i)] = model.layer(i).cost(in).forward_flops;
  }
  const double total = std::accumulate(flops.begin(), flops.end(), 0.0);
  std::vector<int> bounds{0};
  double sum = 0;
  for (int i = 0; i < head && static_cast<int>(bounds.size()) < stages; ++i) {
    sum += flops[static_cast<std::size_t>(i)];
    const int left = head - (i + 1), needed = stages - static_cast<int>(bounds.size());
    // Cut after layer i once this stage has its share, or where the stages still to
    // come need every layer left.
    if (left >= needed && (sum >= total * static_cast<double>(bounds.size()) / stages || left == needed))
      bounds.push_back(i + 1);
  }
  bounds.push_back(n);
  return bounds;
}

Decoder::Decoder(Model& model, int begin, int end, int sequences, Device device, DType dtype)
    : model_(model), begin_(begin), end_(end), head_(head_begin(model)), capacity_(model.tokens()),
      vocab_(model.classes()), device_(device), dtype_(dtype), caches_arena_(ops::device_memory(device)),
      work_(ops::device_memory(device)) {
  MPIPE_CHECK(0 <= begin && begin < end && end <= model.size() && sequences >= 1, "decoder of layers ", begin, "..", end);
  caches_.resize(static_cast<std::size_t>(sequences), std::vector<Tensor>(static_cast<std::size_t>(model.size())));
  filled_.assign(static_cast<std::size_t>(sequences), 0);
  for (int i = begin; i < end; ++i) {
    const std::int64_t width = model.layer(i).cache_width();  // (1, capacity, 2 KV): keys and values
    if (width == 0) continue;
    for (auto& caches : caches_)
      caches[static_cast<std::size_t>(i)] = caches_arena_.tensor(Shape{1, capacity_, width}, dtype);
  }
  input_ = caches_arena_.tensor(input_shape(capacity_), input_dtype());
  logit_values_.resize(static_cast<std::size_t>(vocab_));
  logits_ = make_tensor(logit_values_.data(), Shape{vocab_});
}

Shape Decoder::input_shape(std::int64_t t) const {
  if (begin_ == 0) return Shape{1, t};
  return Shape{1, t, model_.shapes(1)[static_cast<std::size_t>(begin_)][-1]};
}

DType Decoder::input_dtype() const { return begin_ == 0 ? DType::i32 : dtype_; }

Decoder::Feed Decoder::next_feed(int sequence, std::int64_t size, bool fresh) {
  std::int64_t& filled = filled_[static_cast<std::size_t>(sequence)];
  Feed feed{1, filled};
  if (fresh) feed = {std::min(size, capacity_), 0};
  else if (filled == capacity_) feed = {capacity_ / 2 + capacity_ % 2, 0};
  filled = feed.position + feed.count;
  return feed;
}

Tensor Decoder::forward(int sequence, const Tensor& x, std::int64_t position) {
  MPIPE_CHECK(sequence >= 0 && sequence < static_cast<int>(caches_.size()), "sequence ", sequence);
  const std::int64_t t = x.shape[1];
  MPIPE_CHECK(t >= 1 && position + t <= capacity_, t, " tokens at position ", position, " of ", capacity_);
  work_.reset();
  const Decode decode{position, caches_[static_cast<std::size_t>(sequence)]};
  Pass pass;
  pass.arena = &work_;
  pass.training = false;
  pass.dtype = dtype_;
  pass.decode = &decode;
  pass.stage_input = x.data;
  Tensor y = x;
  for (int i = begin_; i < end_; ++i) {
    Layer& layer = model_.layer(i);
    if (i == head_ && t > 1) {
      // The head sees the last position alone: (1, 1, C).
      const std::size_t row = static_cast<std::size_t>(y.shape[-1]) * dtype_size(y.dtype);
      y = Tensor{static_cast<std::byte*>(y.data) + static_cast<std::size_t>(t - 1) * row, Shape{1, 1, y.shape[-1]},
                 y.dtype, y.device};
    }
    if (layer.kind() == "cross_entropy") break;
    if (layer.kind() == "vocab-chunk") {
      // A head in vocabulary chunks: each chunk's logits of the hidden states, side by side.
      Tensor z = work_.tensor(Shape{1, vocab_}, dtype_);
      const Tensor h = y.view(Shape{1, y.shape[-1]});
      for (; i < end_ && model_.layer(i).kind() == "vocab-chunk"; ++i) {
        const auto& chunk = static_cast<const VocabChunk&>(model_.layer(i));
        const Tensor part = chunk.logits(h, work_);  // (1, end - begin)
        const std::size_t size = dtype_size(dtype_);
        ops::copy(Tensor{static_cast<std::byte*>(z.data) + static_cast<std::size_t>(chunk.begin()) * size,
                         part.shape, dtype_, device_},
                  part);
      }
      y = z;
      break;
    }
    Context ctx;
    y = layer.forward(y, ctx, pass);
  }
  if (!has_head()) return y;
  const Tensor z = y.view(Shape{vocab_});
  if (device_ == Device::cpu) return z;  // fp32 already
  // On a GPU: fp32, then to the host for sampling.
  const Tensor wide = z.dtype == DType::f32 ? z : work_.tensor(Shape{vocab_}, DType::f32);
  if (wide.data != z.data) ops::convert(wide, z);
  ops::transfer(logits_, wide);
  return logits_;
}

std::int32_t sample_token(std::span<const float> logits, const Sampling& sampling, float u,
                          std::vector<std::int32_t>& order, std::vector<double>& weights) {
  const auto vocab = static_cast<std::int32_t>(logits.size());
  if (sampling.temperature <= 0.0) {  // greedy: the first largest, as torch.argmax
    return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  order.resize(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::int32_t kept = vocab;
  if (sampling.top_k > 0 || sampling.top_p < 1.0) {
    // The largest first, ties by index: a fixed order, whatever the sort does.
    auto larger = [&](std::int32_t a, std::int32_t b) {
      return logits[static_cast<std::size_t>(a)] > logits[static_cast<std::size_t>(b)] ||
             (logits[static_cast<std::size_t>(a)] == logits[static_cast<std::size_t>(b)] && a < b);
    };
    if (sampling.top_k > 0 && sampling.top_k < vocab) {
      kept = static_cast<std::int32_t>(sampling.top_k);
      std::partial_sort(order.begin(), order.begin() + kept, order.end(), larger);
    } else {
      std::sort(order.begin(), order.end(), larger);
    }
  }
  // Softmax of logits / temperature over the kept tokens, in double.
  const double top = *std::max_element(logits.begin(), logits.end());
  weights.resize(static_cast<std::size_t>(kept));
  double sum = 0;
  for (std::int32_t r = 0; r < kept; ++r) {
    weights[static_cast<std::size_t>(r)] =
        std::exp((logits[static_cast<std::size_t>(order[static_cast<std::size_t>(r)])] - top) / sampling.temperature);
    sum += weights[static_cast<std::size_t>(r)];
  }
  if (sampling.top_p < 1.0) {  // the smallest prefix of the largest reaching top_p
    double mass = 0;
    std::int32_t r = 0;
    while (r < kept && mass < sampling.top_p * sum) mass += weights[static_cast<std::size_t>(r++)];
    kept = std::max<std::int32_t>(r, 1);
    sum = mass > 0 ? mass : weights[0];
  }
  const double target = static_cast<double>(u) * sum;
  double run = 0;
  for (std::int32_t r = 0; r < kept; ++r) {
    run += weights[static_cast<std::size_t>(r)];
    if (target < run) return order[static_cast<std::size_t>(r)];
  }
  return order[static_cast<std::size_t>(kept - 1)];
}

}  // namespace mpipe
