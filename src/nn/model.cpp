// Models built from their layer lists: the presets' lists (GPT-2 with its
// initialisation, an MLP) and the layers through the registry.
#include "mpipe/nn/model.hpp"

#include <cmath>
#include <map>

namespace mpipe {

bool is_preset(const std::string& kind) { return kind == "gpt" || kind == "mlp"; }

void validate(const ModelConfig& c) {
  const std::string hint = "check the model options";
  MPIPE_REQUIRE(!c.kind.empty(), "use --model gpt, mlp or the path of a model file", "--model is empty");
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
  } else if (c.kind == "mlp") {
    MPIPE_REQUIRE(c.hidden > 0, hint, "--hidden must be positive, got ", c.hidden);
    MPIPE_REQUIRE(c.inputs > 0, hint, "--inputs must be positive, got ", c.inputs);
    MPIPE_REQUIRE(c.classes > 1, hint, "--classes must be at least 2, got ", c.classes);
  }
}

ModelSpec model_spec(const ModelConfig& c) {
  validate(c);
  if (!is_preset(c.kind)) return parse_model_file(c.kind);
  ModelSpec spec;
  spec.name = c.kind;
  using Options = std::map<std::string, OptionValue>;
  if (c.kind == "gpt") {
    spec.tokens = c.seq_len;
    spec.layers.push_back({"embedding", Options{{"vocab", std::int64_t{c.vocab}}, {"out", std::int64_t{c.d_model}},
                                                {"dropout", static_cast<double>(c.dropout)}}});
    for (int i = 0; i < c.layers; ++i)
      spec.layers.push_back({"block", Options{{"heads", std::int64_t{c.heads}}, {"dropout", static_cast<double>(c.dropout)}}});
    spec.layers.push_back({"layernorm", {}});
    // The LM head is the token embedding, transposed.
    spec.layers.push_back({"linear", Options{{"out", std::int64_t{c.vocab}}, {"bias", false}, {"tie", std::int64_t{0}}}});
  } else {
    spec.input = {c.inputs};
    for (int i = 0; i < c.layers; ++i) {
      spec.layers.push_back({"linear", Options{{"out", std::int64_t{c.hidden}}}});
      spec.layers.push_back({"relu", {}});
      if (c.dropout > 0.0f) spec.layers.push_back({"dropout", Options{{"p", static_cast<double>(c.dropout)}}});
    }
    spec.layers.push_back({"linear", Options{{"out", std::int64_t{c.classes}}}});
  }
  spec.layers.push_back({"cross_entropy", {}});
  return spec;
}

Model::Model(const ModelConfig& config) : config_(config), spec_(model_spec(config)) {
  const std::string file = is_preset(spec_.name) ? cat("--model ", spec_.name) : cat("model file '", spec_.name, "'");
  Shape shape = input_shape(1);
  for (int i = 0; i < static_cast<int>(spec_.layers.size()); ++i) {
    layers_.push_back(make_layer(spec_, i, shape, cat(file, ", layer ", i, " (", spec_.layers[static_cast<std::size_t>(i)].kind, ")")));
    shape = layers_.back()->output_shape(shape);
  }
  check_loss_input(file);
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
  if (spec_.tokens > 0) return Shape{batch, spec_.tokens};
  Shape s{batch};
  for (std::int64_t d : spec_.input) s.dims[s.rank++] = d;
  return s;
}

DType Model::input_dtype() const { return spec_.tokens > 0 ? DType::i32 : DType::f32; }

Shape Model::target_shape(int64_t batch) const {
  if (spec_.tokens > 0) return Shape{batch, spec_.tokens};
  return Shape{batch};
}

int64_t Model::parameter_count() const {
  int64_t n = 0;
  for (const auto& layer : layers_)
    for (const ParamSpec& spec : layer->param_specs())
      if (spec.tied_layer < 0) n += spec.shape.numel();  // a tied copy is the owner's
  return n;
}

int64_t Model::rows_per_sample() const { return spec_.tokens > 0 ? spec_.tokens : 1; }

void Model::check_loss_input(const std::string& file) const {
  const Shape in = shapes(1)[static_cast<std::size_t>(size()) - 1];
  const bool ok = spec_.tokens > 0 ? (in.rank == 3 && in[1] == spec_.tokens) : in.rank == 2;
  MPIPE_REQUIRE(ok, spec_.tokens > 0 ? "keep the (batch, tokens, channels) shape up to the loss" : "end with a linear layer of out = classes on (batch, features)",
                file, ": the loss gets ", in.str(), "; a model of ", spec_.tokens > 0 ? "tokens needs (batch, tokens, classes)" : "inputs needs (batch, classes)",
                " there");
  if (spec_.tokens > 0) {  // the targets are tokens, and so are the inputs
    const auto vocab = std::get<std::int64_t>(spec_.layers.front().options.at("vocab"));
    MPIPE_REQUIRE(vocab >= classes(), "give the embedding a vocab of at least the loss's classes", file,
                  ": the embedding takes ", vocab, " tokens, the loss predicts ", classes());
  }
}

int64_t Model::classes() const { return shapes(1)[static_cast<std::size_t>(size()) - 1][-1]; }

std::vector<Shape> Model::shapes(int64_t batch) const {
  std::vector<Shape> out{input_shape(batch)};
  for (const auto& layer : layers_) out.push_back(layer->output_shape(out.back()));
  return out;
}

}  // namespace mpipe
