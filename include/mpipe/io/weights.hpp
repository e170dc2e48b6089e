// Weights outside checkpoints: the names and layouts mpipe's parameters take in other
// tools' files, one table per model family (Hugging Face GPT-2's for the GPT preset,
// Hugging Face Llama's for the llama preset, torchvision's for the ResNet preset, the
// layer list's own for the rest), and the config.json Hugging Face reads beside them:
// what `mpipe export` writes and `train --init-from` (io/init_from) reads
// (docs/huggingface.md).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mpipe/io/json.hpp"
#include "mpipe/nn/model.hpp"

namespace mpipe {

// Whose names a model's weights take.
enum class WeightFamily { layers, gpt2, llama, torchvision };

// Whether `model` is the GPT preset's layer list (embedding with learned positions,
// GPT-2 blocks (LayerNorm, GELU MLP, biases: the block's defaults), the final LayerNorm,
// a head tied to the token table (one layer, or vocabulary chunks), the loss): its
// weights then take Hugging Face GPT-2's names (GPT2LMHeadModel: transformer.h.N.attn.
// c_attn.weight, ...) and its Conv1D layout; the head is the token table, not stored twice.
bool gpt2_layout(const Model& model);
// Whether `model` is the llama preset's layer list (an embedding without positions;
// blocks of RMSNorm, RoPE attention, SwiGLU MLP, no biases, all of one shape; the final
// rmsnorm; a head tied or not, one layer or vocabulary chunks; the loss): its weights
// then take Hugging Face Llama's names (LlamaForCausalLM: model.layers.N.self_attn.
// q_proj.weight, ...), c_attn and c_fc split into their projections by rows.
bool llama_layout(const Model& model);
// Whether `model` is the resnet preset's layer list (torchvision's ResNet: a stem of
// convolution, BatchNorm, ReLU and, from 128 pixels, max pool; BasicBlocks or Bottlenecks
// with a projection where the shape changes; average pool; fc): its weights then take
// torchvision's names (conv1.weight, layer1.0.bn2.running_mean, layer2.0.downsample.0.
// weight, fc.bias); torchvision's own models have the 128-pixel stem's shapes.
bool torchvision_resnet_layout(const Model& model);
WeightFamily weight_family(const Model& model);
// "Hugging Face GPT-2", "Hugging Face Llama", "torchvision ResNet", "mpipe layer".
const char* family_title(WeightFamily family);

// Rows of one parameter in an exported tensor: the parameter's rows [rows_begin,
// rows_end) (rows_end -1: to its last) are the tensor's rows from `at` on. A parameter
// may be several tensors (Llama's q, k and v projections are rows of c_attn), and a
// tensor several parameters (an untied head in vocabulary chunks is lm_head.weight).
struct ExportedName {
  std::string name;
  bool transposed = false;  // stored [in, out] (GPT-2's Conv1D), where mpipe keeps [out, in]; whole parameters only
  std::int64_t rows_begin = 0, rows_end = -1;
  std::int64_t at = 0;
};
// Where layer `layer`'s parameter `name` (BatchNorm's running statistics too) goes: its
// family's table (above), else the layer list's own, as a PyTorch Sequential of it names
// them ("3.weight", "4.0.weight" for a residual block's first inner layer, "4.skip.weight").
std::vector<ExportedName> exported_names(const Model& model, int layer, const std::string& name);
// The one name of a parameter that is one whole tensor (every family's but Llama's
// c_attn, c_fc and chunked head).
ExportedName exported_name(const Model& model, int layer, const std::string& name);

// One tensor of an exported file: its name, its shape as stored, and the parameters'
// rows it is made of (in the order of its rows).
struct ExportedTensor {
  struct Part {
    int layer;
    std::string param;
    std::int64_t rows_begin, rows_end;  // of the parameter
    std::int64_t at;                    // the tensor's first row of it
  };
  std::string name;
  std::vector<std::int64_t> shape;  // transposed: [in, out]
  bool transposed = false;
  std::vector<Part> parts;
};
// Every tensor an export of `model` holds, in the order of the parameters (a tied copy
// is its owner's).
std::vector<ExportedTensor> exported_tensors(const Model& model);

// A [rows, cols] matrix's values as [cols, rows] (GPT-2's Conv1D layout, and back).
std::vector<float> transposed(const std::vector<float>& values, std::int64_t rows, std::int64_t cols);

// The config.json of Hugging Face's from_pretrained for `model` (its family's: GPT2Config,
// LlamaConfig fields), null for a family Hugging Face has no class of.
Json hf_config(const Model& model);
// config.json's first field that disagrees with `model`'s (hf_config): a field it lacks
// is Hugging Face's default where that has one (num_key_value_heads: the heads;
// rope_theta 10000, rms_norm_eps 1e-6, tie_word_embeddings false for Llama;
// layer_norm_epsilon 1e-5, gelu_new, tied for GPT-2), else not compared. Empty: none.
std::string config_disagreement(const Model& model, const Json& config);

}  // namespace mpipe
