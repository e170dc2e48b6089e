// Datasets: every batch is a pure function of (seed, step, sample index), so any rank,
// any micro-batch split and a resumed run see the same samples.
//   synthetic  gpt: an order-2 Markov chain with a known entropy floor;
//              mlp: labels from a fixed random teacher network
//   text:PATH  byte-level tokens of any file (gpt)
//   tokens:PATH llm.c token shards (a file, directory or glob) or flat uint16 ids (gpt)
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "mpipe/core/tensor.hpp"
#include "mpipe/nn/model.hpp"

namespace mpipe {

class Tokenizer;  // mpipe/text/tokenizer.hpp

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Fills inputs (count, ...) and targets with the samples [first, first + count) of the
  // global sample sequence (sample s of step k is k * batch_size + s).
  virtual void fill(std::uint64_t first, std::int64_t count, const Tensor& inputs,
                    const Tensor& targets) const = 0;
  // One line for the log: what the data is and, where known, the best achievable loss.
  virtual std::string describe() const = 0;
  // Distinct samples (a file's), or 0 for an endless source (synthetic, token windows).
  virtual std::int64_t size() const { return 0; }
  // Whether fill() takes an empty inputs tensor and then fills only the targets (a
  // labelled file, token windows: the last stage reads its labels, not its inputs).
  virtual bool targets_alone() const { return false; }
  // Whether fill() may run on a thread of its own while the rank computes and writes
  // checkpoints (--prefetch), and on two threads at once for disjoint samples of one
  // batch (the reader's piece in flight and take()'s rest): not where it calls HDF5, whose
  // Debian build is not thread-safe, or BLAS, which the CPU's compute calls meanwhile, or
  // where it keeps state of its own between calls.
  virtual bool fills_aside() const { return true; }
};

// --data-packing: where a window of token data starts (docs/data.md): at any position
// (windows) or at a document's start (documents: after an end-of-text id).
enum class Packing { windows, documents };
inline constexpr std::array<const char*, 2> packing_names{"windows", "documents"};
struct TokenOptions {
  Packing packing = Packing::windows;
  std::int64_t eot_id = -1;  // --eot-id; -1: the shards' format's or the tokenizer's (none for flat files and raw text)
  // --tokenizer, loaded and checked against the model's vocabulary (train's options
  // phase): text: files are encoded with it (docs/tokenizers.md), not read as bytes.
  std::shared_ptr<const Tokenizer> tokenizer;
};

// The file a --data spec names (PATH of text:PATH or tokens:PATH), or "" for none.
std::string data_file(const std::string& spec);

// Parses --data (synthetic | text:PATH | tokens:PATH | hdf5:PATH) for the model (what
// it takes and predicts); UserError on a bad spec or file. `held_out`: the data of
// --eval-data: a file in its own order, synthetic samples the training never sees.
// `tokens`: how text and token files are cut into windows.
std::unique_ptr<Dataset> make_dataset(const std::string& spec, const Model& model, std::uint64_t seed,
                                      bool held_out = false, const TokenOptions& tokens = {});
// hdf5:PATH: /inputs (N, ...) of the model's input shape, uint8 (scaled to [0, 1]) or
// float, normalised by its optional per-channel attributes mean and std; /labels (N)
// integers below the model's classes. The labels are read whole, the inputs by part (the
// rows each batch draws, on the ranks that need them); shuffled per epoch when `shuffle`.
std::unique_ptr<Dataset> make_labelled_file(const std::string& path, const Model& model, std::uint64_t seed,
                                            bool shuffle);

}  // namespace mpipe
