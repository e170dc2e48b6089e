// `train --init-from PATH`: a fresh run's weights from safetensors files of the names
// io/weights gives the model's family (what `mpipe export` writes, and Hugging Face's
// save_pretrained for GPT-2 and Llama), every claim checked before a value is trusted.
#pragma once
#include <string>

#include "mpipe/nn/model.hpp"

namespace mpipe {

class Executor;

// The checks, headers only, before anything is allocated. PATH is a safetensors file, a
// sharded checkpoint's index (*.safetensors.index.json, its shards beside it) or a
// directory holding model.safetensors or model.safetensors.index.json. A config.json
// beside the weights, for GPT-2's and Llama's families, agrees with the model
// (config_disagreement). Every exported tensor (exported_tensors) is in the files, under
// its name or without Hugging Face's base-model prefix ("transformer." for GPT-2,
// "model." for Llama), of F32, BF16 or F16 and its shape; no tensor is there that the
// model lacks, but for Hugging Face's buffers (GPT-2's attn.bias and attn.masked_bias,
// rotary_emb.inv_freq, torchvision's num_batches_tracked) and, for a model whose head is
// its token table, lm_head.weight of the table's shape. UserError naming the file and
// the tensor or field at fault.
void check_weights(const Model& model, const std::string& path);

// check_weights, then every parameter this rank holds from the files (converted to
// float32; a tied copy its owner's rows). A tied model's lm_head.weight in the files
// must equal the token table there, value for value (the rank loading the table
// compares them): tied files usually leave it out; one that differs was not trained tied.
// UserError for the first problem (the caller agrees on it over the ranks: train's
// start-up phases).
void load_weights(Executor& exec, const std::string& path);

}  // namespace mpipe
