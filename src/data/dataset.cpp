// The datasets behind --data.
#include "mpipe/data/dataset.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/rng.hpp"
#include "mpipe/data/token_data.hpp"

namespace mpipe {

namespace {

// ---- synthetic tokens: order-2 Markov chain ----------------------------------------
// Token x[t] is one of 4 candidates fixed per previous token x[t-1]; which candidate is
// likeliest rotates with x[t-2]. A bigram model can reach ln 4 nats; one that attends
// two tokens back reaches the chain's entropy H = -sum p ln p.
class MarkovTokens final : public Dataset {
 public:
  static constexpr int k = 4;
  static constexpr float probs[k] = {0.7f, 0.1f, 0.1f, 0.1f};

  MarkovTokens(int vocab, int seq_len, std::uint64_t seed)
      : vocab_(vocab), seq_len_(seq_len), seed_(seed), candidates_(static_cast<std::size_t>(vocab) * k) {
    const RandomStream setup = make_stream(seed, Stream::data_setup, 0, 0, 0);
    const std::uint64_t max_stride = std::max(1, (vocab - 1) / (k - 1));
    for (int b = 0; b < vocab; ++b) {
      const std::uint64_t first = setup.below(2 * b, vocab);
      const std::uint64_t stride = 1 + setup.below(2 * b + 1, max_stride);
      for (int j = 0; j < k; ++j) candidates_[b * k + j] = static_cast<int32_t>((first + j * stride) % vocab);
    }
  }

  void fill(std::uint64_t first, std::int64_t count, const Tensor& inputs, const Tensor& targets) const override {
    const int64_t T = seq_len_;
    int32_t* in = inputs.i32();
    int32_t* out = targets.i32();
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < count; ++s) {
      const std::uint64_t sample = first + static_cast<std::uint64_t>(s);
      const RandomStream rng = make_stream(seed_, Stream::data, static_cast<std::uint32_t>(sample),
                                           static_cast<std::uint32_t>(sample >> 32), 0);
      int32_t prev2 = static_cast<int32_t>(rng.below(0, vocab_));
      int32_t prev1 = static_cast<int32_t>(rng.below(1, vocab_));
      in[s * T] = prev2;
      for (int64_t t = 0; t < T; ++t) {
        int32_t next = prev1;
        if (t > 0) {
          const float u = rng.uniform(4 * (t + 2));
          int j = 0;
          float acc = probs[0];
          while (j < k - 1 && u >= acc) acc += probs[++j];
          next = candidates_[prev1 * k + (j + prev2) % k];
          prev2 = prev1;
          prev1 = next;
        }
        // t = 0 predicts the second (uniform) token from the first.
        out[s * T + t] = next;
        if (t + 1 < T) in[s * T + t + 1] = next;
      }
    }
  }

  std::string describe() const override {
    double h = 0.0;
    for (float p : probs) h -= p * std::log(p);
    const double floor = (std::log(static_cast<double>(vocab_)) + (seq_len_ - 1) * h) / seq_len_;
    return cat("synthetic order-2 Markov chain over ", vocab_, " tokens; loss floor ", floor,
               " nats/token (bigram-only ", (std::log(static_cast<double>(vocab_)) + (seq_len_ - 1) * std::log(4.0)) / seq_len_, ")");
  }

 private:
  int vocab_, seq_len_;
  std::uint64_t seed_;
  std::vector<int32_t> candidates_;  // (V, 4)
};

// ---- synthetic classification: a random teacher ------------------------------------
class TeacherClassification final : public Dataset {
 public:
  static constexpr int teacher_hidden = 32;

  TeacherClassification(int inputs, int classes, std::uint64_t seed)
      : inputs_(inputs), classes_(classes), seed_(seed),
        w1_(static_cast<std::size_t>(teacher_hidden) * inputs), w2_(static_cast<std::size_t>(classes) * teacher_hidden) {
    const RandomStream a = make_stream(seed, Stream::data_setup, 1, 0, 0);
    const RandomStream b = make_stream(seed, Stream::data_setup, 2, 0, 0);
    a.fill_normal(w1_.data(), w1_.size(), 1.0f / std::sqrt(static_cast<float>(inputs)));
    b.fill_normal(w2_.data(), w2_.size());
  }

  void fill(std::uint64_t first, std::int64_t count, const Tensor& inputs, const Tensor& targets) const override {
    if (static_cast<std::size_t>(count * teacher_hidden) > hidden_.size()) hidden_.resize(count * teacher_hidden);
    float* x = inputs.f32();
    int32_t* y = targets.i32();
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < count; ++s) {
      const std::uint64_t sample = first + static_cast<std::uint64_t>(s);
      make_stream(seed_, Stream::data, static_cast<std::uint32_t>(sample), static_cast<std::uint32_t>(sample >> 32), 0)
          .fill_normal(x + s * inputs_, static_cast<std::uint64_t>(inputs_));
    }
    // The teacher's hidden layer for the whole batch in one GEMM: (count, 32).
    cpu::matmul_forward(hidden_.data(), x, w1_.data(), nullptr, count, inputs_, teacher_hidden);
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < count; ++s) {
      const float* hidden = hidden_.data() + s * teacher_hidden;
      int best = 0;
      float best_logit = -INFINITY;
      for (int c = 0; c < classes_; ++c) {
        float acc = 0.0f;
        for (int h = 0; h < teacher_hidden; ++h) acc += w2_[c * teacher_hidden + h] * std::max(hidden[h], 0.0f);
        if (acc > best_logit) best_logit = acc, best = c;
      }
      y[s] = best;
    }
  }

  bool fills_aside() const override { return false; }  // the teacher's GEMM

  std::string describe() const override {
    return cat("synthetic classification: ", inputs_, " Gaussian features labelled by a fixed random ReLU teacher over ",
               classes_, " classes (loss floor 0)");
  }

 private:
  int inputs_, classes_;
  std::uint64_t seed_;
  std::vector<float> w1_, w2_;
  mutable std::vector<float> hidden_;  // scratch, grown on the first call only
};

// ---- synthetic images: a template per class, plus noise -----------------------------
// Class k's template is a fixed random sum of low-frequency waves per channel; a sample
// is its class's template plus unit Gaussian noise, so a convolutional network can learn
// the classes from the images (the Bayes error is small but not zero).
class SyntheticImages final : public Dataset {
 public:
  static constexpr int waves = 3;

  SyntheticImages(int channels, int height, int width, int classes, std::uint64_t seed)
      : c_(channels), h_(height), w_(width), classes_(classes), seed_(seed),
        templates_(static_cast<std::size_t>(classes) * channels * height * width, 0.0f) {
    const RandomStream r = make_stream(seed, Stream::data_setup, 5, 0, 0);
    std::uint64_t at = 0;
    for (int k = 0; k < classes; ++k)
      for (int ch = 0; ch < channels; ++ch) {
        float* t = templates_.data() + (static_cast<std::size_t>(k) * channels + ch) * height * width;
        for (int wave = 0; wave < waves; ++wave) {
          const float amplitude = 0.5f + r.uniform(at++), phase = 6.2831853f * r.uniform(at++);
          const float fy = static_cast<float>(r.word(at++) % 3), fx = static_cast<float>(r.word(at++) % 3);
          for (int y = 0; y < height; ++y)
            for (int x = 0; x < width; ++x)
              t[y * width + x] += amplitude * std::sin(6.2831853f * (fy * static_cast<float>(y) / static_cast<float>(height) +
                                                                     fx * static_cast<float>(x) / static_cast<float>(width)) + phase);
        }
      }
  }

  void fill(std::uint64_t first, std::int64_t count, const Tensor& inputs, const Tensor& targets) const override {
    const std::int64_t per = static_cast<std::int64_t>(c_) * h_ * w_;
    float* x = inputs.f32();
    std::int32_t* y = targets.i32();
#pragma omp parallel for schedule(static)
    for (std::int64_t s = 0; s < count; ++s) {
      const std::uint64_t sample = first + static_cast<std::uint64_t>(s);
      const RandomStream r = make_stream(seed_, Stream::data, static_cast<std::uint32_t>(sample),
                                         static_cast<std::uint32_t>(sample >> 32), 1);
      const int label = static_cast<int>(r.word(0) % static_cast<std::uint32_t>(classes_));
      y[s] = label;
      float* out = x + s * per;
      make_stream(seed_, Stream::data, static_cast<std::uint32_t>(sample), static_cast<std::uint32_t>(sample >> 32), 2)
          .fill_normal(out, static_cast<std::uint64_t>(per));
      const float* t = templates_.data() + static_cast<std::size_t>(label) * per;
      for (std::int64_t i = 0; i < per; ++i) out[i] += t[i];
    }
  }

  std::string describe() const override {
    return cat("synthetic images: ", c_, "x", h_, "x", w_, ", ", classes_,
               " classes, each a fixed random low-frequency template plus unit Gaussian noise");
  }

 private:
  int c_, h_, w_, classes_;
  std::uint64_t seed_;
  std::vector<float> templates_;
};

// ---- synthetic segmentation: shapes on noise, a label per pixel --------------------
// Each sample draws up to three rectangles and discs of classes 1 .. classes - 1 on a
// background of class 0; a pixel's label is the class of the last shape covering it, and
// its channels that class's fixed levels plus unit Gaussian noise: a network must look at
// a pixel's neighbourhood (the noise) and at shapes' extents to label it well.
class SyntheticSegmentation final : public Dataset {
 public:
  static constexpr int shapes = 3;

  SyntheticSegmentation(int channels, int height, int width, int classes, std::uint64_t seed)
      : c_(channels), h_(height), w_(width), classes_(classes), seed_(seed),
        levels_(static_cast<std::size_t>(classes) * channels) {
    const RandomStream r = make_stream(seed, Stream::data_setup, 6, 0, 0);
    for (std::size_t i = 0; i < levels_.size(); ++i) levels_[i] = i < static_cast<std::size_t>(channels) ? 0.0f : 3.0f * r.uniform(i) - 1.5f;
  }

  void fill(std::uint64_t first, std::int64_t count, const Tensor& inputs, const Tensor& targets) const override {
    const std::int64_t plane = static_cast<std::int64_t>(h_) * w_;
#pragma omp parallel for schedule(static)
    for (std::int64_t s = 0; s < count; ++s) {
      const std::uint64_t sample = first + static_cast<std::uint64_t>(s);
      const auto lo = static_cast<std::uint32_t>(sample), hi = static_cast<std::uint32_t>(sample >> 32);
      const RandomStream r = make_stream(seed_, Stream::data, lo, hi, 1);
      std::int32_t* y = targets.i32() + s * plane;
      std::fill(y, y + plane, 0);
      for (int k = 0; k < shapes; ++k) {
        const std::uint64_t at = static_cast<std::uint64_t>(k) * 6;
        if (r.word(at) % 4 == 0) continue;  // fewer shapes, sometimes
        const int label = 1 + static_cast<int>(r.word(at + 1) % static_cast<std::uint32_t>(classes_ - 1));
        const float cy = r.uniform(at + 2) * static_cast<float>(h_), cx = r.uniform(at + 3) * static_cast<float>(w_);
        const float radius = (0.15f + 0.25f * r.uniform(at + 4)) * static_cast<float>(std::min(h_, w_));
        const bool disc = r.word(at + 5) % 2 == 0;
        for (int py = 0; py < h_; ++py)
          for (int px = 0; px < w_; ++px) {
            const float dy = static_cast<float>(py) + 0.5f - cy, dx = static_cast<float>(px) + 0.5f - cx;
            const bool in = disc ? dy * dy + dx * dx <= radius * radius : std::fabs(dy) <= radius && std::fabs(dx) <= 0.6f * radius;
            if (in) y[py * w_ + px] = label;
          }
      }
      if (inputs.empty()) continue;
      float* out = inputs.f32() + s * c_ * plane;
      make_stream(seed_, Stream::data, lo, hi, 2).fill_normal(out, static_cast<std::uint64_t>(c_ * plane));
      for (int ch = 0; ch < c_; ++ch)
        for (std::int64_t p = 0; p < plane; ++p) out[ch * plane + p] += levels_[static_cast<std::size_t>(y[p]) * c_ + ch];
    }
  }

  bool targets_alone() const override { return true; }

  std::string describe() const override {
    return cat("synthetic segmentation: ", c_, "x", h_, "x", w_, ", up to ", shapes, " rectangles and discs of ",
               classes_ - 1, " classes on a background, a label per pixel, unit Gaussian noise");
  }

 private:
  int c_, h_, w_, classes_;
  std::uint64_t seed_;
  std::vector<float> levels_;  // (classes, channels): class 0 (the background) at 0
};

// ---- held-out synthetic data: samples from 2^40 on, which no training run reaches ---
class HeldOut final : public Dataset {
 public:
  explicit HeldOut(std::unique_ptr<Dataset> data) : data_(std::move(data)) {}
  void fill(std::uint64_t first, std::int64_t count, const Tensor& inputs, const Tensor& targets) const override {
    data_->fill(first + (std::uint64_t{1} << 40), count, inputs, targets);
  }
  std::string describe() const override { return "held out: " + data_->describe(); }
  bool fills_aside() const override { return data_->fills_aside(); }

 private:
  std::unique_ptr<Dataset> data_;
};

}  // namespace

std::string data_file(const std::string& spec) {
  const auto colon = spec.find(':');
  return colon == std::string::npos ? std::string() : spec.substr(colon + 1);
}

std::unique_ptr<Dataset> make_dataset(const std::string& spec, const Model& model, std::uint64_t seed, bool held_out,
                                      const TokenOptions& tokens) {
  const std::string option = held_out ? "--eval-data" : "--data";  // the one the messages name
  const std::string hint = cat("use ", option, " synthetic, text:PATH, tokens:PATH or hdf5:PATH");
  // A model of tokens predicts tokens of its vocabulary (the loss's classes).
  const int64_t seq_len = model.tokens(), vocab = model.classes();
  if (spec.rfind("hdf5:", 0) == 0 && spec.size() > 5) return make_labelled_file(spec.substr(5), model, seed, !held_out);
  if (spec == "synthetic" && held_out) return std::make_unique<HeldOut>(make_dataset(spec, model, seed));
  if (spec == "synthetic") {
    const Shape sample = model.input_shape(1);
    if (seq_len == 0 && sample.rank == 4 && model.target_shape(1).rank == 3) {  // a label per pixel
      MPIPE_REQUIRE(vocab >= 2, "give the last convolution out = 2 or more classes", "synthetic segmentation needs at least 2 classes, got ", vocab);
      return std::make_unique<SyntheticSegmentation>(static_cast<int>(sample[1]), static_cast<int>(sample[2]),
                                                     static_cast<int>(sample[3]), static_cast<int>(vocab), seed);
    }
    if (seq_len == 0 && sample.rank == 4)  // images (C, H, W)
      return std::make_unique<SyntheticImages>(static_cast<int>(sample[1]), static_cast<int>(sample[2]),
                                               static_cast<int>(sample[3]), static_cast<int>(vocab), seed);
    if (seq_len == 0) return std::make_unique<TeacherClassification>(static_cast<int>(sample.numel()), static_cast<int>(vocab), seed);
    MPIPE_REQUIRE(vocab >= MarkovTokens::k, "use --vocab 4 or more",
                  "synthetic data needs a vocabulary of at least 4 tokens, got ", vocab);
    return std::make_unique<MarkovTokens>(static_cast<int>(vocab), static_cast<int>(seq_len), seed);
  }
  const auto colon = spec.find(':');
  MPIPE_REQUIRE(colon != std::string::npos && colon + 1 < spec.size(), hint, "bad ", option, " '", spec, "'");
  const std::string kind = spec.substr(0, colon), path = data_file(spec);
  MPIPE_REQUIRE(kind == "text" || kind == "tokens", hint, "unknown data kind '", kind, "' in ", option);
  MPIPE_REQUIRE(seq_len > 0, "use --data synthetic with a model of inputs (mlp)",
                option, " ", kind, ": files of tokens are for models of tokens (gpt)");
  return make_token_data(kind == "text", path, seq_len, vocab, seed, held_out, tokens);
}

}  // namespace mpipe
