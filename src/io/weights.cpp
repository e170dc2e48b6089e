// The names mpipe's parameters take in other tools' files (Hugging Face GPT-2's for the
// GPT preset, torchvision's for the ResNet preset, the layer list's own for the rest),
// and --init-from, which loads them.
#include "mpipe/io/weights.hpp"

#include <map>

#include "mpipe/io/checkpoint_format.hpp"
#include "mpipe/io/safetensors.hpp"
#include "mpipe/pipeline/executor.hpp"

namespace mpipe {

bool gpt2_layout(const Model& model) {
  const int n = model.size();
  if (n < 5 || model.layer(0).kind() != "embedding" || model.layer(n - 3).kind() != "layernorm" ||
      model.layer(n - 2).kind() != "linear" || model.layer(n - 1).kind() != "cross_entropy")
    return false;
  for (int i = 1; i < n - 3; ++i)
    if (model.layer(i).kind() != "block") return false;
  // The head is the token table (tied, no bias): GPT-2's lm_head.
  const std::vector<ParamSpec> head = model.layer(n - 2).param_specs();
  return head.size() == 1 && head[0].tied_layer == 0;
}

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

ExportedName exported_name(const Model& model, int layer, const std::string& name) {
  if (const std::size_t blocks = torchvision_blocks_from(model); blocks > 0) {
    if (layer == 0) return {cat("conv1.", name)};
    if (layer == 1) return {cat("bn1.", name)};
    if (layer == model.size() - 2) return {cat("fc.", name)};
    // layerS.B: a new stage where a block halves the plane (torchvision's layer1 does not).
    const std::vector<Shape> shapes = model.shapes(1);
    int stage = 0, index = -1;
    for (int i = static_cast<int>(blocks); i <= layer; i += 2) {
      const bool halves = shapes[static_cast<std::size_t>(i) + 1][2] < shapes[static_cast<std::size_t>(i)][2];
      if (stage == 0 || halves) ++stage, index = 0;
      else ++index;
    }
    const std::string block = cat("layer", stage, ".", index, ".");
    if (name.rfind("skip_norm.", 0) == 0) return {block + "downsample.1." + name.substr(10)};
    if (name.rfind("skip.", 0) == 0) return {block + "downsample.0." + name.substr(5)};
    // The inner layer's: the k-th convolution is conv{k}, the k-th BatchNorm bn{k}.
    const std::size_t dot = name.find('.');
    const int child = std::atoi(name.substr(0, dot).c_str());
    return {cat(block, child % 3 == 0 ? "conv" : "bn", child / 3 + 1, name.substr(dot))};
  }
  if (!gpt2_layout(model)) return {cat(layer, ".", name)};
  const int n = model.size();
  if (layer == 0) return {cat("transformer.", name, ".weight")};  // wte, wpe
  if (layer == n - 3) return {cat("transformer.ln_f.", name)};
  // GPT-2's Conv1D keeps its weight [in, out].
  const bool conv1d = name == "attn.c_attn.weight" || name == "attn.c_proj.weight" || name == "mlp.c_fc.weight" ||
                      name == "mlp.c_proj.weight";
  return {cat("transformer.h.", layer - 1, ".", name), conv1d};
}

std::vector<float> transposed(const std::vector<float>& v, std::int64_t rows, std::int64_t cols) {
  std::vector<float> t(v.size());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) t[static_cast<std::size_t>(c * rows + r)] = v[static_cast<std::size_t>(r * cols + c)];
  return t;
}

namespace {

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += cat(i ? ", " : "", shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

}  // namespace

void load_weights(Executor& exec, const std::string& path) {
  const Model& model = exec.model();
  const std::string hint = cat("give a file that mpipe export wrote for this model (",
                               gpt2_layout(model)                ? "Hugging Face GPT-2's"
                               : torchvision_resnet_layout(model) ? "torchvision's"
                                                                  : "the layer list's",
                               " names), or the model that wrote it (its metadata's mpipe_model)");
  {
    const SafetensorsFile file = [&] {
      try {
        return SafetensorsFile(path);
      } catch (const UserError& e) {
        throw UserError(cat("--init-from: ", e.what()), e.hint());
      }
    }();
    // The whole model's names, on every rank (the header alone): one line for the first
    // tensor missing, of another dtype or shape, or in the file but not in the model.
    std::map<std::string, std::pair<DatasetSpec, ExportedName>> wanted;
    for (const DatasetSpec& d : parameter_datasets(model, "/model")) {
      const ExportedName name = exported_name(model, d.layer, d.name);
      wanted.emplace(name.name, std::pair{d, name});
    }
    for (const auto& [name, want] : wanted) {
      const auto it = file.tensors().find(name);
      MPIPE_REQUIRE(it != file.tensors().end(), hint, "--init-from '", path, "' has no tensor '", name, "' (layer ",
                    want.first.layer, "'s ", want.first.name, ")");
      std::vector<std::int64_t> shape(want.first.shape.dims.begin(), want.first.shape.dims.begin() + want.first.shape.rank);
      if (want.second.transposed) std::swap(shape[0], shape[1]);
      MPIPE_REQUIRE(it->second.dtype == "F32", "export it as float32 (mpipe export writes F32)", "--init-from '", path,
                    "': tensor '", name, "' is ", it->second.dtype, ", not F32");
      MPIPE_REQUIRE(it->second.shape == shape, hint, "--init-from '", path, "': tensor '", name, "' is ",
                    shape_text(it->second.shape), ", this model's is ", shape_text(shape));
    }
    // (torchvision's BatchNorm batch counts aside: mpipe has none)
    const bool torchvision = torchvision_resnet_layout(model);
    for (const auto& [name, tensor] : file.tensors())
      MPIPE_REQUIRE(wanted.count(name) > 0 || (torchvision && name.ends_with(".num_batches_tracked")), hint, "--init-from '",
                    path, "' has tensor '", name, "', which this model has not");
    // This rank's own: a tied copy reads its owner's tensor (the rows it holds).
    ParamStore& store = exec.params();
    for (const ParamEntry& e : store.entries()) {
      if (e.alias) continue;  // the owner's values, loaded with the owner
      const ExportedName name = exported_name(model, e.owner_layer, owner_spec(model, e).name);
      const DatasetSpec& d = wanted.at(name.name).first;
      std::vector<float> values = file.floats(name.name);
      if (name.transposed) values = transposed(values, d.shape[1], d.shape[0]);  // back to [out, in]
      std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(e.owner_element), e.numel(), store.params().begin() + static_cast<std::ptrdiff_t>(e.param_offset));
    }
  }
  exec.upload_state();  // on a GPU: the loaded values into device memory
}

}  // namespace mpipe
