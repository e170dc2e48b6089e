// The layer registry (the families' kinds, their options checked, layers built) and
// model files.
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
#include "mpipe/nn/dense_layers.hpp"
#include "mpipe/nn/residual.hpp"
#include "mpipe/nn/skip_layers.hpp"
#include "mpipe/nn/transformer_layers.hpp"
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

}  // namespace

const std::vector<LayerKind>& layer_kinds() {
  // The families in the order `plan --layer-kinds` lists them; each keeps its kinds'
  // entries beside their classes.
  static const std::vector<LayerKind> kinds = [] {
    std::vector<LayerKind> all;
    for (auto family : {transformer_layer_kinds, dense_layer_kinds, conv_layer_kinds, residual_layer_kinds,
                        skip_layer_kinds, vocab_layer_kinds})
      for (LayerKind& kind : family()) all.push_back(std::move(kind));
    return all;
  }();
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

double LayerArgs::deviation(const std::string& name, bool automatic) const {
  const double v = number(name);
  if (automatic && v == -1.0) return v;
  if (v < 0) refuse(name, cat("must be a standard deviation, at least 0", automatic ? " (or -1: the default rule)" : "",
                              ", got ", v), automatic ? cat("e.g. ", name, " = -1 or 0.02") : cat("e.g. ", name, " = 0.02"));
  return v;
}

float norm_eps(const LayerArgs& a) {
  const double eps = a.number("eps");
  if (!(eps > 0 && eps <= 0.1)) a.refuse("eps", cat("must be in (0, 0.1], got ", eps), "e.g. eps = 1e-5 (Llama 3) or 1e-6 (Llama 2)");
  return static_cast<float>(eps);
}

bool LayerArgs::boolean(const std::string& name) const { return std::get<bool>(spec.options.at(name)); }

const std::string& LayerArgs::text(const std::string& name) const { return std::get<std::string>(spec.options.at(name)); }

std::int64_t LayerArgs::channels() const {
  if (input.rank < 2) refuse("kind", cat("needs an input of (batch, …, channels), gets ", input.str()), "put it after a layer that makes channels");
  return input[-1];
}

Window2d LayerArgs::image_window(std::int64_t kernel, std::int64_t stride, std::int64_t padding) const {
  if (input.rank != 4)
    refuse("kind", cat("needs images (batch, channels, height, width), gets ", input.str()), "give the model input = [C, H, W]");
  Window2d w;
  w.N = input[0];
  w.C = input[1];
  w.H = input[2];
  w.W = input[3];
  w.KH = w.KW = kernel;
  w.stride = stride;
  w.padding = padding;
  if (w.H + 2 * padding < kernel || w.W + 2 * padding < kernel)
    refuse("kernel", cat(kernel, " is larger than the ", w.H, " x ", w.W, " plane (padding ", padding, ")"), "use a smaller kernel or more padding");
  w.OH = (w.H + 2 * padding - kernel) / stride + 1;
  w.OW = (w.W + 2 * padding - kernel) / stride + 1;
  return w;
}

int LayerArgs::tied_table(std::int64_t rows, std::int64_t width, const char* what) const {
  const auto tie = std::get<std::int64_t>(spec.options.at("tie"));
  if (tie == -1) return -1;
  if (tie < 0) refuse("tie", cat("must be a layer index or -1 (none), got ", tie), "give the embedding's index");
  if (nested) refuse("tie", "cannot tie a layer inside a residual block", "tie the model's head, not a block's layer");
  if (tie >= index || model.layers[static_cast<std::size_t>(tie)].kind != "embedding")
    refuse("tie", cat(tie, " is not an earlier embedding layer"), "give the index of the embedding");
  const LayerSpec& e = model.layers[static_cast<std::size_t>(tie)];
  const auto vocab = std::get<std::int64_t>(e.options.at("vocab")), out = std::get<std::int64_t>(e.options.at("out"));
  if (vocab != rows || out != width)
    refuse("tie", cat("the embedding's table is ", vocab, " x ", out, ", this ", what, " ", rows, " x ", width),
           "tie a layer of out = vocab after channels = the embedding's out");
  return static_cast<int>(tie);
}

std::unique_ptr<Layer> build_layer(const LayerSpec& given, const ModelSpec& model, int index, const Shape& input,
                                   const std::string& where, bool nested, const Shape& skip) {
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
    std::vector<std::string> names;
    for (const LayerKind& k : layer_kinds())
      if (k.nestable) names.push_back(k.name);
    MPIPE_REQUIRE(kind->nestable, cat("inside a residual use ", either(names)), where, ": a ", given.kind,
                  " cannot be inside a residual block");
    return kind->make(LayerArgs{spec, model, index, input, where, true});
  }
  if (kind->takes_tokens != (input.rank == 2 && model.tokens > 0 && index == 0))
    throw UserError(cat(where, ": ", kind->takes_tokens ? "takes token ids, which only the first layer of a model of tokens gets"
                                                        : "cannot take token ids: a model of tokens starts with an embedding"),
                    "begin a model of 'tokens = T' with an embedding, one of 'input = [...]' without");
  const bool last = index + 1 == static_cast<int>(model.layers.size());
  MPIPE_REQUIRE((kind->name == "cross_entropy") == last, "end the model with one cross_entropy layer", where,
                last ? ": the last layer must be the loss (cross_entropy)" : ": the loss (cross_entropy) must be the last layer");
  return kind->make(LayerArgs{spec, model, index, input, where, false, skip});
}

std::unique_ptr<Layer> make_layer(const ModelSpec& model, int index, const Shape& input, const std::string& where,
                                  const Shape& skip) {
  return build_layer(model.layers[static_cast<std::size_t>(index)], model, index, input, where, false, skip);
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
    if (!l.stash.empty()) o += cat("stash = ", toml_quoted(l.stash), "\n");
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
    } else if (option == "stash") {
      const auto* name = v.as_string();
      MPIPE_REQUIRE(name && !name->get().empty() && name->get().size() <= 64, "e.g. stash = \"down1\"", where,
                    ": 'stash' must be a name of 1 to 64 characters");
      MPIPE_REQUIRE(depth == 0, "stash the block's output: put stash on the residual layer itself", where,
                    ": a layer inside a residual block cannot stash its output");
      l.stash = name->get();
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
  // Named here, before the file's other checks (a one-layer file would otherwise hear
  // only that it has too few layers).
  MPIPE_REQUIRE(find_layer_kind(l.kind), cat("the kinds are ", kind_names()), where, ": unknown layer kind '", l.kind, "'");
  return {l, repeat};
}

}  // namespace

namespace {
ModelSpec parse_model_table(const toml::table& table, const std::string& path);
}  // namespace

ModelSpec parse_model_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
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
  return parse_model_table(table, path);
}

ModelSpec parse_model_text(const std::string& text, const std::string& name) {
  toml::table table;
  try {
    table = toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    throw UserError(cat("model file '", name, "' line ", e.source().begin.line, ", column ", e.source().begin.column, ": ",
                        printable_line(std::string(e.description()))),
                    "check the TOML syntax");
  }
  return parse_model_table(table, name);
}

namespace {
ModelSpec parse_model_table(const toml::table& table, const std::string& path) {
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
}  // namespace

}  // namespace mpipe
