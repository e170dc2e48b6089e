// The names mpipe's parameters take in other tools' files, one table per model family
// (Hugging Face GPT-2's for the GPT preset, Hugging Face Llama's for the llama preset,
// torchvision's for the ResNet preset, the layer list's own for the rest), and the
// config.json Hugging Face reads beside them.
#include "mpipe/io/weights.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include "mpipe/io/checkpoint_format.hpp"

namespace mpipe {

namespace {

// A layer's option as the layer sees it: given, else its kind's default (none: neither).
std::optional<OptionValue> option(const LayerSpec& l, const std::string& name) {
  if (const auto it = l.options.find(name); it != l.options.end()) return it->second;
  if (const LayerKind* kind = find_layer_kind(l.kind))
    for (const OptionSpec& o : kind->options)
      if (o.name == name) return o.fallback;
  return std::nullopt;
}
std::string text(const LayerSpec& l, const std::string& name) {
  const auto v = option(l, name);
  return v && std::holds_alternative<std::string>(*v) ? std::get<std::string>(*v) : std::string();
}
std::optional<double> number(const LayerSpec& l, const std::string& name) {
  const auto v = option(l, name);
  if (v && std::holds_alternative<std::int64_t>(*v)) return static_cast<double>(std::get<std::int64_t>(*v));
  if (v && std::holds_alternative<double>(*v)) return std::get<double>(*v);
  return std::nullopt;
}
std::int64_t integer(const LayerSpec& l, const std::string& name, std::int64_t otherwise) {
  const auto v = option(l, name);
  return v && std::holds_alternative<std::int64_t>(*v) ? std::get<std::int64_t>(*v) : otherwise;
}
std::optional<bool> flag(const LayerSpec& l, const std::string& name) {
  const auto v = option(l, name);
  return v && std::holds_alternative<bool>(*v) ? std::optional<bool>(std::get<bool>(*v)) : std::nullopt;
}
// Whether option `name` is left at its kind's default (absent, or given as it).
bool at_default(const LayerSpec& l, const std::string& name) {
  const auto given = l.options.find(name);
  if (given == l.options.end()) return true;
  const LayerKind* kind = find_layer_kind(l.kind);
  for (const OptionSpec& o : kind ? kind->options : std::vector<OptionSpec>{})
    if (o.name == name) return o.fallback && *o.fallback == given->second;
  return false;
}

std::vector<std::int64_t> dims_of(const Shape& shape) {
  return std::vector<std::int64_t>(shape.dims.begin(), shape.dims.begin() + shape.rank);
}

// The head's layers [from, loss): one linear of `vocab` outputs without a bias, or
// vocab-chunk layers 0 .. n-1 of it; all tied to layer 0, or (untied allowed) none.
// Returns whether they are; `tied`: whether tied to the token table.
bool lm_head(const std::vector<LayerSpec>& l, std::size_t from, std::int64_t vocab, bool untied_allowed, bool* tied) {
  if (from + 1 >= l.size()) return false;
  const std::size_t count = l.size() - 1 - from;
  *tied = integer(l[from], "tie", -1) == 0;
  for (std::size_t i = from; i + 1 < l.size(); ++i) {
    const std::int64_t tie = integer(l[i], "tie", -1);
    if ((tie == 0) != *tied || (tie != 0 && tie != -1)) return false;
    if (count == 1 && l[i].kind == "linear") {
      if (flag(l[i], "bias").value_or(true) || integer(l[i], "out", 0) != vocab) return false;
    } else if (l[i].kind != "vocab-chunk" || count == 1 || integer(l[i], "vocab", 0) != vocab ||
               integer(l[i], "chunks", 0) != static_cast<std::int64_t>(count) ||
               integer(l[i], "chunk", -1) != static_cast<std::int64_t>(i - from)) {
      return false;
    }
  }
  return *tied || untied_allowed;
}

// The Llama preset's sizes, read from its layer list (LlamaConfig's fields).
struct LlamaSizes {
  int blocks = 0;
  std::int64_t vocab = 0, channels = 0, heads = 0, kv_heads = 0, ffn = 0;
  double rope_theta = 0, eps = 0;
  bool tied = false;
};

std::optional<LlamaSizes> llama_sizes(const Model& model) {
  const std::vector<LayerSpec>& l = model.spec().layers;
  if (l.size() < 5 || l[0].kind != "embedding" || text(l[0], "positions") != "none" || l.back().kind != "cross_entropy")
    return std::nullopt;
  LlamaSizes s;
  s.vocab = integer(l[0], "vocab", 0);
  s.channels = integer(l[0], "out", 0);
  std::size_t at = 1;
  for (; at < l.size() && l[at].kind == "block"; ++at) {
    const LayerSpec& b = l[at];
    if (text(b, "norm") != "rms" || text(b, "mlp") != "swiglu" || text(b, "positions") != "rope" ||
        flag(b, "bias").value_or(true))
      return std::nullopt;
    const std::int64_t heads = integer(b, "heads", 0), kv = integer(b, "kv-heads", 0);
    const LlamaSizes block{.heads = heads, .kv_heads = kv > 0 ? kv : heads, .ffn = integer(b, "ffn", 0),
                           .rope_theta = number(b, "rope-theta").value_or(0), .eps = number(b, "eps").value_or(0)};
    if (at > 1 && (block.heads != s.heads || block.kv_heads != s.kv_heads || block.ffn != s.ffn ||
                   block.rope_theta != s.rope_theta || block.eps != s.eps))
      return std::nullopt;  // Hugging Face's config has one of each
    s.heads = block.heads, s.kv_heads = block.kv_heads, s.ffn = block.ffn, s.rope_theta = block.rope_theta, s.eps = block.eps;
  }
  s.blocks = static_cast<int>(at) - 1;
  if (s.blocks < 1 || at >= l.size() || l[at].kind != "rmsnorm" || number(l[at], "eps") != s.eps || s.heads < 1) return std::nullopt;
  if (!lm_head(l, at + 1, s.vocab, /*untied_allowed=*/true, &s.tied)) return std::nullopt;
  // The MLP's width from its weight, c_fc (2 F, C), where the option leaves it to a rule.
  for (const ParamSpec& p : model.layer(1).param_specs())
    if (p.name == "mlp.c_fc.weight") s.ffn = p.shape[0] / 2;
  return s;
}

}  // namespace

bool gpt2_layout(const Model& model) {
  const std::vector<LayerSpec>& l = model.spec().layers;
  const std::size_t n = l.size();
  if (n < 5 || l[0].kind != "embedding" || !at_default(l[0], "positions") || l.back().kind != "cross_entropy") return false;
  std::size_t at = 1;
  for (; at < n && l[at].kind == "block"; ++at) {
    // GPT-2's block: the block's defaults (LayerNorm, GELU MLP of 4 C, learned positions,
    // biases), every block with the heads of the first (GPT2Config has one n_head).
    const LayerSpec& b = l[at];
    const std::int64_t heads = integer(b, "heads", 0), kv = integer(b, "kv-heads", 0), ffn = integer(b, "ffn", 0);
    for (const char* name : {"norm", "mlp", "positions", "bias"})
      if (!at_default(b, name)) return false;
    if (heads != integer(l[1], "heads", 0) || (kv != 0 && kv != heads) || (ffn != 0 && ffn != 4 * integer(l[0], "out", 0)))
      return false;
  }
  if (at == 1 || at >= n || l[at].kind != "layernorm") return false;
  // The head is the token table (tied, no bias): GPT-2's lm_head.
  bool tied = false;
  return lm_head(l, at + 1, integer(l[0], "vocab", 0), /*untied_allowed=*/false, &tied);
}

bool llama_layout(const Model& model) { return llama_sizes(model).has_value(); }

namespace {

bool is_kinds(const std::vector<LayerSpec>& layers, std::size_t at, std::initializer_list<const char*> kinds) {
  for (const char* kind : kinds)
    if (at >= layers.size() || layers[at++].kind != kind) return false;
  return true;
}

// A residual block as torchvision's BasicBlock or Bottleneck: (conv, BatchNorm, ReLU)
// repeated, then conv, BatchNorm.
bool torchvision_block(const LayerSpec& block) {
  const std::vector<LayerSpec>& c = block.children;
  if (c.size() < 2 || (c.size() + 1) % 3 != 0) return false;
  for (std::size_t j = 0; j < c.size(); ++j)
    if (c[j].kind != (j % 3 == 0 ? "conv2d" : j % 3 == 1 ? "batchnorm2d" : "relu")) return false;
  return true;
}

// Where the resnet preset's blocks begin (after the stem) in its layer list, or 0 when
// the list is not the preset's: stem conv, BatchNorm, ReLU (and max pool), blocks each
// followed by a ReLU, global average pool, linear, loss.
std::size_t torchvision_blocks_from(const Model& model) {
  const std::vector<LayerSpec>& l = model.spec().layers;
  if (!is_kinds(l, 0, {"conv2d", "batchnorm2d", "relu"})) return 0;
  const std::size_t from = l.size() > 3 && l[3].kind == "maxpool2d" ? 4 : 3;
  std::size_t at = from;
  while (at + 1 < l.size() && l[at].kind == "residual" && torchvision_block(l[at]) && l[at + 1].kind == "relu") at += 2;
  return at > from && at + 3 == l.size() && is_kinds(l, at, {"global-avgpool", "linear", "cross_entropy"}) ? from : 0;
}

}  // namespace

bool torchvision_resnet_layout(const Model& model) { return torchvision_blocks_from(model) > 0; }

WeightFamily weight_family(const Model& model) {
  if (torchvision_resnet_layout(model)) return WeightFamily::torchvision;
  if (gpt2_layout(model)) return WeightFamily::gpt2;
  if (llama_layout(model)) return WeightFamily::llama;
  return WeightFamily::layers;
}

const char* family_title(WeightFamily family) {
  switch (family) {
    case WeightFamily::gpt2: return "Hugging Face GPT-2";
    case WeightFamily::llama: return "Hugging Face Llama";
    case WeightFamily::torchvision: return "torchvision ResNet";
    case WeightFamily::layers: break;
  }
  return "mpipe layer";
}

namespace {

// The tables, one per family: layer `layer`'s parameter `name` to its tensors.

std::vector<ExportedName> torchvision_names(const Model& model, std::size_t blocks, int layer, const std::string& name) {
  if (layer == 0) return {{cat("conv1.", name)}};
  if (layer == 1) return {{cat("bn1.", name)}};
  if (layer == model.size() - 2) return {{cat("fc.", name)}};
  // layerS.B: a new stage where a block halves the plane (torchvision's layer1 does not).
  const std::vector<Shape> shapes = model.shapes(1);
  int stage = 0, index = -1;
  for (int i = static_cast<int>(blocks); i <= layer; i += 2) {
    const bool halves = shapes[static_cast<std::size_t>(i) + 1][2] < shapes[static_cast<std::size_t>(i)][2];
    if (stage == 0 || halves) ++stage, index = 0;
    else ++index;
  }
  const std::string block = cat("layer", stage, ".", index, ".");
  if (name.rfind("skip_norm.", 0) == 0) return {{block + "downsample.1." + name.substr(10)}};
  if (name.rfind("skip.", 0) == 0) return {{block + "downsample.0." + name.substr(5)}};
  // The inner layer's: the k-th convolution is conv{k}, the k-th BatchNorm bn{k}.
  const std::size_t dot = name.find('.');
  const int child = std::atoi(name.substr(0, dot).c_str());
  return {{cat(block, child % 3 == 0 ? "conv" : "bn", child / 3 + 1, name.substr(dot))}};
}

int block_count(const Model& model) {
  int blocks = 0;
  while (blocks + 1 < model.size() && model.spec().layers[static_cast<std::size_t>(blocks) + 1].kind == "block") ++blocks;
  return blocks;
}

std::vector<ExportedName> gpt2_names(const Model& model, int layer, const std::string& name) {
  if (layer == 0) return {{cat("transformer.", name, ".weight")}};  // wte, wpe
  if (layer == block_count(model) + 1) return {{cat("transformer.ln_f.", name)}};
  // GPT-2's Conv1D keeps its weight [in, out].
  const bool conv1d = name == "attn.c_attn.weight" || name == "attn.c_proj.weight" || name == "mlp.c_fc.weight" ||
                      name == "mlp.c_proj.weight";
  return {{cat("transformer.h.", layer - 1, ".", name), conv1d}};
}

// LlamaForCausalLM's names. c_attn's rows are q (H hs), k (KVH hs), v (KVH hs); c_fc's
// gate (F), up (F). RoPE is Hugging Face's rotate-half in both: no row permutation.
std::vector<ExportedName> llama_names(const Model& model, const LlamaSizes& s, int layer, const std::string& name) {
  const LayerSpec& l = model.spec().layers[static_cast<std::size_t>(layer)];
  if (layer == 0 && name == "wte") return {{"model.embed_tokens.weight"}};
  if (layer == s.blocks + 1 && name == "weight") return {{"model.norm.weight"}};
  if (layer > s.blocks + 1 && name == "weight")  // the head, or its chunk of the vocabulary's rows
    return {{"lm_head.weight", false, 0, -1, l.kind == "vocab-chunk" ? integer(l, "chunk", 0) * s.vocab / integer(l, "chunks", 1) : 0}};
  const std::string block = cat("model.layers.", layer - 1, ".");
  const std::int64_t head_size = s.channels / s.heads, q = s.heads * head_size, kv = s.kv_heads * head_size;
  if (layer >= 1 && layer <= s.blocks) {
    if (name == "ln_1.weight") return {{block + "input_layernorm.weight"}};
    if (name == "ln_2.weight") return {{block + "post_attention_layernorm.weight"}};
    if (name == "attn.c_attn.weight")
      return {{block + "self_attn.q_proj.weight", false, 0, q},
              {block + "self_attn.k_proj.weight", false, q, q + kv},
              {block + "self_attn.v_proj.weight", false, q + kv, q + 2 * kv}};
    if (name == "attn.c_proj.weight") return {{block + "self_attn.o_proj.weight"}};
    if (name == "mlp.c_fc.weight")
      return {{block + "mlp.gate_proj.weight", false, 0, s.ffn}, {block + "mlp.up_proj.weight", false, s.ffn, 2 * s.ffn}};
    if (name == "mlp.c_proj.weight") return {{block + "mlp.down_proj.weight"}};
  }
  MPIPE_CHECK(false, "no Hugging Face Llama name for layer ", layer, " (", l.kind, ")'s parameter '", name, "'");
  return {};
}

}  // namespace

std::vector<ExportedName> exported_names(const Model& model, int layer, const std::string& name) {
  if (const std::size_t blocks = torchvision_blocks_from(model); blocks > 0) return torchvision_names(model, blocks, layer, name);
  if (gpt2_layout(model)) return gpt2_names(model, layer, name);
  if (const std::optional<LlamaSizes> sizes = llama_sizes(model)) return llama_names(model, *sizes, layer, name);
  return {{cat(layer, ".", name)}};
}

ExportedName exported_name(const Model& model, int layer, const std::string& name) {
  std::vector<ExportedName> names = exported_names(model, layer, name);
  MPIPE_CHECK(names.size() == 1 && names[0].rows_begin == 0 && names[0].rows_end < 0 && names[0].at == 0, "layer ", layer,
              "'s '", name, "' is not one whole tensor");
  return std::move(names[0]);
}

std::vector<ExportedTensor> exported_tensors(const Model& model) {
  std::vector<ExportedTensor> out;
  std::map<std::string, std::size_t> index;
  std::vector<std::int64_t> cols;  // each tensor's elements per row
  for (const DatasetSpec& d : parameter_datasets(model, "/model")) {
    const std::vector<std::int64_t> shape = dims_of(d.shape);
    const std::int64_t rows = shape.empty() ? 1 : shape[0], per_row = rows > 0 ? d.shape.numel() / rows : 0;
    for (const ExportedName& e : exported_names(model, d.layer, d.name)) {
      const std::int64_t end = e.rows_end < 0 ? rows : e.rows_end;
      const auto [it, fresh] = index.emplace(e.name, out.size());
      if (fresh) {
        out.push_back({e.name, shape, e.transposed, {}});
        out.back().shape[0] = 0;
        cols.push_back(per_row);
      }
      ExportedTensor& t = out[it->second];
      MPIPE_CHECK(!shape.empty() && 0 <= e.rows_begin && e.rows_begin <= end && end <= rows &&
                      cols[it->second] == per_row && t.transposed == e.transposed && (!t.transposed || fresh),
                  "tensor '", e.name, "': layer ", d.layer, "'s '", d.name, "' does not fit it");
      t.parts.push_back({d.layer, d.name, e.rows_begin, end, e.at});
      t.shape[0] = std::max(t.shape[0], e.at + end - e.rows_begin);
    }
  }
  for (ExportedTensor& t : out) {
    // The parts tile the tensor's rows.
    std::sort(t.parts.begin(), t.parts.end(), [](const auto& a, const auto& b) { return a.at < b.at; });
    std::int64_t row = 0;
    for (const ExportedTensor::Part& p : t.parts) {
      MPIPE_CHECK(p.at == row, "tensor '", t.name, "': rows ", row, " on are not layer ", p.layer, "'s");
      row += p.rows_end - p.rows_begin;
    }
    if (t.transposed) std::swap(t.shape[0], t.shape[1]);
  }
  return out;
}

std::vector<float> transposed(const std::vector<float>& v, std::int64_t rows, std::int64_t cols) {
  std::vector<float> t(v.size());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) t[static_cast<std::size_t>(c * rows + r)] = v[static_cast<std::size_t>(r * cols + c)];
  return t;
}

// ---- config.json ----

Json hf_config(const Model& model) {
  const std::vector<LayerSpec>& l = model.spec().layers;
  if (gpt2_layout(model)) {
    const std::int64_t channels = integer(l[0], "out", 0), positions = model.tokens();
    return Json{{"architectures", {"GPT2LMHeadModel"}},
                {"model_type", "gpt2"},
                {"n_embd", channels},
                {"n_layer", block_count(model)},
                {"n_head", integer(l[1], "heads", 0)},
                {"n_positions", positions},
                {"n_ctx", positions},
                {"n_inner", nullptr},  // 4 n_embd
                {"vocab_size", integer(l[0], "vocab", 0)},
                {"layer_norm_epsilon", 1e-5},
                {"activation_function", "gelu_new"},
                {"tie_word_embeddings", true},
                {"torch_dtype", "float32"}};
  }
  const std::optional<LlamaSizes> s = llama_sizes(model);
  if (!s) return nullptr;
  return Json{{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"hidden_size", s->channels},
              {"intermediate_size", s->ffn},
              {"num_hidden_layers", s->blocks},
              {"num_attention_heads", s->heads},
              {"num_key_value_heads", s->kv_heads},
              {"head_dim", s->channels / s->heads},
              {"hidden_act", "silu"},
              {"max_position_embeddings", model.tokens()},
              {"rms_norm_eps", s->eps},
              {"rope_theta", s->rope_theta},
              {"rope_scaling", nullptr},
              {"tie_word_embeddings", s->tied},
              {"vocab_size", s->vocab},
              {"attention_bias", false},
              {"mlp_bias", false},
              {"torch_dtype", "float32"}};
}

namespace {

bool same_value(const Json& a, const Json& b) {
  if (a.is_number() && b.is_number()) {
    const double x = a.get<double>(), y = b.get<double>();
    return x == y || std::abs(x - y) <= 1e-6 * std::max(std::abs(x), std::abs(y));  // 1e-05 written as 9.99999975e-06
  }
  return a == b;
}

}  // namespace

std::string config_disagreement(const Model& model, const Json& config) {
  const Json mine = hf_config(model);
  if (mine.is_null()) return "";
  if (!config.is_object()) return "it is not a JSON object";
  const bool llama = mine["model_type"] == "llama";
  // The fields compared, and Hugging Face's value of each where config.json lacks it (a
  // size it lacks is left to the tensors' shapes).
  const auto field = [&](const std::string& key) -> Json {
    if (config.contains(key)) return config[key];
    if (key == "num_key_value_heads") return config.value("num_attention_heads", Json());
    if (key == "head_dim" && config.contains("hidden_size") && config.contains("num_attention_heads") &&
        config["hidden_size"].is_number_integer() && config["num_attention_heads"].is_number_integer() &&
        config["num_attention_heads"].get<std::int64_t>() > 0)
      return config["hidden_size"].get<std::int64_t>() / config["num_attention_heads"].get<std::int64_t>();
    if (llama) {
      // Newer files keep RoPE's theta and type in rope_parameters.
      const Json rope = config.value("rope_parameters", Json::object());
      if (key == "rope_theta") return rope.is_object() && rope.contains("rope_theta") ? rope["rope_theta"] : Json(10000.0);
      if (key == "rope_scaling")
        return rope.is_object() && rope.value("rope_type", "default") != "default" ? rope : Json();
      const std::map<std::string, Json> defaults = {{"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false},
                                                    {"hidden_act", "silu"}, {"attention_bias", false},
                                                    {"mlp_bias", false}};
      if (const auto it = defaults.find(key); it != defaults.end()) return it->second;
    } else {
      const std::map<std::string, Json> defaults = {
          {"layer_norm_epsilon", 1e-5}, {"activation_function", "gelu_new"}, {"tie_word_embeddings", true}, {"n_inner", nullptr}};
      if (const auto it = defaults.find(key); it != defaults.end()) return it->second;
    }
    return Json();  // not compared
  };
  const std::vector<std::string> keys =
      llama ? std::vector<std::string>{"model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                       "rope_theta", "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
                                       "attention_bias", "mlp_bias"}
            : std::vector<std::string>{"model_type", "n_embd", "n_layer", "n_head", "n_positions", "vocab_size", "n_inner",
                                       "layer_norm_epsilon", "activation_function", "tie_word_embeddings"};
  for (const std::string& key : keys) {
    Json theirs = field(key);
    Json ours = mine[key];
    if (key == "rope_scaling" && theirs.is_object() && theirs.value("rope_type", theirs.value("type", "")) == "default")
      theirs = nullptr;  // the default rotation, spelt out
    if (key == "n_inner" && theirs.is_number() && theirs.get<double>() == 4.0 * mine["n_embd"].get<double>()) ours = theirs;
    if (theirs.is_null() && key != "model_type" && key != "rope_scaling" && key != "n_inner") continue;
    if (!same_value(theirs, ours))
      return cat(key, " is ", theirs.dump(),
                 config.contains(key) ? "" : theirs.is_null() ? " (absent)" : " (absent: Hugging Face's default)",
                 ", this model's is ", ours.dump());
  }
  return "";
}

}  // namespace mpipe
