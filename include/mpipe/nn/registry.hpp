// Models as data: a model is a list of layer specs (a kind and its options), and the
// layer registry knows each kind: its options, and how to build it from them and the
// shape coming in. Presets (gpt, mlp, resnet) are such lists built from the command
// line's sizes; a model file (TOML) is one a user writes.
//
// Each kind's entry (a LayerKind) lives beside its class, in its family's file
// (dense_layers, transformer_layers, conv_layers, residual, vocab_layers), which returns
// them from one function; the registry lists the families. Adding a layer kind: its
// class and entry in a family file, its ops (backend/) and its tests; a new family file
// adds its function to registry.cpp's list. The pipeline, checkpoints, `plan` and
// `inspect` see only layers.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "mpipe/nn/layer.hpp"

namespace mpipe {

using OptionValue = std::variant<std::int64_t, double, bool, std::string>;

struct LayerSpec {
  std::string kind;
  std::map<std::string, OptionValue> options;
  std::vector<LayerSpec> children;  // a residual block's inner layers ([[layer.layer]])
  // A model's layer (not a block's): its output stashed under this name for a later
  // concat or add (`from`); empty: none.
  std::string stash;
};

// What goes into a model, and its layers in order (the last one is the loss).
struct ModelSpec {
  std::string name;                 // the preset's name, or the model file's path
  std::int64_t tokens = 0;          // a sequence model: token ids (B, tokens), next-token targets
  std::vector<std::int64_t> input;  // otherwise: one sample's features; class targets (B)
  std::vector<LayerSpec> layers;

  // As a model file (parse_model_file reads it back to the same spec).
  std::string to_toml() const;
};

enum class OptionType { integer, number, boolean, text };

struct OptionSpec {
  std::string name;
  OptionType type;
  std::optional<OptionValue> fallback;  // none: the option is required
  std::string help;
};

// One layer being built: its spec with every option present (defaults filled in and
// types checked), the shape of one micro-batch coming in, and the model around it.
struct LayerArgs {
  const LayerSpec& spec;
  const ModelSpec& model;
  int index;    // in the model's list
  Shape input;  // what enters the layer (batch 1)
  std::string where;  // "model file 'm.toml', layer 3 (linear)", for errors
  bool nested = false;  // inside a residual block (index is the block's)
  Shape skip;           // a join's (`from`): the stashed tensor's shape (batch 1); rank 0: none

  std::int64_t integer(const std::string& name, std::int64_t least = 1) const;  // checked: least .. 2^31
  double number(const std::string& name) const;
  // A standard deviation option: at least 0, or -1 (the kind's default rule) where
  // `automatic`.
  double deviation(const std::string& name, bool automatic) const;
  bool boolean(const std::string& name) const;
  const std::string& text(const std::string& name) const;
  // The channels of a (.., C) input; refuses other inputs.
  std::int64_t channels() const;
  // The window of a layer over an (N, C, H, W) input; refuses other inputs and windows
  // larger than the padded plane.
  Window2d image_window(std::int64_t kernel, std::int64_t stride, std::int64_t padding) const;
  // The layer's `tie` option: -1 (none), or the index of an earlier embedding whose token
  // table is `rows` x `width`, the shape of the weight (`what`: "weight", "head's") tied to it.
  int tied_table(std::int64_t rows, std::int64_t width, const char* what) const;
  // A UserError about option `name` of this layer.
  [[noreturn]] void refuse(const std::string& name, const std::string& problem, const std::string& hint) const;
};

// A normalisation's `eps` option: in (0, 0.1]; refused otherwise.
float norm_eps(const LayerArgs& a);

struct LayerKind {
  std::string name;  // as Layer::kind() says it
  std::string help;
  std::vector<OptionSpec> options;
  bool takes_tokens = false;  // its input is token ids (B, T) int32
  std::function<std::unique_ptr<Layer>(const LayerArgs&)> make;
  bool nestable = false;  // may be an inner layer of a residual block ([[layer.layer]])
};

// Every layer kind, in the order `plan --layers-help` lists them.
const std::vector<LayerKind>& layer_kinds();
const LayerKind* find_layer_kind(const std::string& name);

// Builds `spec` with `input` coming in: its options checked by name and type, defaults
// filled, then its kind's builder. `nested`: inside a residual block (which builds its
// inner layers with this); `skip`: a join's stashed tensor (LayerArgs::skip). UserError
// naming `where`, the key and the problem.
std::unique_ptr<Layer> build_layer(const LayerSpec& spec, const ModelSpec& model, int index, const Shape& input,
                                   const std::string& where, bool nested, const Shape& skip = {});

// Builds layer `index` of `model` with `input` coming in; UserError naming `where`, the
// key and the problem when the spec is not one the kind takes.
// `skip`: where the layer joins a stashed tensor (`from`), its shape (batch 1).
std::unique_ptr<Layer> make_layer(const ModelSpec& model, int index, const Shape& input, const std::string& where,
                                  const Shape& skip = {});

// Reads a model file; UserError naming the file, the line or layer, and the key.
ModelSpec parse_model_file(const std::string& path);
// The same from a model file's text; `name` stands for the file in the messages.
ModelSpec parse_model_text(const std::string& text, const std::string& name);

}  // namespace mpipe
