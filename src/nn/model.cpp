// Models built from their layer lists: the presets' lists (GPT-2 with its
// initialisation, an MLP) and the layers through the registry.
#include "mpipe/nn/model.hpp"

#include <array>
#include <cmath>
#include <map>

#include "mpipe/nn/skip_layers.hpp"
#include "mpipe/nn/transformer_layers.hpp"

namespace mpipe {

bool is_preset(const std::string& kind) { return kind == "gpt" || kind == "llama" || kind == "mlp" || kind == "resnet"; }

namespace {

// Residual blocks per stage of each ResNet depth.
std::array<int, 4> resnet_blocks(int depth) {
  switch (depth) {
    case 18: return {2, 2, 2, 2};
    case 34: return {3, 4, 6, 3};
    case 50: return {3, 4, 6, 3};
    case 101: return {3, 4, 23, 3};
    case 152: return {3, 8, 36, 3};
    default: return {0, 0, 0, 0};
  }
}

using Options = std::map<std::string, OptionValue>;

Options conv(std::int64_t out, std::int64_t kernel, std::int64_t stride, std::int64_t padding) {
  return Options{{"out", out}, {"kernel", kernel}, {"stride", stride}, {"padding", padding}, {"bias", false}};
}

// ResNet (He et al. 2016; torchvision's v1.5: the stride on the 3x3 convolution), every
// convolution followed by BatchNorm, the projection skips too; each block's last
// BatchNorm starts at scale 0 (the block starts as its skip path: Goyal et al. 2017,
// timm's default), which also keeps a deep, narrow one well conditioned under
// micro-batch statistics. Images from 128 on get ImageNet's stem (7x7/2 convolution,
// 3x3/2 max pool); smaller ones CIFAR's (3x3/1).
void resnet_layers(const ModelConfig& c, ModelSpec& spec) {
  spec.input = {c.channels, c.image, c.image};
  const bool imagenet = c.image >= 128, bottleneck = c.layers >= 50;
  const std::int64_t width = c.width;
  spec.layers.push_back({"conv2d", imagenet ? conv(width, 7, 2, 3) : conv(width, 3, 1, 1)});
  spec.layers.push_back({"batchnorm2d", {}});
  spec.layers.push_back({"relu", {}});
  if (imagenet)
    spec.layers.push_back({"maxpool2d", Options{{"kernel", std::int64_t{3}}, {"stride", std::int64_t{2}}, {"padding", std::int64_t{1}}}});
  std::int64_t channels = width;
  const std::array<int, 4> blocks = resnet_blocks(c.layers);
  for (int stage = 0; stage < 4; ++stage) {
    const std::int64_t w = width << stage, out = bottleneck ? 4 * w : w;
    for (int b = 0; b < blocks[static_cast<std::size_t>(stage)]; ++b) {
      const std::int64_t stride = stage > 0 && b == 0 ? 2 : 1;
      LayerSpec block{"residual", Options{{"skip-norm", stride != 1 || channels != out}}, {}};
      auto add = [&](Options o, bool last = false) {
        block.children.push_back({"conv2d", std::move(o)});
        block.children.push_back({"batchnorm2d", last ? Options{{"zero-init", true}} : Options{}});
      };
      if (bottleneck) {
        add(conv(w, 1, 1, 0));
        block.children.push_back({"relu", {}});
        add(conv(w, 3, stride, 1));
        block.children.push_back({"relu", {}});
        add(conv(out, 1, 1, 0), true);
      } else {
        add(conv(w, 3, stride, 1));
        block.children.push_back({"relu", {}});
        add(conv(w, 3, 1, 1), true);
      }
      spec.layers.push_back(std::move(block));
      spec.layers.push_back({"relu", {}});
      channels = out;
    }
  }
  spec.layers.push_back({"global-avgpool", {}});
  spec.layers.push_back({"linear", Options{{"out", std::int64_t{c.classes}}}});
}

// The Llama family (Touvron et al. 2023; Hugging Face's LlamaForCausalLM): a token table
// without positions, pre-RMSNorm blocks with RoPE, grouped-query attention and a SwiGLU
// MLP, no biases, a final RMSNorm and the head, its own matrix or the token table. Every
// weight starts normal(0, 0.02), as Hugging Face's initializer_range.
void llama_layers(const ModelConfig& c, ModelSpec& spec) {
  spec.tokens = c.seq_len;
  spec.layers.push_back({"embedding", Options{{"vocab", std::int64_t{c.vocab}}, {"out", std::int64_t{c.d_model}},
                                              {"positions", std::string("none")}, {"dropout", static_cast<double>(c.dropout)}}});
  const Options block{{"heads", std::int64_t{c.heads}},
                      {"kv-heads", std::int64_t{c.kv_heads == 0 ? c.heads : c.kv_heads}},
                      {"positions", std::string("rope")},
                      {"rope-theta", c.rope_theta},
                      {"bias", false},
                      {"norm", std::string("rms")},
                      {"eps", c.norm_eps},
                      {"mlp", std::string("swiglu")},
                      {"ffn", std::int64_t{c.ffn > 0 ? c.ffn : llama_ffn(c.d_model)}},
                      {"proj-std", 0.02},
                      {"dropout", static_cast<double>(c.dropout)}};
  for (int i = 0; i < c.layers; ++i) spec.layers.push_back({"block", block});
  spec.layers.push_back({"rmsnorm", Options{{"eps", c.norm_eps}}});
  if (c.head_chunks == 1) {
    Options head{{"out", std::int64_t{c.vocab}}, {"bias", false}};
    if (c.tie_embeddings == "on") head["tie"] = std::int64_t{0};
    spec.layers.push_back({"linear", head});
  }
  for (int i = 0; c.head_chunks > 1 && i < c.head_chunks; ++i) {
    Options chunk{{"vocab", std::int64_t{c.vocab}}, {"chunk", std::int64_t{i}}, {"chunks", std::int64_t{c.head_chunks}},
                  {"logits", c.head_logits}};
    if (c.tie_embeddings == "on") chunk["tie"] = std::int64_t{0};
    spec.layers.push_back({"vocab-chunk", chunk});
  }
}

}  // namespace

bool is_resnet_depth(int layers) { return resnet_blocks(layers)[0] > 0; }

void validate(const ModelConfig& c) {
  const std::string hint = "check the model options";
  MPIPE_REQUIRE(!c.kind.empty(), "use --model gpt, llama, mlp, resnet or the path of a model file", "--model is empty");
  MPIPE_REQUIRE(c.layers > 0, hint, "--layers must be positive, got ", c.layers);
  // Beyond any real network; and the layer list alone would not fit in memory.
  constexpr int max_layers = 100000;
  MPIPE_REQUIRE(c.layers <= max_layers, cat("give at most ", max_layers), "--layers ", c.layers,
                " is more than mpipe builds (", max_layers, ")");
  MPIPE_REQUIRE(c.dropout >= 0.0f && c.dropout < 1.0f, hint, "--dropout must be in [0, 1), got ", c.dropout);
  if (c.kind == "gpt" || c.kind == "llama") {
    MPIPE_REQUIRE(c.d_model > 0, hint, "--d-model must be positive, got ", c.d_model);
    MPIPE_REQUIRE(c.heads > 0, hint, "--heads must be positive, got ", c.heads);
    MPIPE_REQUIRE(c.d_model % c.heads == 0, "pick --heads dividing --d-model",
                  "--d-model ", c.d_model, " is not divisible by --heads ", c.heads);
    MPIPE_REQUIRE(c.seq_len > 0, hint, "--seq-len must be positive, got ", c.seq_len);
    MPIPE_REQUIRE(c.vocab > 0, hint, "--vocab must be positive, got ", c.vocab);
    MPIPE_REQUIRE(c.head_chunks >= 1 && c.head_chunks <= c.vocab, "give from 1 (one linear head) to --vocab",
                  "--head-chunks must be from 1 to the vocabulary's ", c.vocab, ", got ", c.head_chunks);
    MPIPE_REQUIRE(c.head_logits == "keep" || c.head_logits == "recompute", "use keep or recompute",
                  "--head-logits must be keep or recompute, got '", c.head_logits, "'");
    MPIPE_REQUIRE(c.head_logits == "keep" || c.head_chunks > 1, "split the head with --head-chunks 2 or more",
                  "--head-logits recompute applies to a head in vocabulary chunks, and --head-chunks is 1");
  }
  if (c.kind == "llama") {
    const int kv = c.kv_heads == 0 ? c.heads : c.kv_heads;
    MPIPE_REQUIRE(kv >= 1 && kv <= c.heads && c.heads % kv == 0,
                  "give --kv-heads dividing --heads (1: multi-query; 0 or --heads: multi-head)", "--kv-heads ", c.kv_heads,
                  " does not divide --heads ", c.heads);
    MPIPE_REQUIRE((c.d_model / c.heads) % 2 == 0, "pick --heads giving an even head size", "RoPE needs an even head size, and --d-model ",
                  c.d_model, " over --heads ", c.heads, " gives ", c.d_model / c.heads);
    MPIPE_REQUIRE(c.ffn >= 0, "give a positive width, or 0 for Llama's rule (8/3 d-model rounded up to 256)",
                  "--ffn must be 0 or positive, got ", c.ffn);
    MPIPE_REQUIRE(c.rope_theta > 1.0 && c.rope_theta <= 1e9, "e.g. --rope-theta 10000 (Llama 2) or 500000 (Llama 3)",
                  "--rope-theta must be in (1, 1e9], got ", c.rope_theta);
    MPIPE_REQUIRE(c.norm_eps > 0.0 && c.norm_eps <= 0.1, "e.g. --norm-eps 1e-5 (Llama 3) or 1e-6 (Llama 2)",
                  "--norm-eps must be in (0, 0.1], got ", c.norm_eps);
    MPIPE_REQUIRE(c.tie_embeddings == "on" || c.tie_embeddings == "off", "use --tie-embeddings on or off",
                  "unknown --tie-embeddings '", c.tie_embeddings, "'");
  } else if (c.kind == "mlp") {
    MPIPE_REQUIRE(c.hidden > 0, hint, "--hidden must be positive, got ", c.hidden);
    MPIPE_REQUIRE(c.inputs > 0, hint, "--inputs must be positive, got ", c.inputs);
    MPIPE_REQUIRE(c.classes > 1, hint, "--classes must be at least 2, got ", c.classes);
  } else if (c.kind == "resnet") {
    MPIPE_REQUIRE(is_resnet_depth(c.layers), "give --layers 18, 34, 50, 101 or 152", "--layers ", c.layers,
                  " is not a ResNet depth");
    MPIPE_REQUIRE(c.image >= 8 && c.image <= 4096, "give --image from 8 to 4096 (224 for ImageNet)",
                  "--image must be from 8 to 4096, got ", c.image);
    MPIPE_REQUIRE(c.channels > 0 && c.channels <= 4096, hint, "--channels must be from 1 to 4096, got ", c.channels);
    MPIPE_REQUIRE(c.width > 0 && c.width <= 4096, hint, "--width must be from 1 to 4096, got ", c.width);
    MPIPE_REQUIRE(c.classes > 1, hint, "--classes must be at least 2, got ", c.classes);
  }
}

ModelSpec model_spec(const ModelConfig& c) {
  validate(c);
  if (!is_preset(c.kind)) return parse_model_file(c.kind);
  ModelSpec spec;
  spec.name = c.kind;
  if (c.kind == "resnet") {
    resnet_layers(c, spec);
  } else if (c.kind == "gpt") {
    spec.tokens = c.seq_len;
    spec.layers.push_back({"embedding", Options{{"vocab", std::int64_t{c.vocab}}, {"out", std::int64_t{c.d_model}},
                                                {"dropout", static_cast<double>(c.dropout)}}});
    for (int i = 0; i < c.layers; ++i)
      spec.layers.push_back({"block", Options{{"heads", std::int64_t{c.heads}}, {"dropout", static_cast<double>(c.dropout)}}});
    spec.layers.push_back({"layernorm", {}});
    // The LM head is the token embedding, transposed: one layer, or chunks of the
    // vocabulary that a pipeline can spread over stages.
    if (c.head_chunks == 1)
      spec.layers.push_back({"linear", Options{{"out", std::int64_t{c.vocab}}, {"bias", false}, {"tie", std::int64_t{0}}}});
    for (int i = 0; c.head_chunks > 1 && i < c.head_chunks; ++i)
      spec.layers.push_back({"vocab-chunk", Options{{"vocab", std::int64_t{c.vocab}}, {"chunk", std::int64_t{i}},
                                                    {"chunks", std::int64_t{c.head_chunks}}, {"tie", std::int64_t{0}},
                                                    {"logits", c.head_logits}}});
  } else if (c.kind == "llama") {
    llama_layers(c, spec);
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

void Model::build_layers(const std::string& file) {
  Shape shape = input_shape(1);
  std::vector<Shape> outputs;  // each layer's, batch 1
  std::map<std::string, int> stashed;  // name -> skip index
  const int n = static_cast<int>(spec_.layers.size());
  for (int i = 0; i < n; ++i) {
    const LayerSpec& l = spec_.layers[static_cast<std::size_t>(i)];
    const std::string where = cat(file, ", layer ", i, " (", l.kind, ")");
    Shape skip;
    int joins = -1;
    const auto from = l.options.find("from");
    if ((l.kind == "concat" || l.kind == "add") && from != l.options.end() && std::holds_alternative<std::string>(from->second)) {
      const std::string& name = std::get<std::string>(from->second);
      MPIPE_REQUIRE(!name.empty(), "give the name an earlier layer stashes, e.g. from = \"down1\"", where, ": 'from' is empty");
      const auto it = stashed.find(name);
      if (it == stashed.end()) {
        int later = -1;
        for (int j = i; j < n && later < 0; ++j)
          if (spec_.layers[static_cast<std::size_t>(j)].stash == name) later = j;
        MPIPE_REQUIRE(later < 0, "a skip goes forward: take it in a layer after the one that stashes it", where,
                      ": 'from': '", name, "' is stashed by layer ", later, ", not an earlier layer");
        throw UserError(cat(where, ": 'from': no layer stashes '", name, "'"),
                        cat("stash it first: stash = \"", name, "\" on an earlier layer"));
      }
      Skip& taken = skips_[static_cast<std::size_t>(it->second)];
      MPIPE_REQUIRE(taken.consumer < 0, "stash a second name for a second join", where, ": 'from': '", name,
                    "' is taken already by layer ", taken.consumer);
      joins = it->second;
      skip = outputs[static_cast<std::size_t>(taken.producer)];
    }
    layers_.push_back(make_layer(spec_, i, shape, where, skip));
    if (joins >= 0) {
      static_cast<SkipJoin&>(*layers_.back()).set_skip(joins);
      skips_[static_cast<std::size_t>(joins)].consumer = i;
    }
    shape = layers_.back()->output_shape(shape);
    outputs.push_back(shape);
    if (!l.stash.empty()) {
      MPIPE_REQUIRE(!stashed.count(l.stash), "give each stash its own name", where, ": 'stash': '", l.stash,
                    "' is stashed already by layer ", skips_[static_cast<std::size_t>(stashed[l.stash])].producer);
      MPIPE_REQUIRE(i + 1 < n, "stash the output of a layer before the loss", where, ": the loss cannot stash its output");
      stashed[l.stash] = static_cast<int>(skips_.size());
      skips_.push_back({l.stash, i, -1});
    }
  }
  for (const Skip& s : skips_)
    MPIPE_REQUIRE(s.consumer >= 0, cat("take it with a later concat or add of from = \"", s.name, "\", or drop the stash"), file, ", layer ",
                  s.producer, ": '", s.name, "' is stashed but no layer takes it");
  loss_input_ = n > 0 ? (n > 1 ? outputs[static_cast<std::size_t>(n) - 2] : input_shape(1)) : Shape{};
}

Model::Model(const ModelConfig& config, ModelSpec list) : config_(config), spec_(std::move(list)) {
  const std::string file = is_preset(spec_.name) ? cat("--model ", spec_.name) : cat("model file '", spec_.name, "'");
  build_layers(file);
  check_loss_input(file);
  mark_in_place(layers_);
  // A stashed output lives on for its join: the layer after its producer keeps its own.
  for (const Skip& s : skips_)
    if (s.producer + 1 < size()) layers_[static_cast<std::size_t>(s.producer) + 1]->allow_in_place(false);
  fusions_ = mark_fusions(layers_);
  for (const auto& layer : layers_) fusions_ += layer->fusions();
  for (int i = 0; i < size(); ++i) {
    layers_[i]->set_global_index(i);
    for (const ParamSpec& spec : layers_[i]->param_specs())
      if (spec.tied_layer >= 0) {
        const bool whole = spec.tied_rows_end < 0;
        ties_.push_back({spec.tied_layer, spec.tied_name, i, whole ? 0 : spec.tied_rows_begin,
                         whole ? spec.shape[0] : spec.tied_rows_end, whole});
      }
  }
}

std::vector<const Model::Tie*> Model::ties_of(int layer, const std::string& name) const {
  std::vector<const Tie*> out;
  for (const Tie& tie : ties_)
    if (tie.owner_layer == layer && tie.name == name) out.push_back(&tie);
  return out;
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
  if (loss_input_.rank == 4) return Shape{batch, loss_input_[2], loss_input_[3]};  // a label per pixel
  return Shape{batch};
}

int64_t Model::parameter_count() const {
  int64_t n = 0;
  for (const auto& layer : layers_)
    for (const ParamSpec& spec : layer->param_specs())
      if (spec.tied_layer < 0) n += spec.shape.numel();  // a tied copy is the owner's
  return n;
}

int64_t Model::rows_per_sample() const {
  if (spec_.tokens > 0) return spec_.tokens;
  return loss_input_.rank == 4 ? loss_input_[2] * loss_input_[3] : 1;
}

void Model::check_loss_input(const std::string& file) const {
  const Shape in = loss_input_;
  const bool ok = spec_.tokens > 0 ? (in.rank == 3 && in[1] == spec_.tokens) : (in.rank == 2 || in.rank == 4);
  MPIPE_REQUIRE(ok, spec_.tokens > 0 ? "keep the (batch, tokens, channels) shape up to the loss" : "end with a linear layer of out = classes on (batch, features), or a convolution of out = classes for a label per pixel",
                file, ": the loss gets ", in.str(), "; a model of ", spec_.tokens > 0 ? "tokens needs (batch, tokens, classes)" : "inputs needs (batch, classes) or (batch, classes, height, width)",
                " there");
  if (spec_.tokens > 0) {  // the targets are tokens, and so are the inputs
    const auto vocab = std::get<std::int64_t>(spec_.layers.front().options.at("vocab"));
    MPIPE_REQUIRE(vocab >= classes(), "give the embedding a vocab of at least the loss's classes", file,
                  ": the embedding takes ", vocab, " tokens, the loss predicts ", classes());
  }
}

int64_t Model::classes() const {
  // After a head split over the vocabulary the loss gets statistics, not logits.
  if (size() > 1 && spec_.layers[static_cast<std::size_t>(size()) - 2].kind == "vocab-chunk")
    return std::get<std::int64_t>(spec_.layers[static_cast<std::size_t>(size()) - 2].options.at("vocab"));
  return loss_input_.rank == 4 ? loss_input_[1] : loss_input_[-1];
}

std::vector<Shape> Model::shapes(int64_t batch) const {
  std::vector<Shape> out{input_shape(batch)};
  for (const auto& layer : layers_) out.push_back(layer->output_shape(out.back()));
  return out;
}

bool keeps_dy_in_output(const Model& model, int layer, int stage_end) {
  return model.layer(layer).keeps_dy() && layer + 1 < stage_end &&
         !model.layer(layer + 1).defers_weight();
}

bool gradient_in_place(const Model& model, int layer, int stage_begin, const Shape& in) {
  if (layer <= stage_begin || !model.layer(layer).gradient_over_input(in) ||
      model.layer(layer - 1).reads_output_in_backward())
    return false;
  for (const Model::Skip& skip : model.skips())
    if (skip.producer == layer - 1) return false;
  return true;
}

WeightsInBackward weights_in_backward(const Model& model, int begin, int stage_end) {
  if (stage_end != model.size()) return {stage_end, 0.0};
  // FLOPs for one sample: the ratio does not change with the micro-batch.
  const std::vector<Shape> shapes = model.shapes(1);
  double backward = 0;
  for (int i = begin; i < stage_end; ++i) backward += model.layer(i).cost(shapes[static_cast<std::size_t>(i)]).backward_flops;
  int from = stage_end;
  double moved = 0;  // W's FLOPs moved into B so far
  while (from > begin) {
    const Layer& layer = model.layer(from - 1);
    const double weight = layer.cost(shapes[static_cast<std::size_t>(from - 1)]).weight_flops;
    if (layer.defers_weight() && !(layer.keeps_dy() && 8 * (moved + weight) <= backward)) break;
    moved += layer.defers_weight() ? weight : 0.0;
    --from;
  }
  return {from, backward > 0 ? moved / backward : 0.0};
}

}  // namespace mpipe
