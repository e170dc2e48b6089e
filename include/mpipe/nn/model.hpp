// Models: a flat, ordered list of layers with global indices, built from options.
// A pipeline stage is a contiguous range of it.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "mpipe/nn/layer.hpp"

namespace mpipe {

struct ModelConfig {
  std::string kind = "gpt";  // gpt | mlp
  int layers = 4;            // transformer blocks (gpt) or hidden blocks (mlp)
  int d_model = 128;
  int heads = 4;
  int seq_len = 64;
  int vocab = 256;
  int hidden = 256;   // mlp width
  int inputs = 64;    // mlp input features
  int classes = 10;   // mlp classes
  float dropout = 0.0f;
};

// Checks sizes and combinations; throws UserError naming the option at fault.
void validate(const ModelConfig& config);

class Model {
 public:
  explicit Model(const ModelConfig& config);
  Model(Model&&) = default;

  const ModelConfig& config() const { return config_; }
  int size() const { return static_cast<int>(layers_.size()); }
  Layer& layer(int index) { return *layers_[index]; }
  const Layer& layer(int index) const { return *layers_[index]; }

  // What one micro-batch of `batch` samples looks like going in, and its targets.
  Shape input_shape(int64_t batch) const;
  DType input_dtype() const;
  Shape target_shape(int64_t batch) const;
  // Weights shared by two layers (GPT's embedding and head): the owner's layer and
  // parameter name, and the layer holding the copy.
  struct Tie {
    int owner_layer;
    std::string name;
    int copy_layer;
  };
  const std::vector<Tie>& ties() const { return ties_; }
  // The layer holding a copy of (layer, name), or -1.
  int copy_layer_of(int layer, const std::string& name) const;
  // Parameters of the whole model, a tied weight counted once.
  int64_t parameter_count() const;
  // Loss rows (predicted tokens or samples) per sample: T for gpt, 1 for mlp.
  int64_t rows_per_sample() const;
  // Input shape of every layer for a micro-batch of `batch`: shapes[i] enters layer i,
  // shapes[size()] leaves the last.
  std::vector<Shape> shapes(int64_t batch) const;

 private:
  ModelConfig config_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<Tie> ties_;
};

}  // namespace mpipe
