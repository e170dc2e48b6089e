// GPT-2 and MLP built as flat layer lists, GPT-2 initialisation.
#include "mpipe/nn/model.hpp"

#include <cmath>

namespace mpipe {

void validate(const ModelConfig& c) {
  const std::string hint = "check the model options";
  MPIPE_REQUIRE(c.kind == "gpt" || c.kind == "mlp", "use --model gpt or --model mlp",
                "unknown model '", c.kind, "'");
  MPIPE_REQUIRE(c.layers > 0, hint, "--layers must be positive, got ", c.layers);
  // Beyond any real network; and the layer list alone would not fit in memory.
  constexpr int max_layers = 100000;
  MPIPE_REQUIRE(c.layers <= max_layers, cat("give at most ", max_layers), "--layers ", c.layers,
                " is more than mpipe builds (", max_layers, ")");
  MPIPE_REQUIRE(c.dropout >= 0.0f && c.dropout < 1.0f, hint, "--dropout must be in [0, 1), got ", c.dropout);
  if (c.kind == "gpt") {
    MPIPE_REQUIRE(c.d_model > 0, hint, "--d-model must be positive, got ", c.d_model);
    MPIPE_REQUIRE(c.heads > 0, hint, "--heads must be positive, got ", c.heads);
    MPIPE_REQUIRE(c.d_model % c.heads == 0, "pick --heads dividing --d-model",
                  "--d-model ", c.d_model, " is not divisible by --heads ", c.heads);
    MPIPE_REQUIRE(c.seq_len > 0, hint, "--seq-len must be positive, got ", c.seq_len);
    MPIPE_REQUIRE(c.vocab > 0, hint, "--vocab must be positive, got ", c.vocab);
  } else {
    MPIPE_REQUIRE(c.hidden > 0, hint, "--hidden must be positive, got ", c.hidden);
    MPIPE_REQUIRE(c.inputs > 0, hint, "--inputs must be positive, got ", c.inputs);
    MPIPE_REQUIRE(c.classes > 1, hint, "--classes must be at least 2, got ", c.classes);
  }
}

Model::Model(const ModelConfig& config) : config_(config) {
  validate(config);
  constexpr float init_std = 0.02f;
  if (config.kind == "gpt") {
    const int64_t C = config.d_model;
    // GPT-2: residual projections scaled by 1/sqrt(2N) so the residual stream's variance
    // does not grow with depth.
    const float proj_std = init_std / std::sqrt(2.0f * static_cast<float>(config.layers));
    layers_.push_back(std::make_unique<Embedding>(config.vocab, config.seq_len, C, config.dropout));
    for (int i = 0; i < config.layers; ++i)
      layers_.push_back(std::make_unique<TransformerBlock>(C, config.heads, config.dropout, init_std, proj_std));
    layers_.push_back(std::make_unique<LayerNorm>(C));
    auto head = std::make_unique<Linear>(C, config.vocab, false, init_std);
    head->tie_weight(0, "wte");  // the LM head is the token embedding, transposed
    layers_.push_back(std::move(head));
  } else {
    int64_t width = config.inputs;
    for (int i = 0; i < config.layers; ++i) {
      layers_.push_back(std::make_unique<Linear>(width, config.hidden, true, init_std));
      layers_.push_back(std::make_unique<ReLU>());
      if (config.dropout > 0.0f) layers_.push_back(std::make_unique<Dropout>(config.dropout, 0));
      width = config.hidden;
    }
    layers_.push_back(std::make_unique<Linear>(width, config.classes, true, init_std));
  }
  layers_.push_back(std::make_unique<CrossEntropyLoss>());
  for (int i = 0; i < size(); ++i) {
    layers_[i]->set_global_index(i);
    for (const ParamSpec& spec : layers_[i]->param_specs())
      if (spec.tied_layer >= 0) ties_.push_back({spec.tied_layer, spec.tied_name, i});
  }
}

int Model::copy_layer_of(int layer, const std::string& name) const {
  for (const Tie& tie : ties_)
    if (tie.owner_layer == layer && tie.name == name) return tie.copy_layer;
  return -1;
}

Shape Model::input_shape(int64_t batch) const {
  if (config_.kind == "gpt") return Shape{batch, config_.seq_len};
  return Shape{batch, config_.inputs};
}

DType Model::input_dtype() const { return config_.kind == "gpt" ? DType::i32 : DType::f32; }

Shape Model::target_shape(int64_t batch) const {
  if (config_.kind == "gpt") return Shape{batch, config_.seq_len};
  return Shape{batch};
}

int64_t Model::parameter_count() const {
  int64_t n = 0;
  for (const auto& layer : layers_)
    for (const ParamSpec& spec : layer->param_specs())
      if (spec.tied_layer < 0) n += spec.shape.numel();  // a tied copy is the owner's
  return n;
}

int64_t Model::rows_per_sample() const { return config_.kind == "gpt" ? config_.seq_len : 1; }

std::vector<Shape> Model::shapes(int64_t batch) const {
  std::vector<Shape> out{input_shape(batch)};
  for (const auto& layer : layers_) out.push_back(layer->output_shape(out.back()));
  return out;
}

}  // namespace mpipe
