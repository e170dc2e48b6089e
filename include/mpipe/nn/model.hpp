// Models: a flat, ordered list of layers with global indices, built through the layer
// registry from a ModelSpec: a preset's (gpt, llama, mlp, resnet: sizes from the options)
// or a model file's. A pipeline stage is a contiguous range of it.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "mpipe/nn/layer.hpp"
#include "mpipe/nn/registry.hpp"

namespace mpipe {

struct ModelConfig {
  std::string kind = "gpt";  // a preset (gpt | llama | mlp | resnet) or the path of a model file
  int layers = 4;            // transformer blocks (gpt, llama), hidden blocks (mlp) or depth (resnet); presets only
  int d_model = 128;
  int heads = 4;
  int seq_len = 64;
  int vocab = 256;
  // llama: key/value heads (0: heads), the SwiGLU width (0: Llama's rule, llama_ffn),
  // RoPE's base, RMSNorm's eps, and whether the head is the token table ("on"/"off").
  int kv_heads = 0;
  int ffn = 0;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  std::string tie_embeddings = "off";
  int hidden = 256;   // mlp width
  int inputs = 64;    // mlp input features
  int classes = 10;   // mlp and resnet classes
  int image = 32;     // resnet: input side (H = W); from 128 on, ImageNet's stem
  int channels = 3;   // resnet: input channels
  int width = 64;     // resnet: channels of the first stage (64, 128, 256, 512 by default)
  float dropout = 0.0f;
  // gpt, llama: the LM head as this many vocabulary chunks (layers a pipeline can put on
  // different stages; nn/vocab_layers.hpp), 1: one linear layer.
  int head_chunks = 1;
  // gpt, llama, head chunks: keep each chunk's logits for its backward (fastest), or recompute
  // them there (one more GEMM; no rows x vocab logits held between forward and backward).
  std::string head_logits = "keep";
  bool operator==(const ModelConfig&) const = default;
};

// Checks sizes and combinations; throws UserError naming the option at fault.
void validate(const ModelConfig& config);
// Whether --model names a preset (otherwise it is a model file).
bool is_preset(const std::string& kind);
// ResNet depths the resnet preset builds (He et al. 2016): 18 and 34 with basic blocks,
// 50, 101 and 152 with bottleneck blocks.
bool is_resnet_depth(int layers);
// The layer list --model describes: a preset's, built from the sizes, or a file's.
ModelSpec model_spec(const ModelConfig& config);

class Model {
 public:
  explicit Model(const ModelConfig& config) : Model(config, model_spec(config)) {}
  // A layer list read elsewhere (a checkpoint's): `list` is the model, config.kind its name.
  Model(const ModelConfig& config, ModelSpec list);
  Model(Model&&) = default;

  const ModelConfig& config() const { return config_; }
  const ModelSpec& spec() const { return spec_; }
  int size() const { return static_cast<int>(layers_.size()); }
  Layer& layer(int index) { return *layers_[index]; }
  const Layer& layer(int index) const { return *layers_[index]; }

  // What one micro-batch of `batch` samples looks like going in, and its targets.
  Shape input_shape(int64_t batch) const;
  DType input_dtype() const;
  Shape target_shape(int64_t batch) const;
  // Weights shared by two layers (GPT's embedding and head): the owner's layer and
  // parameter name, the layer holding the copy, and which rows of the owner's the copy
  // is (a vocabulary chunk of the head holds a range of the token table's rows).
  struct Tie {
    int owner_layer;
    std::string name;
    int copy_layer;
    std::int64_t rows_begin = 0, rows_end = 0;  // of the owner's rows
    bool whole = true;                          // the copy is all of the owner
  };
  const std::vector<Tie>& ties() const { return ties_; }
  // The ties whose owner is (layer, name), in model order (a head split over the
  // vocabulary has one per chunk).
  std::vector<const Tie*> ties_of(int layer, const std::string& name) const;
  // Skips (nn/skip_layers.hpp): layer `producer`'s output, stashed as `name`, joined to
  // its input by layer `consumer` (a later concat or add), in the order of their
  // producers; a skip's index keys Pass::skips and its messages.
  struct Skip {
    std::string name;
    int producer = -1, consumer = -1;
  };
  const std::vector<Skip>& skips() const { return skips_; }
  // BatchNorm + ReLU pairs whose BatchNorm rectifies for the ReLU (mark_fusions), at
  // every depth.
  int fusions() const { return fusions_; }
  // Parameters of the whole model, a tied weight counted once.
  int64_t parameter_count() const;
  // Loss rows (predicted tokens, pixels or samples) per sample: T for a model of tokens,
  // H x W for per-pixel labels (the loss takes (batch, classes, H, W)), else 1.
  int64_t rows_per_sample() const;
  // Tokens per sample (0 unless a model of tokens), and the classes the loss tells
  // apart (the vocabulary of a model of tokens).
  int64_t tokens() const { return spec_.tokens; }
  int64_t classes() const;
  // Input shape of every layer for a micro-batch of `batch`: shapes[i] enters layer i,
  // shapes[size()] leaves the last.
  std::vector<Shape> shapes(int64_t batch) const;

 private:
  void check_loss_input(const std::string& file) const;
  // Builds the layers, resolving each join's `from` to its skip (UserError for a name
  // stashed twice or never taken, a join of a name no earlier layer stashes).
  void build_layers(const std::string& file);

  ModelConfig config_;
  ModelSpec spec_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<Tie> ties_;
  std::vector<Skip> skips_;
  Shape loss_input_;  // what enters the loss, batch 1
  int fusions_ = 0;
};

// Where a split backward (B then W) keeps a layer's output gradient for its W: layer
// `layer`, a Linear (Layer::keeps_dy) that is not the last of its stage (which ends before `stage_end`)
// and whose next layer has no W of its own, keeps its dy in its own output's buffer,
// which nothing reads any more once the next layer's backward has run (the LM head's in
// the logits, an MLP's in what its ReLU read): no stash memory of its own. The stage
// checks at run time, too, that no later W reads that buffer through a view.
bool keeps_dy_in_output(const Model& model, int layer, int stage_end);

// Whether layer `layer` of a stage that begins at `stage_begin` writes its input gradient
// over its input (`in` its shape): it may (Layer::gradient_over_input: a loss over
// logits), it is not the stage's first (whose input gradient is the message sent back),
// and the layer before it reads its output in no backward and stashes it for no skip. A
// loss then holds one (rows, classes) buffer through its backward where it held two.
bool gradient_in_place(const Model& model, int layer, int stage_begin, const Shape& in);

// The first layer of the model's last stage [begin, model.size()) from which a split
// backward computes every weight gradient in B, none in W: the top layers whose W would
// read nothing the forward kept (the loss, a LayerNorm: their weight gradients are B's
// anyway), and Linears among them (the LM head, a classifier) whose Ws cost at most
// 1/8 of the stage's backward FLOPs together. Their forward memory (the logits, the head's input
// and dy) then dies in B, not at W: the stage's W-pending micro-batches hold that much
// less (zb-h1's last stage held two micro-batches' logits and their gradients). A head
// whose W is dear (GPT-2's 50257 words) keeps it in W, where it fills the bubble.
// `stage_end` below model.size() (not the last stage: its output is sent from that
// memory): stage_end.
struct WeightsInBackward {
  int from;      // the first such layer (stage_end: none)
  double share;  // their W's FLOPs, of the stage's backward FLOPs
};
WeightsInBackward weights_in_backward(const Model& model, int begin, int stage_end);
inline int weights_in_backward_from(const Model& model, int begin, int stage_end) {
  return weights_in_backward(model, begin, stage_end).from;
}

}  // namespace mpipe
