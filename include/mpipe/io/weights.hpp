// Weights outside checkpoints: the names and layouts mpipe's parameters take in other
// tools' files (Hugging Face GPT-2's for the GPT preset, torchvision's for the ResNet
// preset, the layer list's own for the rest), which `mpipe export` writes and
// `train --init-from` reads.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mpipe/nn/model.hpp"

namespace mpipe {

class Executor;

// A parameter's name and layout in an exported file.
struct ExportedName {
  std::string name;
  bool transposed = false;  // stored [in, out] (GPT-2's Conv1D), where mpipe keeps [out, in]
};

// Whether `model` is the GPT preset's layer list (embedding, blocks, the final
// LayerNorm, a head tied to the token table, the loss): its weights then take Hugging
// Face GPT-2's names (GPT2LMHeadModel: transformer.h.N.attn.c_attn.weight, ...) and its
// Conv1D layout; the head is the token table, not stored twice.
bool gpt2_layout(const Model& model);
// Whether `model` is the resnet preset's layer list (torchvision's ResNet: a stem of
// convolution, BatchNorm, ReLU and, from 128 pixels, max pool; BasicBlocks or Bottlenecks
// with a projection where the shape changes; average pool; fc): its weights then take
// torchvision's names (conv1.weight, layer1.0.bn2.running_mean, layer2.0.downsample.0.
// weight, fc.bias); torchvision's own models have the 128-pixel stem's shapes.
bool torchvision_resnet_layout(const Model& model);
// The name of layer `layer`'s parameter `name` (BatchNorm's running statistics too):
// GPT-2's or torchvision's (above), else the layer list's own, as a PyTorch Sequential
// of it names them ("3.weight", "4.0.weight" for a residual block's first inner layer,
// "4.skip.weight").
ExportedName exported_name(const Model& model, int layer, const std::string& name);
// A [rows, cols] matrix's values as [cols, rows] (GPT-2's Conv1D layout, and back).
std::vector<float> transposed(const std::vector<float>& values, std::int64_t rows, std::int64_t cols);

// --init-from FILE: every parameter of the run's model from a safetensors file of these
// names, each checked for its presence, float32 and shape (GPT-2's Conv1D transposed
// back), and no tensor in the file that the model lacks; this rank loads its own
// (a tied copy its owner's rows). UserError naming the first problem (the caller agrees
// on it over the ranks: train's start-up phases).
void load_weights(Executor& exec, const std::string& path);

}  // namespace mpipe
