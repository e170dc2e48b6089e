// --init-from: a fresh run's weights from safetensors files (one, a sharded index's, a
// directory's) under the names of the model's family, with its config.json checked.
#include "mpipe/io/init_from.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include "mpipe/io/json.hpp"
#include "mpipe/io/safetensors.hpp"
#include "mpipe/io/weights.hpp"
#include "mpipe/pipeline/run/executor.hpp"

namespace mpipe {

namespace fs = std::filesystem;

namespace {

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += cat(i ? ", " : "", shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// What Hugging Face's files of a family put before the names of the base model's
// weights (GPT2Model's inside GPT2LMHeadModel), which a base model's own files lack.
std::string base_prefix(WeightFamily family) {
  return family == WeightFamily::gpt2 ? "transformer." : family == WeightFamily::llama ? "model." : "";
}

// Tensors of other tools' files that are no parameter of mpipe's: GPT-2's causal mask
// buffers, Llama's RoPE frequencies, torchvision's BatchNorm batch counts.
bool foreign_buffer(WeightFamily family, const std::string& name) {
  switch (family) {
    case WeightFamily::gpt2: return name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
    case WeightFamily::llama: return name.ends_with("rotary_emb.inv_freq");
    case WeightFamily::torchvision: return name.ends_with(".num_batches_tracked");
    case WeightFamily::layers: break;
  }
  return false;
}

// PATH as the file to read: itself, or a directory's model.safetensors (else its index).
std::string weights_file(const std::string& path) {
  std::error_code ec;
  MPIPE_REQUIRE(fs::exists(path, ec), "give a .safetensors file, a *.safetensors.index.json or a directory holding either",
                "--init-from: no file or directory '", path, "'");
  if (!fs::is_directory(path, ec)) return path;
  for (const char* name : {"model.safetensors", "model.safetensors.index.json"})
    if (fs::exists(fs::path(path) / name, ec)) return (fs::path(path) / name).string();
  throw UserError(cat("--init-from '", path, "' is a directory without model.safetensors or model.safetensors.index.json"),
                  "give a directory that mpipe export OUT/ or Hugging Face's save_pretrained wrote, or a .safetensors file");
}

// A config.json beside the weights (Hugging Face's from_pretrained reads it there)
// describes this model, or the weights are another's.
void check_config(const Model& model, const std::string& weights) {
  if (hf_config(model).is_null()) return;
  const std::string file = (fs::path(weights).parent_path() / "config.json").string();
  std::error_code ec;
  if (!fs::exists(file, ec)) return;
  const std::string hint = "give the model config.json describes (train's sizes), or weights without a config.json beside them";
  std::string problem;
  try {
    std::ifstream in(file);
    const Json config = Json::parse(in);
    problem = config_disagreement(model, config);
  } catch (const Json::exception& e) {  // not JSON, or a field of a type Hugging Face would refuse too
    throw UserError(cat("--init-from: '", file, "' is not a config.json Hugging Face reads (", e.what(), ")"), hint);
  }
  MPIPE_REQUIRE(problem.empty(), hint, "--init-from: '", file, "' disagrees with this model: ", problem);
}

// What --init-from reads: the files, and the name each exported tensor has in them.
struct Weights {
  std::string path;  // the file or index read
  std::unique_ptr<SafetensorsSet> files;
  std::vector<ExportedTensor> tensors;
  std::map<std::string, std::string> in_file;  // exported name -> the files' name
  std::string token_table;                     // the exported name of a tied model's token table
  std::string tied_head;                       // the files' lm_head.weight, for such a model; empty: none
};

Weights open_weights(const Model& model, const std::string& path) {
  const WeightFamily family = weight_family(model);
  const std::string hint = cat("give weights of this model under ", family_title(family),
                               " names (mpipe export writes them), or the model that wrote them (its metadata's mpipe_model)");
  Weights w;
  w.path = weights_file(path);
  check_config(model, w.path);
  try {
    w.files = std::make_unique<SafetensorsSet>(w.path);
  } catch (const UserError& e) {
    throw UserError(cat("--init-from: ", e.what()), e.hint());
  }
  w.tensors = exported_tensors(model);
  std::map<std::string, const ExportedTensor*> wanted;
  for (const ExportedTensor& t : w.tensors) wanted[t.name] = &t;
  // Hugging Face's causal LMs whose head is their token table: lm_head.weight is no
  // tensor of this model, but a file may hold it.
  const bool hf = family == WeightFamily::gpt2 || family == WeightFamily::llama;
  const std::string head = "lm_head.weight";
  if (hf && !wanted.count(head)) w.token_table = exported_name(model, 0, "wte").name;
  const std::string prefix = base_prefix(family);
  std::string stranger;  // the first tensor of the files that this model has not
  for (const auto& [name, tensor] : w.files->tensors()) {
    if (foreign_buffer(family, name)) continue;
    const std::string mine = wanted.count(name) ? name : !prefix.empty() && wanted.count(prefix + name) ? prefix + name : "";
    if (mine.empty() && !w.token_table.empty() && name == head) {
      w.tied_head = name;
    } else if (mine.empty()) {
      if (stranger.empty()) stranger = name;
    } else {
      const auto [it, fresh] = w.in_file.emplace(mine, name);
      MPIPE_REQUIRE(fresh, hint, "--init-from '", w.path, "' has both '", it->second, "' and '", name, "' for ", mine);
    }
  }
  const auto check_tensor = [&](const std::string& name, const std::vector<std::int64_t>& shape) {
    const SafetensorsFile::Tensor& t = w.files->tensors().at(name);
    MPIPE_REQUIRE(float_dtype(t.dtype), "convert it to float32, bfloat16 or float16", "--init-from '", w.files->file_of(name),
                  "': tensor '", name, "' is ", t.dtype, ", not F32, BF16 or F16");
    MPIPE_REQUIRE(t.shape == shape, hint, "--init-from '", w.files->file_of(name), "': tensor '", name, "' is ",
                  shape_text(t.shape), ", this model's is ", shape_text(shape));
  };
  for (const ExportedTensor& t : w.tensors) {
    const auto it = w.in_file.find(t.name);
    MPIPE_REQUIRE(it != w.in_file.end(),
                  t.name == head ? "the weights' head may be their token table (tied): train with --tie-embeddings on" : hint,
                  "--init-from '", w.path, "' has no tensor '", t.name, "' (layer ", t.parts[0].layer, "'s ", t.parts[0].param,
                  ")");
    check_tensor(it->second, t.shape);
  }
  MPIPE_REQUIRE(stranger.empty(), hint, "--init-from '", w.files->file_of(stranger), "' has tensor '", stranger,
                "', which this model has not");
  if (!w.tied_head.empty()) check_tensor(w.tied_head, wanted.at(w.token_table)->shape);
  return w;
}

}  // namespace

void check_weights(const Model& model, const std::string& path) { open_weights(model, path); }

void load_weights(Executor& exec, const std::string& path) {
  const Model& model = exec.model();
  {
    const Weights w = open_weights(model, path);
    // Each parameter's rows in the tensors.
    std::map<std::pair<int, std::string>, std::vector<std::pair<const ExportedTensor*, const ExportedTensor::Part*>>> parts;
    for (const ExportedTensor& t : w.tensors)
      for (const ExportedTensor::Part& p : t.parts) parts[{p.layer, p.param}].emplace_back(&t, &p);
    // The last tensor read, [out, in] (a head's vocabulary chunks on a rank share lm_head.weight).
    std::string cached_name;
    std::vector<float> cached;
    const auto tensor = [&](const ExportedTensor& t) -> const std::vector<float>& {
      if (cached_name != t.name) {
        cached_name.clear();
        cached = w.files->floats(w.in_file.at(t.name));
        // A NaN or inf would make every step's loss non-finite, each step then skipped.
        const auto bad = std::find_if(cached.begin(), cached.end(), [](float v) { return !std::isfinite(v); });
        MPIPE_REQUIRE(bad == cached.end(), "give weights saved before the run that wrote them diverged",
                      "--init-from '", w.files->file_of(w.in_file.at(t.name)), "': tensor '", w.in_file.at(t.name),
                      "' holds ", std::isnan(*bad) ? "NaN" : "inf", " at element ", bad - cached.begin());
        if (t.transposed) cached = transposed(cached, t.shape[0], t.shape[1]);
        cached_name = t.name;
      }
      return cached;
    };
    // This rank's own: a tied copy reads its owner's tensor (the rows it holds).
    ParamStore& store = exec.params();
    for (const ParamEntry& e : store.entries()) {
      if (e.alias) continue;  // the owner's values, loaded with the owner
      const ParamSpec spec = owner_spec(model, e);
      const std::int64_t rows = spec.shape.rank > 0 ? spec.shape[0] : 1, per_row = spec.shape.numel() / rows;
      std::vector<float> values(static_cast<std::size_t>(spec.shape.numel()));
      for (const auto& [t, p] : parts.at({e.owner_layer, spec.name})) {
        const std::vector<float>& from = tensor(*t);
        std::copy_n(from.begin() + p->at * per_row, (p->rows_end - p->rows_begin) * per_row,
                    values.begin() + p->rows_begin * per_row);
        if (t->name == w.token_table && !w.tied_head.empty() && e.layer == e.owner_layer) {
          const std::vector<float> head = w.files->floats(w.tied_head);
          MPIPE_REQUIRE(head.size() == from.size() && std::memcmp(head.data(), from.data(), head.size() * sizeof(float)) == 0,
                        "leave lm_head.weight out of the weights, or (a Llama) train with --tie-embeddings off to load both",
                        "--init-from '", w.files->file_of(w.tied_head), "': '", w.tied_head, "' differs from '",
                        w.in_file.at(w.token_table), "', and this model's head is its token table");
        }
      }
      std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(e.owner_element), e.numel(),
                  store.params().begin() + static_cast<std::ptrdiff_t>(e.param_offset));
    }
  }
  exec.upload_state();  // on a GPU: the loaded values into device memory
}

}  // namespace mpipe
