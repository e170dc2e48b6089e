// Tokenizers behind one interface: text to token ids and back, for `mpipe tokenize`,
// `generate --tokenizer` and text data. Two kinds are read: SentencePiece models
// (tokenizer.model: loaded and decoded by libsentencepiece, unigram and BPE models encoded
// by text/sentencepiece_encoder.hpp with the library's ids) and Hugging Face byte-level BPE
// (tokenizer.json: GPT-2's and Llama 3's kind, src/text/bpe.cpp). docs/tokenizers.md.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mpipe {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // The ids of `text` as the tokenizer encodes it whole (no BOS or EOS added). Any bytes,
  // UTF-8 or not; safe to call from several threads at once.
  virtual std::vector<std::int32_t> encode(std::string_view text) const = 0;
  // The bytes of `ids`; an id not below vocab_size() is a UserError naming it.
  virtual std::string decode(std::span<const std::int32_t> ids) const = 0;
  // One past the largest id.
  virtual std::int64_t vocab_size() const = 0;
  // The end-of-text id that separates documents (SentencePiece's EOS; BPE's
  // <|endoftext|> or <|end_of_text|>), and the begin-of-text id, where the tokenizer has them.
  virtual std::optional<std::int32_t> eot_id() const = 0;
  virtual std::optional<std::int32_t> bos_id() const = 0;
  // "SentencePiece unigram, 32000 tokens": for logs and errors.
  virtual std::string describe() const = 0;
  // The file's name as written beside an exported model: tokenizer.model or tokenizer.json.
  virtual std::string file_name() const = 0;
};

// The tokenizer in `bytes`, chosen by content: a JSON object is a Hugging Face
// tokenizer.json (model.type "BPE", byte-level), anything else must parse as a
// SentencePiece ModelProto. `path` names the source in errors (UserError: not a
// tokenizer, or one of a kind not read).
std::unique_ptr<Tokenizer> tokenizer_from_bytes(const std::string& bytes, const std::string& path);

// The tokenizer file `path` names: a file, or a directory holding tokenizer.json or
// tokenizer.model. Its bytes in *file_bytes and the file read in *file_path when given
// (a checkpoint keeps them).
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, std::string* file_bytes = nullptr,
                                          std::string* file_path = nullptr);

// The ids of a text file, encoded whole (what `train --tokenizer` with `--data text:PATH`
// trains on). UserError naming the file when it cannot be read.
std::vector<std::int32_t> tokenize_text_file(const Tokenizer& tokenizer, const std::string& path);

// The bytes of a file; UserError naming it (with `what`, e.g. "tokenizer") when it is
// missing, not a regular file or unreadable.
std::string read_whole_file(const std::string& path, const std::string& what);
// The same checks without reading: the file exists and is a regular file.
void require_regular_file(const std::string& path, const std::string& what);

// Decodes ids one at a time for a stream of text: put() returns the bytes that are now
// whole characters (a multi-byte character split over tokens is held until complete);
// finish() returns what is left.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  std::string put(std::int32_t id);
  std::string finish();

 private:
  const Tokenizer& tokenizer_;
  std::vector<std::int32_t> ids_;  // since the last whole text given out
  std::size_t given_ = 0;          // bytes of decode(ids_) already given out
};

}  // namespace mpipe
