// The layer registry (every kind, its options and how it is built) and model files.
#include "mpipe/nn/registry.hpp"

#include <cmath>
#include <functional>
#include <filesystem>

#define TOML_HEADER_ONLY 1
#define TOML_EXCEPTIONS 1
#include <toml++/toml.h>

#include "mpipe/core/error.hpp"
#include "mpipe/core/toml_text.hpp"
#include "mpipe/nn/conv_layers.hpp"
#include "mpipe/nn/vocab_layers.hpp"

namespace mpipe {

namespace {

constexpr std::int64_t max_size = std::int64_t{1} << 31;  // any one size of a layer
constexpr int max_layers = 100000;                         // as --layers

const char* type_name(OptionType t) {
  switch (t) {
    case OptionType::integer: return "an integer";
    case OptionType::number: return "a number";
    case OptionType::boolean: return "true or false";
    case OptionType::text: return "a string";
  }
  return "?";
}

// The value as the option's type wants it (an integer is also a number), or nothing.
std::optional<OptionValue> as_type(const OptionValue& v, OptionType t) {
  switch (t) {
    case OptionType::integer:
      if (const auto* i = std::get_if<std::int64_t>(&v)) return *i;
      return std::nullopt;
    case OptionType::number:
      if (const auto* d = std::get_if<double>(&v)) return *d;
      if (const auto* i = std::get_if<std::int64_t>(&v)) return static_cast<double>(*i);
      return std::nullopt;
    case OptionType::boolean:
      if (const auto* b = std::get_if<bool>(&v)) return *b;
      return std::nullopt;
    case OptionType::text:
      if (const auto* s = std::get_if<std::string>(&v)) return *s;
      return std::nullopt;
  }
  return std::nullopt;
}

std::string option_names(const LayerKind& kind) {
  if (kind.options.empty()) return cat(kind.name, " takes no options");
  std::string s = cat(kind.name, " takes");
  for (std::size_t i = 0; i < kind.options.size(); ++i) s += cat(i ? ", " : " ", kind.options[i].name);
  return s;
}

std::string kind_names() {
  std::string s;
  for (const LayerKind& k : layer_kinds()) s += cat(s.empty() ? "" : ", ", k.name);
  return s;
}

// The channels of a (.., C) input.
std::int64_t channels(const LayerArgs& a) {
  if (a.input.rank < 2) a.refuse("kind", cat("needs an input of (batch, …, channels), gets ", a.input.str()), "put it after a layer that makes channels");
  return a.input[-1];
}

// What the attention layers take: a (B, T, C) input, heads dividing C, the weights'
// init-std and proj-std (-1: GPT-2's init-std / sqrt(2 N), N the model's blocks).
struct Attention {
  std::int64_t channels, heads;
  float init_std, proj_std;
};
Attention attention_args(const LayerArgs& a) {
  if (a.input.rank != 3)
    a.refuse("kind", cat("needs a sequence (batch, tokens, channels), gets ", a.input.str()), "put it after an embedding");
  const std::int64_t c = a.input[-1], heads = a.integer("heads");
  if (c % heads != 0) a.refuse("heads", cat(heads, " does not divide the ", c, " channels coming in"), "pick heads dividing the channels");
  int blocks = 0;
  for (const LayerSpec& l : a.model.layers) blocks += l.kind == "block" ? 1 : 0;
  const double init = a.number("init-std"), proj = a.number("proj-std");
  return {c, heads, static_cast<float>(init), static_cast<float>(proj < 0 ? init / std::sqrt(2.0 * std::max(blocks, 1)) : proj)};
}

// The window of a layer over an (N, C, H, W) input; refuses other inputs and windows
// larger than the padded plane.
Window2d image_window(const LayerArgs& a, std::int64_t kernel, std::int64_t stride, std::int64_t padding) {
  if (a.input.rank != 4)
    a.refuse("kind", cat("needs images (batch, channels, height, width), gets ", a.input.str()), "give the model input = [C, H, W]");
  Window2d w;
  w.N = a.input[0];
  w.C = a.input[1];
  w.H = a.input[2];
  w.W = a.input[3];
  w.KH = w.KW = kernel;
  w.stride = stride;
  w.padding = padding;
  if (w.H + 2 * padding < kernel || w.W + 2 * padding < kernel)
    a.refuse("kernel", cat(kernel, " is larger than the ", w.H, " x ", w.W, " plane (padding ", padding, ")"), "use a smaller kernel or more padding");
  w.OH = (w.H + 2 * padding - kernel) / stride + 1;
  w.OW = (w.W + 2 * padding - kernel) / stride + 1;
  return w;
}

// The layer's `tie` option: -1 (none), or the index of an earlier embedding whose token
// table is `rows` x `width`, the shape of the weight (`what`: "weight", "head's") tied to it.
int tied_table(const LayerArgs& a, std::int64_t rows, std::int64_t width, const char* what) {
  const auto tie = std::get<std::int64_t>(a.spec.options.at("tie"));
  if (tie == -1) return -1;
  if (tie < 0) a.refuse("tie", cat("must be a layer index or -1 (none), got ", tie), "give the embedding's index");
  if (a.nested) a.refuse("tie", "cannot tie a layer inside a residual block", "tie the model's head, not a block's layer");
  if (tie >= a.index || a.model.layers[static_cast<std::size_t>(tie)].kind != "embedding")
    a.refuse("tie", cat(tie, " is not an earlier embedding layer"), "give the index of the embedding");
  const LayerSpec& e = a.model.layers[static_cast<std::size_t>(tie)];
  const auto vocab = std::get<std::int64_t>(e.options.at("vocab")), out = std::get<std::int64_t>(e.options.at("out"));
  if (vocab != rows || out != width)
    a.refuse("tie", cat("the embedding's table is ", vocab, " x ", out, ", this ", what, " ", rows, " x ", width),
             "tie a layer of out = vocab after channels = the embedding's out");
  return static_cast<int>(tie);
}

std::unique_ptr<Layer> build(const LayerSpec& given, const ModelSpec& model, int index, const Shape& input,
                             const std::string& where, bool nested);
std::vector<std::unique_ptr<Layer>> projection(const LayerArgs& a, const Shape& in, const Shape& out);

std::vector<LayerKind> make_kinds() {
  using T = OptionType;
  const OptionSpec init_std{"init-std", T::number, 0.02, "std of the normal initial weights"};
  std::vector<LayerKind> k;
  k.push_back({"embedding", "token + learned position embedding, then dropout: tokens (B, T) -> (B, T, out)",
               {{"vocab", T::integer, std::nullopt, "tokens in the vocabulary"},
                {"out", T::integer, std::nullopt, "channels"},
                {"dropout", T::number, 0.0, "dropout probability after the embedding"}},
               true,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 if (a.input.rank != 2) a.refuse("kind", cat("takes token ids (batch, tokens), gets ", a.input.str()), "put it first, in a model of tokens");
                 return std::make_unique<Embedding>(a.integer("vocab"), a.input[1], a.integer("out"),
                                                    static_cast<float>(a.number("dropout")));
               }});
  k.push_back({"block", "transformer block (pre-LN attention and MLP, residual): (B, T, C) -> (B, T, C)",
               {{"heads", T::integer, std::nullopt, "attention heads (dividing C)"},
                {"dropout", T::number, 0.0, "dropout probability"},
                init_std,
                {"proj-std", T::number, -1.0, "std of the residual projections; -1: init-std / sqrt(2 x blocks), as GPT-2"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const Attention t = attention_args(a);
                 return std::make_unique<TransformerBlock>(t.channels, t.heads, static_cast<float>(a.number("dropout")),
                                                           t.init_std, t.proj_std);
               }});
  k.push_back({"attention", "causal multi-head self-attention with its input and output projections: (B, T, C) -> (B, T, C)",
               {{"heads", T::integer, std::nullopt, "attention heads (dividing C)"},
                init_std,
                {"proj-std", T::number, -1.0, "std of the output projection; -1: init-std / sqrt(2 x blocks), as GPT-2"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const Attention t = attention_args(a);
                 return std::make_unique<CausalSelfAttention>(t.channels, t.heads, t.init_std, t.proj_std);
               }});
  k.push_back({"layernorm", "layer normalisation over the channels", {}, false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> { return std::make_unique<LayerNorm>(channels(a)); }});
  k.push_back({"linear", "y = x W^T + b over the last dimension: (.., in) -> (.., out)",
               {{"out", T::integer, std::nullopt, "output features"},
                {"bias", T::boolean, true, "add a learned bias"},
                init_std,
                {"tie", T::integer, std::int64_t{-1}, "index of an earlier embedding whose token table is this weight"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const std::int64_t in = channels(a), out = a.integer("out");
                 auto layer = std::make_unique<Linear>(in, out, a.boolean("bias"), static_cast<float>(a.number("init-std")));
                 const int tie = tied_table(a, out, in, "weight");
                 if (tie >= 0) layer->tie_weight(tie, "wte");
                 return layer;
               }});
  k.push_back({"relu", "max(x, 0)", {}, false, [](const LayerArgs&) -> std::unique_ptr<Layer> { return std::make_unique<ReLU>(); }});
  k.push_back({"gelu", "GELU (tanh approximation)", {}, false,
               [](const LayerArgs&) -> std::unique_ptr<Layer> { return std::make_unique<GELU>(); }});
  k.push_back({"dropout", "inverted dropout (masks from a counter-based generator, recomputed in backward)",
               {{"p", T::number, std::nullopt, "probability of dropping an element, in [0, 1)"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const double p = a.number("p");
                 if (!(p >= 0 && p < 1)) a.refuse("p", cat("must be in [0, 1), got ", p), "e.g. p = 0.1");
                 return std::make_unique<Dropout>(static_cast<float>(p), 0);
               }});
  // Convolutional layers (NCHW): CPU kernels only so far.
  k.push_back({"conv2d", "2-D convolution: (N, C, H, W) -> (N, out, OH, OW), OH = (H + 2 padding - kernel) / stride + 1",
               {{"out", T::integer, std::nullopt, "output channels"},
                {"kernel", T::integer, std::nullopt, "kernel side"},
                {"stride", T::integer, std::int64_t{1}, "stride"},
                {"padding", T::integer, std::int64_t{0}, "zero padding on each side"},
                {"groups", T::integer, std::int64_t{1}, "groups (dividing C and out)"},
                {"bias", T::boolean, true, "add a learned bias"},
                {"init-std", T::number, -1.0, "std of the normal initial weights; -1: sqrt(2 / fan-in) (He)"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const Window2d w = image_window(a, a.integer("kernel"), a.integer("stride"), a.integer("padding", 0));
                 const std::int64_t out = a.integer("out"), groups = a.integer("groups");
                 if (w.C % groups != 0 || out % groups != 0)
                   a.refuse("groups", cat(groups, " does not divide the ", w.C, " channels in and ", out, " out"), "pick groups dividing both");
                 const double fan_in = static_cast<double>(w.C / groups * w.KH * w.KW), given = a.number("init-std");
                 return std::make_unique<Conv2d>(w.C, out, w.KH, w.stride, w.padding, groups, a.boolean("bias"),
                                                 static_cast<float>(given < 0 ? std::sqrt(2.0 / fan_in) : given));
               },
               false});
  for (const bool max : {true, false})
    k.push_back({max ? "maxpool2d" : "avgpool2d",
                 max ? "max over kernel x kernel windows of each plane (padding counts as -inf)"
                     : "mean over kernel x kernel windows of each plane (padding counts as zeros)",
                 {{"kernel", T::integer, std::nullopt, "window side"},
                  {"stride", T::integer, std::int64_t{0}, "stride; 0: the kernel"},
                  {"padding", T::integer, std::int64_t{0}, "padding on each side, at most kernel / 2"}},
                 false,
                 [max](const LayerArgs& a) -> std::unique_ptr<Layer> {
                   const std::int64_t kernel = a.integer("kernel"), stride = a.integer("stride", 0);
                   const Window2d w = image_window(a, kernel, stride ? stride : kernel, a.integer("padding", 0));
                   if (2 * w.padding > kernel) a.refuse("padding", cat(w.padding, " is more than half the kernel ", kernel), "pad at most kernel / 2");
                   return std::make_unique<Pool2d>(max ? Pool2d::Op::max : Pool2d::Op::average, kernel, w.stride, w.padding);
                 },
                 false});
  k.push_back({"global-avgpool", "mean of each plane: (N, C, H, W) -> (N, C)", {}, false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 image_window(a, 1, 1, 0);
                 return std::make_unique<Pool2d>(Pool2d::Op::global_average, 0, 1, 0);
               },
               false});
  k.push_back({"batchnorm2d",
               "BatchNorm over the channels of (N, C, H, W): each micro-batch normalised with its own statistics in "
               "training (GPipe's rule), the running statistics in evaluation",
               {{"eps", T::number, 1e-5, "added to the variance"},
                {"momentum", T::number, 0.1, "how far the running statistics move toward each micro-batch's"},
                {"zero-init", T::boolean, false,
                 "start the scale (weight) at 0, not 1: as a residual block's last layer, the block starts as its skip path"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const Window2d w = image_window(a, 1, 1, 0);
                 const double eps = a.number("eps"), momentum = a.number("momentum");
                 if (!(eps > 0)) a.refuse("eps", cat("must be positive, got ", eps), "e.g. eps = 1e-5");
                 if (!(momentum >= 0 && momentum <= 1)) a.refuse("momentum", cat("must be in [0, 1], got ", momentum), "e.g. momentum = 0.1");
                 return std::make_unique<BatchNorm2d>(w.C, static_cast<float>(eps), static_cast<float>(momentum), a.boolean("zero-init"));
               },
               false});
  k.push_back({"flatten", "(N, d1, d2, ...) -> (N, d1 x d2 x ...)", {}, false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 if (a.input.rank < 2) a.refuse("kind", cat("needs (batch, ...), gets ", a.input.str()), "put it after a layer with features");
                 return std::make_unique<Flatten>();
               },
               false});
  k.push_back({"residual",
               "y = inner(x) + skip(x): the block's [[layer.layer]] tables, and the identity, or a bias-free 1x1 "
               "convolution (images) or linear map where they change the shape",
               {{"skip", T::text, std::string("auto"), "auto (identity unless the shape changes), identity or projection"},
                {"skip-norm", T::boolean, false, "a batchnorm2d after the projection convolution (ResNet's downsample)"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 if (a.nested) a.refuse("kind", "cannot be inside another residual block", "put the blocks one after another");
                 if (a.spec.children.empty()) a.refuse("kind", "has no inner layers", "give its layers as [[layer.layer]] tables");
                 std::vector<std::unique_ptr<Layer>> inner;
                 Shape s = a.input;
                 for (std::size_t j = 0; j < a.spec.children.size(); ++j) {
                   const LayerSpec& child = a.spec.children[j];
                   inner.push_back(build(child, a.model, a.index, s, cat(a.where, ", inner layer ", j, " (", child.kind, ")"), true));
                   s = inner.back()->output_shape(s);
                 }
                 auto skip = projection(a, a.input, s);
                 return std::make_unique<Residual>(std::move(inner), std::move(skip));
               },
               false});
  k.push_back({"vocab-chunk",
               "chunk c of n of a language-model head split over the vocabulary (an online softmax carried from "
               "chunk to chunk, so a pipeline can spread the head over stages): (.., C) or the previous chunk's "
               "(.., C + 4) -> (.., C + 4); the loss follows the last chunk",
               {{"vocab", T::integer, std::nullopt, "tokens in the whole vocabulary"},
                {"chunk", T::integer, std::nullopt, "which chunk, from 0; chunk c covers [c vocab / n, (c + 1) vocab / n)"},
                {"chunks", T::integer, std::nullopt, "chunks the vocabulary is split into"},
                init_std,
                {"tie", T::integer, std::int64_t{-1}, "index of an earlier embedding whose token table's rows this weight is"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const std::int64_t vocab = a.integer("vocab"), chunks = a.integer("chunks"), chunk = a.integer("chunk", 0);
                 if (chunks > vocab) a.refuse("chunks", cat(chunks, " is more than the ", vocab, " tokens"), "give at most vocab chunks");
                 if (chunk >= chunks) a.refuse("chunk", cat(chunk, " is not below chunks = ", chunks), "number the chunks from 0");
                 // The chunks come in order, one after another, then the loss.
                 const LayerSpec* before = a.index > 0 ? &a.model.layers[static_cast<std::size_t>(a.index - 1)] : nullptr;
                 const bool follows = before && before->kind == "vocab-chunk" &&
                                      std::get<std::int64_t>(before->options.at("vocab")) == vocab &&
                                      std::get<std::int64_t>(before->options.at("chunks")) == chunks &&
                                      std::get<std::int64_t>(before->options.at("chunk")) == chunk - 1;
                 if (chunk > 0 && !follows)
                   a.refuse("chunk", cat(chunk, " does not follow chunk ", chunk - 1, " of the same vocab and chunks"), "put the chunks in order, one after another");
                 if (chunk == 0 && before && before->kind == "vocab-chunk")
                   a.refuse("chunk", "0 follows another chunk", "one head's chunks are 0 .. chunks - 1 in order");
                 const std::size_t next = static_cast<std::size_t>(a.index + 1);
                 const bool last = chunk == chunks - 1;
                 if (next < a.model.layers.size() && a.model.layers[next].kind != (last ? "cross_entropy" : "vocab-chunk"))
                   a.refuse("chunk", last ? "the last chunk must be followed by the loss (cross_entropy)" : cat("must be followed by chunk ", chunk + 1),
                            "put the chunks in order, then the loss");
                 if (a.input.rank < 2) a.refuse("kind", cat("needs (batch, …, channels), gets ", a.input.str()), "put it after a layer that makes channels");
                 const std::int64_t C = chunk == 0 ? a.input[-1] : a.input[-1] - 4;
                 const int tie = tied_table(a, vocab, C, "head's");
                 return std::make_unique<VocabChunk>(vocab, chunk, chunks, C, static_cast<float>(a.number("init-std")), tie);
               },
               false});
  k.push_back({"cross_entropy",
               "the loss: softmax cross-entropy of logits (.., classes) against targets, or of the statistics of a "
               "head split over the vocabulary (after its last vocab-chunk); the last layer",
               {}, false, [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const LayerSpec* before = a.index > 0 ? &a.model.layers[static_cast<std::size_t>(a.index - 1)] : nullptr;
                 if (before && before->kind == "vocab-chunk") {
                   const auto chunk = std::get<std::int64_t>(before->options.at("chunk")),
                              chunks = std::get<std::int64_t>(before->options.at("chunks"));
                   if (chunk != chunks - 1) a.refuse("kind", cat("follows chunk ", chunk, " of ", chunks, ", not the last"), "give every chunk of the head");
                   return std::make_unique<VocabLoss>(std::get<std::int64_t>(before->options.at("vocab")), a.input[-1] - 4);
                 }
                 return std::make_unique<CrossEntropyLoss>();
               }});
  return k;
}

}  // namespace

const std::vector<LayerKind>& layer_kinds() {
  static const std::vector<LayerKind> kinds = make_kinds();
  return kinds;
}

const LayerKind* find_layer_kind(const std::string& name) {
  for (const LayerKind& k : layer_kinds())
    if (k.name == name) return &k;
  return nullptr;
}

void LayerArgs::refuse(const std::string& name, const std::string& problem, const std::string& hint) const {
  throw UserError(cat(where, ": ", name == "kind" ? "" : cat("'", name, "': "), problem), hint);
}

std::int64_t LayerArgs::integer(const std::string& name, std::int64_t least) const {
  const auto v = std::get<std::int64_t>(spec.options.at(name));
  if (v < least || v > max_size)
    refuse(name, cat("must be from ", least, " to ", max_size, ", got ", v), least > 0 ? "give a positive size" : "give a size of 0 or more");
  return v;
}

double LayerArgs::number(const std::string& name) const {
  const double v = std::get<double>(spec.options.at(name));
  if (!std::isfinite(v)) refuse(name, cat("must be finite, got ", v), "give a number");
  return v;
}

bool LayerArgs::boolean(const std::string& name) const { return std::get<bool>(spec.options.at(name)); }

namespace {

// Builds `given` with `input` coming in: its options checked by name and type, defaults
// filled, then its kind's builder. `nested`: inside a residual block.
std::unique_ptr<Layer> build(const LayerSpec& given, const ModelSpec& model, int index, const Shape& input,
                             const std::string& where, bool nested) {
  const LayerKind* kind = find_layer_kind(given.kind);
  MPIPE_REQUIRE(kind, cat("the kinds are ", kind_names()), where, ": unknown layer kind '", given.kind, "'");
  MPIPE_REQUIRE(given.children.empty() || given.kind == "residual", "only a residual block holds [[layer.layer]] tables",
                where, ": a ", given.kind, " has inner layers");
  // Every option present and of its type: the builders read them without checking.
  LayerSpec spec{given.kind, {}, given.children};
  for (const auto& [name, value] : given.options) {
    const auto it = std::find_if(kind->options.begin(), kind->options.end(), [&](const OptionSpec& o) { return o.name == name; });
    MPIPE_REQUIRE(it != kind->options.end(), option_names(*kind), where, ": unknown key '", name, "'");
    const auto typed = as_type(value, it->type);
    MPIPE_REQUIRE(typed.has_value(), cat("e.g. ", name, " = ", it->type == OptionType::integer ? "64" : it->type == OptionType::number ? "0.1" : it->type == OptionType::boolean ? "true" : "\"...\""),
                  where, ": '", name, "' must be ", type_name(it->type));
    spec.options[name] = *typed;
  }
  for (const OptionSpec& o : kind->options) {
    if (spec.options.count(o.name)) continue;
    MPIPE_REQUIRE(o.fallback.has_value(), option_names(*kind), where, ": '", o.name, "' is required (", o.help, ")");
    spec.options[o.name] = *as_type(*o.fallback, o.type);
  }
  if (nested) {
    // Each layer of a block shares the block's index, which keys dropout masks and ties.
    static const char* const inside[] = {"conv2d", "batchnorm2d", "relu", "gelu", "maxpool2d", "avgpool2d", "linear",
                                         "layernorm", "attention"};
    MPIPE_REQUIRE(std::find(std::begin(inside), std::end(inside), given.kind) != std::end(inside),
                  "inside a residual use conv2d, batchnorm2d, relu, gelu, maxpool2d, avgpool2d, linear, layernorm or attention", where,
                  ": a ", given.kind, " cannot be inside a residual block");
    return kind->make(LayerArgs{spec, model, index, input, where, true});
  }
  if (kind->takes_tokens != (input.rank == 2 && model.tokens > 0 && index == 0))
    throw UserError(cat(where, ": ", kind->takes_tokens ? "takes token ids, which only the first layer of a model of tokens gets"
                                                        : "cannot take token ids: a model of tokens starts with an embedding"),
                    "begin a model of 'tokens = T' with an embedding, one of 'input = [...]' without");
  const bool last = index + 1 == static_cast<int>(model.layers.size());
  MPIPE_REQUIRE((kind->name == "cross_entropy") == last, "end the model with one cross_entropy layer", where,
                last ? ": the last layer must be the loss (cross_entropy)" : ": the loss (cross_entropy) must be the last layer");
  return kind->make(LayerArgs{spec, model, index, input, where, false});
}

// The skip path of a residual block from `in` to `out`: none (the identity), a 1x1
// convolution with the stride that maps the plane (images), optionally followed by a
// BatchNorm, or a linear map of the channels; bias-free.
std::vector<std::unique_ptr<Layer>> projection(const LayerArgs& a, const Shape& in, const Shape& out) {
  const std::string skip = std::get<std::string>(a.spec.options.at("skip"));
  const bool norm = a.boolean("skip-norm");
  if (skip != "auto" && skip != "identity" && skip != "projection")
    a.refuse("skip", cat("must be auto, identity or projection, got '", skip, "'"), "e.g. skip = \"auto\"");
  std::vector<std::unique_ptr<Layer>> path;
  if (in == out && skip != "projection") {
    if (norm) a.refuse("skip-norm", "is set, but the skip path is the identity", "drop it, or give skip = \"projection\"");
    return path;
  }
  if (skip == "identity")
    a.refuse("skip", cat("is the identity, but the block maps ", in.str(), " to ", out.str()), "use skip = \"auto\" for a projection");
  if (in.rank == 4 && out.rank == 4) {
    for (std::int64_t s = 1; s <= in[2]; ++s)
      if ((in[2] - 1) / s + 1 == out[2] && (in[3] - 1) / s + 1 == out[3]) {
        path.push_back(std::make_unique<Conv2d>(in[1], out[1], 1, s, 0, 1, false,
                                                static_cast<float>(std::sqrt(2.0 / static_cast<double>(in[1])))));
        if (norm) path.push_back(std::make_unique<BatchNorm2d>(out[1], 1e-5f, 0.1f));
        return path;
      }
  } else if (in.rank == out.rank && in.rank >= 2) {
    if (norm) a.refuse("skip-norm", cat("needs images (N, C, H, W); the block maps ", in.str()), "drop it");
    bool same_rows = true;
    for (int d = 0; d + 1 < in.rank; ++d) same_rows = same_rows && in[d] == out[d];
    if (same_rows) {
      path.push_back(std::make_unique<Linear>(in[-1], out[-1], false, 0.02f));
      return path;
    }
  }
  a.refuse("kind", cat("maps ", in.str(), " to ", out.str(), ", which no 1x1 convolution or linear skip path matches"),
           "keep the plane a stride of the input's, and the rank");
}

}  // namespace

std::unique_ptr<Layer> make_layer(const ModelSpec& model, int index, const Shape& input, const std::string& where) {
  return build(model.layers[static_cast<std::size_t>(index)], model, index, input, where, false);
}

// ---- model files -------------------------------------------------------------------------

std::string ModelSpec::to_toml() const {
  std::string o = cat("# mpipe model file (", name, "): read with --model FILE; see 'mpipe plan --layer-kinds'\n");
  if (tokens > 0) {
    o += cat("tokens = ", tokens, "\n");
  } else {
    o += "input = [";
    for (std::size_t i = 0; i < input.size(); ++i) o += cat(i ? ", " : "", input[i]);
    o += "]\n";
  }
  // A layer as a [[table]] under `path` (layer, layer.layer for a block's inner ones).
  const std::function<void(const LayerSpec&, const std::string&)> table = [&](const LayerSpec& l, const std::string& path) {
    o += cat("\n[[", path, "]]\nkind = ", toml_quoted(l.kind), "\n");
    for (const auto& [key, value] : l.options) {
      o += key + " = ";
      std::visit(
          [&](const auto& v) {
            using V = std::decay_t<decltype(v)>;
            if constexpr (std::is_same_v<V, std::int64_t>) o += std::to_string(v);
            else if constexpr (std::is_same_v<V, double>) o += toml_float(v);
            else if constexpr (std::is_same_v<V, bool>) o += v ? "true" : "false";
            else o += toml_quoted(v);
          },
          value);
      o += "\n";
    }
    for (const LayerSpec& child : l.children) table(child, path + ".layer");
  };
  for (const LayerSpec& l : layers) table(l, "layer");
  return o;
}

namespace {

// One [[layer]] table (depth 1: a residual block's [[layer.layer]]); the layer and how
// many times it stands in the list (its `repeat`, default 1: copies with their own
// parameters).
std::pair<LayerSpec, std::int64_t> parse_layer(const toml::table& t, const std::string& where, int depth) {
  LayerSpec l;
  std::int64_t repeat = 1;
  for (const auto& [k, v] : t) {
    const std::string option(k.str());
    if (option == "kind") {
      const auto* s = v.as_string();
      MPIPE_REQUIRE(s, cat("the kinds are ", kind_names()), where, ": 'kind' must be a string");
      l.kind = s->get();
    } else if (option == "repeat") {
      const auto* i = v.as_integer();
      MPIPE_REQUIRE(i && i->get() >= 1 && i->get() <= max_layers, "e.g. repeat = 3", where, ": 'repeat' must be an integer from 1 to ",
                    max_layers);
      repeat = i->get();
    } else if (option == "layer") {
      const auto* list = v.as_array();
      MPIPE_REQUIRE(list && list->is_array_of_tables() && depth == 0, "a residual block holds its layers as [[layer.layer]] tables",
                    where, ": 'layer' must be [[layer.layer]] tables of a top-level layer");
      for (const auto& node : *list) {
        const auto [child, times] = parse_layer(*node.as_table(), cat(where, ", inner layer ", l.children.size()), depth + 1);
        for (std::int64_t r = 0; r < times; ++r) l.children.push_back(child);
      }
    } else if (const auto* i = v.as_integer()) {
      l.options[option] = i->get();
    } else if (const auto* f = v.as_floating_point()) {
      l.options[option] = f->get();
    } else if (const auto* b = v.as_boolean()) {
      l.options[option] = b->get();
    } else if (const auto* s = v.as_string()) {
      l.options[option] = s->get();
    } else {
      throw UserError(cat(where, ": '", option, "' must be a number, true/false or a string"),
                      "see 'mpipe plan --layer-kinds' for each kind's keys");
    }
  }
  MPIPE_REQUIRE(!l.kind.empty(), cat("the kinds are ", kind_names()), where, ": no 'kind'");
  return {l, repeat};
}

}  // namespace

ModelSpec parse_model_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string hint = "see 'mpipe plan --model gpt --print-model' for an example";
  MPIPE_REQUIRE(fs::exists(path, ec), "give the path of a TOML model file, or --model gpt or mlp", "model file '", path, "' does not exist");
  MPIPE_REQUIRE(fs::is_regular_file(path, ec), "give the path of a TOML model file", "model file '", path, "' is not a regular file");
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw UserError(cat("model file '", path, "' line ", e.source().begin.line, ", column ", e.source().begin.column, ": ",
                        printable_line(std::string(e.description()))),
                    "check the TOML syntax");
  }
  ModelSpec spec;
  spec.name = path;
  const std::string file = cat("model file '", path, "'");
  for (const auto& [key, value] : table) {
    const std::string name(key.str());
    const std::string at = cat(file, " line ", key.source().begin.line);
    if (name == "tokens") {
      const auto* t = value.as_integer();
      MPIPE_REQUIRE(t && t->get() > 0 && t->get() <= max_size, "e.g. tokens = 1024", at, ": 'tokens' must be a positive integer");
      spec.tokens = t->get();
    } else if (name == "input") {
      const auto* list = value.as_array();
      MPIPE_REQUIRE(list && !list->empty() && list->size() <= 3, "e.g. input = [64] or [3, 32, 32]", at,
                    ": 'input' must be a list of 1 to 3 sizes");
      for (const auto& d : *list) {
        const auto* i = d.as_integer();
        MPIPE_REQUIRE(i && i->get() > 0 && i->get() <= max_size, "e.g. input = [64]", at, ": 'input' sizes must be positive integers");
        spec.input.push_back(i->get());
      }
    } else if (name == "layer") {
      const auto* list = value.as_array();
      MPIPE_REQUIRE(list && list->is_array_of_tables(), "write each layer as a [[layer]] table", at, ": 'layer' must be [[layer]] tables");
      MPIPE_REQUIRE(list->size() <= static_cast<std::size_t>(max_layers), cat("give at most ", max_layers), at, ": ", list->size(), " layers");
      for (const auto& node : *list) {
        const std::string where = cat(file, ", layer ", spec.layers.size(), " (line ", node.source().begin.line, ")");
        const auto [layer, repeat] = parse_layer(*node.as_table(), where, 0);
        for (std::int64_t r = 0; r < repeat; ++r) spec.layers.push_back(layer);
        MPIPE_REQUIRE(spec.layers.size() <= static_cast<std::size_t>(max_layers), cat("give at most ", max_layers), where,
                      ": more than ", max_layers, " layers");
      }
    } else {
      throw UserError(cat(at, ": unknown key '", name, "'"), "a model file has tokens or input, and [[layer]] tables");
    }
  }
  MPIPE_REQUIRE((spec.tokens > 0) != !spec.input.empty(), "give tokens = T (a sequence model) or input = [sizes], not both",
                file, spec.tokens > 0 ? " has both 'tokens' and 'input'" : " has neither 'tokens' nor 'input'");
  MPIPE_REQUIRE(spec.layers.size() >= 2, "a model needs at least one layer and the loss (cross_entropy)", file, " has ",
                spec.layers.size(), " layers");
  return spec;
}

}  // namespace mpipe
