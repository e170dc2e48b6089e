// mpipe's own encoder for SentencePiece models, unigram and BPE: the ids libsentencepiece
// 0.1.97's SentencePieceProcessor::Encode gives, from the same ModelProto, without the
// library's per-piece protobuf records. The model file is read with a small protobuf
// wire-format reader; normalisation walks the model's precompiled charsmap (the library's
// darts-clone double array, read as it is stored); a unigram model's Viterbi is the
// library's optimised one (its float and double arithmetic, user-defined pieces' bonus,
// unknown characters, ties), a BPE model's merges are the library's (highest score, then
// leftmost; UNUSED pieces split back), word by word where no merge can cross a word's
// end (each word's ids kept per thread); unknown pieces become byte pieces (byte fallback)
// or merge as the library does. docs/tokenizers.md.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace mpipe {

class SentencePieceEncoder {
 public:
  // The encoder for the serialized ModelProto `bytes`, or nullptr (with *why) when the
  // file is not a model this encoder reads: a word or char model, or a file that does
  // not parse or that the library would refuse (the library then decides).
  static std::unique_ptr<SentencePieceEncoder> from_model(std::string_view bytes, std::string* why);
  ~SentencePieceEncoder();

  // Appends the ids of `text` to *ids (no BOS or EOS) and returns true; false (the ids
  // then partial) where the library must encode the text: a BPE symbol that is a control
  // piece, which the library's Encode reports as an error, or a text whose normalised form
  // passes 2^31 - 2 bytes (the library's int positions). Safe from several threads at
  // once: the work buffers are the calling thread's own, reused from call to call.
  bool encode(std::string_view text, std::vector<std::int32_t>* ids) const;
  // `text` normalised as the library's Normalizer does (for tests).
  void normalize(std::string_view text, std::string* out) const;
  // "unigram" or "BPE".
  bool is_bpe() const;
  // A BPE model none of whose merges can cross a word's end (a run of U+2581 and what
  // follows it): encoded word by word, each word's ids kept per thread (for tests).
  bool bpe_by_words() const;

  struct Model;

 private:
  explicit SentencePieceEncoder(std::unique_ptr<Model> model);
  std::unique_ptr<Model> model_;
};

}  // namespace mpipe
