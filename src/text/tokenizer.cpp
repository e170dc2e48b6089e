// Choosing a tokenizer by its file's content, the SentencePiece kind (the library's own
// processor; mpipe's encoder for unigram and BPE models), reading text files to ids, and
// decoding a stream of ids.
#include "mpipe/text/tokenizer.hpp"

#include <sentencepiece_processor.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "mpipe/core/error.hpp"
#include "mpipe/text/bpe.hpp"
#include "mpipe/text/sentencepiece_encoder.hpp"

namespace mpipe {

namespace {

const char* const kTokenizerHint =
    "give a SentencePiece model (tokenizer.model) or a Hugging Face byte-level BPE tokenizer.json, or a directory "
    "holding one";

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& bytes, const std::string& path) : path_(path) {
    const auto status = processor_.LoadFromSerializedProto(bytes);
    MPIPE_REQUIRE(status.ok() && processor_.GetPieceSize() > 0, kTokenizerHint, "'", path,
                  "' is not a tokenizer (neither JSON nor a SentencePiece model: ", status.ToString(), ")");
    // Unigram and BPE models: mpipe's encoder (the library's ids, faster); word and char
    // models, and a file the encoder does not read, the library's. MPIPE_SENTENCEPIECE=library
    // asks for the library's everywhere (scripts/bench_tokenize.sh's baseline).
    const char* const choice = std::getenv("MPIPE_SENTENCEPIECE");
    if (choice && std::string_view(choice) == "library")
      library_why_ = "MPIPE_SENTENCEPIECE=library";
    else
      encoder_ = SentencePieceEncoder::from_model(bytes, &library_why_);
  }
  std::vector<std::int32_t> encode(std::string_view text) const override {
    if (encoder_) {
      std::vector<std::int32_t> out;
      out.reserve(text.size() / 3 + 8);
      if (encoder_->encode(text, &out)) return out;
    }
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    MPIPE_CHECK(status.ok(), "SentencePiece encode: ", status.ToString());
    return {ids.begin(), ids.end()};
  }
  std::string decode(std::span<const std::int32_t> ids) const override {
    std::vector<int> in(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      MPIPE_REQUIRE(ids[i] >= 0 && ids[i] < vocab_size(), "give ids of the tokenizer's vocabulary", "id ", ids[i],
                    " is past the vocabulary of '", path_, "' (", vocab_size(), " tokens)");
      in[i] = ids[i];
    }
    std::string text;
    const auto status = processor_.Decode(in, &text);
    MPIPE_CHECK(status.ok(), "SentencePiece decode: ", status.ToString());
    return text;
  }
  std::int64_t vocab_size() const override { return processor_.GetPieceSize(); }
  std::optional<std::int32_t> eot_id() const override { return id_or_none(processor_.eos_id()); }
  std::optional<std::int32_t> bos_id() const override { return id_or_none(processor_.bos_id()); }
  std::string describe() const override {
    return cat("SentencePiece, ", vocab_size(), " tokens, ",
               encoder_ ? (encoder_->is_bpe() ? "BPE, mpipe's encoder" : "unigram, mpipe's encoder")
                        : cat("libsentencepiece's encoder: ", library_why_));
  }
  std::string file_name() const override { return "tokenizer.model"; }

 private:
  static std::optional<std::int32_t> id_or_none(int id) {
    return id >= 0 ? std::optional<std::int32_t>(id) : std::nullopt;
  }
  sentencepiece::SentencePieceProcessor processor_;
  std::unique_ptr<SentencePieceEncoder> encoder_;  // null: the library encodes
  std::string library_why_;
  std::string path_;
};

bool looks_like_json(const std::string& bytes) {
  const std::size_t first = bytes.find_first_not_of(" \t\r\n");
  return first != std::string::npos && bytes[first] == '{';
}

}  // namespace

void require_regular_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  MPIPE_REQUIRE(std::filesystem::exists(status), cat("check the ", what, "'s path"), "no ", what, " file '", path, "'");
  MPIPE_REQUIRE(std::filesystem::is_regular_file(status), cat("give the ", what, " as a file"), what, " '", path, "' is ",
                std::filesystem::is_directory(status) ? "a directory" : "not a regular file");
}

std::string read_whole_file(const std::string& path, const std::string& what) {
  require_regular_file(path, what);
  std::error_code ec;
  std::ifstream in(path, std::ios::binary);
  MPIPE_REQUIRE(in.good(), cat("check the ", what, " file's permissions"), "cannot read ", what, " '", path, "'");
  std::string bytes(static_cast<std::size_t>(std::filesystem::file_size(path, ec)), '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  MPIPE_REQUIRE(!ec && in.gcount() == static_cast<std::streamsize>(bytes.size()), cat("check the ", what, " file"),
                "cannot read ", what, " '", path, "'");
  return bytes;
}

std::unique_ptr<Tokenizer> tokenizer_from_bytes(const std::string& bytes, const std::string& path) {
  MPIPE_REQUIRE(!bytes.empty(), kTokenizerHint, "'", path, "' is not a tokenizer (it is empty)");
  if (looks_like_json(bytes)) return make_bpe_tokenizer(bytes, path);
  return std::make_unique<SentencePieceTokenizer>(bytes, path);
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, std::string* file_bytes, std::string* file_path) {
  std::string file = path;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    file.clear();
    for (const char* name : {"tokenizer.json", "tokenizer.model"})
      if (std::filesystem::is_regular_file(std::filesystem::path(path) / name, ec)) {
        file = (std::filesystem::path(path) / name).string();
        break;
      }
    MPIPE_REQUIRE(!file.empty(), kTokenizerHint, "--tokenizer directory '", path,
                  "' holds neither tokenizer.json nor tokenizer.model");
  }
  std::string bytes = read_whole_file(file, "tokenizer");
  auto tokenizer = tokenizer_from_bytes(bytes, file);
  if (file_bytes) *file_bytes = std::move(bytes);
  if (file_path) *file_path = file;
  return tokenizer;
}

std::vector<std::int32_t> tokenize_text_file(const Tokenizer& tokenizer, const std::string& path) {
  return tokenizer.encode(read_whole_file(path, "text"));
}

std::string StreamDecoder::put(std::int32_t id) {
  ids_.push_back(id);
  const std::string text = tokenizer_.decode(ids_);
  // Whole characters only: hold back a UTF-8 sequence the next token may complete, and
  // replacement characters a byte-fallback decoder writes for one it has not seen whole.
  std::size_t end = text.size();
  for (std::size_t back = 1; back <= 3 && back <= end; ++back) {
    const auto byte = static_cast<unsigned char>(text[end - back]);
    if ((byte & 0xc0) != 0x80) {
      const std::size_t need = byte >= 0xf0 ? 4 : byte >= 0xe0 ? 3 : byte >= 0xc0 ? 2 : 1;
      if (need > back) end -= back;
      break;
    }
  }
  static constexpr std::string_view replacement = "\xef\xbf\xbd";
  while (end >= given_ + replacement.size() && std::string_view(text).substr(end - replacement.size(), replacement.size()) == replacement)
    end -= replacement.size();
  if (end <= given_) return {};
  std::string out = text.substr(given_, end - given_);
  given_ = end;
  return out;
}

std::string StreamDecoder::finish() {
  const std::string text = tokenizer_.decode(ids_);
  std::string out = given_ < text.size() ? text.substr(given_) : std::string();
  ids_.clear();
  given_ = 0;
  return out;
}

}  // namespace mpipe
