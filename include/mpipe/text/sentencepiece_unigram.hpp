// mpipe's own encoder for SentencePiece unigram models: the ids libsentencepiece 0.1.97's
// SentencePieceProcessor::Encode gives, from the same ModelProto, without the library's
// per-piece protobuf records. The model file is read with a small protobuf wire-format
// reader; normalisation walks the model's precompiled charsmap (the library's darts-clone
// double array, read as it is stored); the Viterbi is the library's optimised one (scores
// in float as it adds them, user-defined pieces' bonus, unknown characters, ties), and
// unknown pieces become byte pieces (byte fallback) or merge as the library does.
// docs/tokenizers.md.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace mpipe {

class SentencePieceUnigram {
 public:
  // The encoder for the serialized ModelProto `bytes`, or nullptr (with *why) when the
  // file is not a unigram model this encoder reads: another model type (BPE, word, char),
  // or a file that does not parse or that the library would refuse (the library decides).
  static std::unique_ptr<SentencePieceUnigram> from_model(std::string_view bytes, std::string* why);
  ~SentencePieceUnigram();

  // Appends the ids of `text` to *ids (no BOS or EOS). Safe from several threads at once:
  // the work buffers are the calling thread's own, reused from call to call.
  void encode(std::string_view text, std::vector<std::int32_t>* ids) const;
  // `text` normalised as the library's Normalizer does (for tests).
  void normalize(std::string_view text, std::string* out) const;

  struct Model;

 private:
  explicit SentencePieceUnigram(std::unique_ptr<Model> model);
  std::unique_ptr<Model> model_;
};

}  // namespace mpipe
