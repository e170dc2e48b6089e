// Text and token files as data: memory-mapped shards read as one stream, cut into
// windows at any position or at documents' starts.
#include "mpipe/data/token_data.hpp"

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>

#include "mpipe/core/rng.hpp"
#include "mpipe/data/mapped_file.hpp"
#include "mpipe/text/tokenizer.hpp"

namespace mpipe {

namespace {

enum class Format { bytes, encoded, flat16, gpt2_shard, llama3_shard };

const char* format_name(Format f) {
  switch (f) {
    case Format::bytes: return "bytes";
    case Format::encoded: return "text encoded by a tokenizer";
    case Format::flat16: return "flat uint16";
    case Format::gpt2_shard: return "llm.c GPT-2 shard, uint16";
    case Format::llama3_shard: return "llm.c Llama 3 shard, uint32";
  }
  return "?";
}

std::int32_t little_int32(const unsigned char* p) {
  return static_cast<std::int32_t>(std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 | std::uint32_t{p[2]} << 16 |
                                   std::uint32_t{p[3]} << 24);
}

// One file of tokens: its map, where its tokens start and how wide each is; or, for text
// encoded by a tokenizer, the ids in memory (the map kept for the file's changed check).
struct Shard {
  MappedFile file;
  Format format = Format::bytes;
  std::uint64_t offset = 0;  // bytes before token 0 (an llm.c header)
  std::uint64_t tokens = 0;
  int width = 1;             // bytes a token
  std::vector<std::uint32_t> ids;  // Format::encoded

  std::uint32_t token(std::uint64_t i) const {
    if (format == Format::encoded) return ids[i];
    const unsigned char* p = file.bytes() + offset + i * static_cast<std::uint64_t>(width);
    if (width == 1) return p[0];
    if (width == 2) return std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8;
    return static_cast<std::uint32_t>(little_int32(p));
  }
};

Shard open_shard(const std::string& path, bool text, bool listed, const std::string& option) {
  const std::string noun = option == "--data" ? "data file" : option + " file";
  Shard shard{MappedFile(path, noun, option)};
  const std::uint64_t size = shard.file.size();
  if (text) {
    shard.tokens = size;
    return shard;
  }
  unsigned char first[4] = {};
  if (size >= 4) shard.file.read(0, 4, first);
  const std::int32_t magic = little_int32(first);
  if (magic != gpt2_shard_magic && magic != llama3_shard_magic) {
    MPIPE_REQUIRE(!listed, cat("a directory or glob of ", option, " names llm.c shards, whose header starts with ", gpt2_shard_magic,
                               " (GPT-2, uint16) or ", llama3_shard_magic, " (Llama 3, uint32)"),
                  "token shard '", path, "' has a bad magic ", magic, " (not an llm.c shard)");
    MPIPE_REQUIRE(size % 2 == 0, "the file must hold little-endian uint16 token ids (or be an llm.c shard)", "token file '", path,
                  "' has an odd size (", size, " bytes)");
    shard.format = Format::flat16;
    shard.width = 2;
    shard.tokens = size / 2;
    return shard;
  }
  const bool gpt2 = magic == gpt2_shard_magic;
  shard.format = gpt2 ? Format::gpt2_shard : Format::llama3_shard;
  shard.width = gpt2 ? 2 : 4;
  shard.offset = shard_header_bytes;
  const std::string hint = "rewrite the shard (llm.c's dev/data/data_common.py write_datafile, or mpipe tokenize)";
  MPIPE_REQUIRE(size >= shard_header_bytes, hint, "token shard '", path, "' has a truncated header (", size, " of ",
                shard_header_bytes, " bytes)");
  unsigned char header[12];
  shard.file.read(0, sizeof header, header);
  const std::int32_t version = little_int32(header + 4), count = little_int32(header + 8);
  const std::int32_t expected = gpt2 ? gpt2_shard_version : llama3_shard_version;
  MPIPE_REQUIRE(version == expected, hint, "token shard '", path, "' has version ", version, " (", format_name(shard.format),
                "s have version ", expected, ")");
  MPIPE_REQUIRE(count >= 0, hint, "token shard '", path, "' has a negative token count ", count);
  shard.tokens = static_cast<std::uint64_t>(count);
  const std::uint64_t body = size - shard_header_bytes, needed = shard.tokens * static_cast<std::uint64_t>(shard.width);
  MPIPE_REQUIRE(needed == body, hint, "token shard '", path, "' says ", count, " tokens (", needed, " bytes after its header) but holds ",
                body, " bytes", needed > body ? ": the count is past its size" : "");
  return shard;
}

// Sample s's window when training (drawn from (seed, s)) or evaluating (the s-th in
// order): candidate k of the stream (docs/data.md, "How a batch is made").
class TokenData final : public Dataset {
 public:
  TokenData(std::vector<Shard> shards, std::string what, std::string noun, std::int64_t seq_len, std::int64_t vocab,
            std::uint64_t seed, bool held_out, Packing packing, std::int64_t eot)
      : shards_(std::move(shards)), what_(std::move(what)), noun_(std::move(noun)), seq_len_(seq_len), vocab_(vocab),
        seed_(seed), held_out_(held_out), packing_(packing), eot_(eot) {
    first_.push_back(0);
    const auto T = static_cast<std::uint64_t>(seq_len_);
    for (const Shard& shard : shards_) {
      std::uint64_t candidates = 0;
      if (packing_ == Packing::documents) candidates = index_documents(shard);
      else if (shard.tokens > T) candidates = held_out_ ? (shard.tokens - 1) / T : shard.tokens - T;
      first_.push_back(first_.back() + candidates);
    }
  }

  std::uint64_t candidates() const { return first_.back(); }

  void fill(std::uint64_t first, std::int64_t count, const Tensor& inputs, const Tensor& targets) const override {
    const std::int64_t T = seq_len_;
    // The ranks that read inputs (the first stage) check the shard and the ids; the last
    // stage reads the same windows' targets at the same step, so one rank says a problem.
    const bool first_stage = !inputs.empty();
    std::int32_t* in = first_stage ? inputs.i32() : nullptr;
    std::int32_t* out = targets.i32();
    for (std::int64_t s = 0; s < count; ++s) {
      const std::uint64_t sample = first + static_cast<std::uint64_t>(s);
      std::uint64_t k = sample % candidates();
      if (!held_out_)
        k = make_stream(seed_, Stream::data, static_cast<std::uint32_t>(sample), static_cast<std::uint32_t>(sample >> 32), 0)
                .below(0, candidates());
      const auto shard_index = static_cast<std::size_t>(std::upper_bound(first_.begin(), first_.end(), k) - first_.begin() - 1);
      const Shard& shard = shards_[shard_index];
      const std::uint64_t local = k - first_[shard_index];
      const std::uint64_t at = packing_ == Packing::documents ? starts_[k] : held_out_ ? local * static_cast<std::uint64_t>(T) : local;
      if (first_stage) shard.file.check_unchanged(cat(noun_, " '", shard.file.path(), "'"));
      for (std::int64_t t = first_stage ? 0 : 1; t <= T; ++t) {
        const std::uint32_t id = shard.token(at + static_cast<std::uint64_t>(t));
        if (first_stage && id >= static_cast<std::uint64_t>(vocab_)) throw out_of_vocabulary(shard, id, at + static_cast<std::uint64_t>(t));
        if (first_stage && t < T) in[s * T + t] = static_cast<std::int32_t>(id);
        if (t > 0) out[s * T + t - 1] = static_cast<std::int32_t>(id);
      }
      // The window's pages leave this process (the page cache keeps them): resident
      // memory stays flat over a corpus larger than memory.
      const auto width = static_cast<std::uint64_t>(shard.width);
      if (shard.format != Format::encoded) shard.file.drop(shard.offset + at * width, static_cast<std::uint64_t>(T + 1) * width);
    }
  }

  std::string describe() const override {
    std::uint64_t tokens = 0;
    for (const Shard& shard : shards_) tokens += shard.tokens;
    std::string text = cat(what_, ", ", tokens, " tokens");
    if (packing_ == Packing::documents) text += cat(", windows at ", candidates(), " document starts (end-of-text id ", eot_, ")");
    if (held_out_) text += cat(", ", candidates(), " windows in order");
    return text;
  }

  std::int64_t size() const override { return held_out_ ? static_cast<std::int64_t>(candidates()) : 0; }
  bool targets_alone() const override { return true; }

 private:
  UserError out_of_vocabulary(const Shard& shard, std::uint32_t id, std::uint64_t at) const {
    return UserError(cat(noun_, " '", shard.file.path(), "' holds token id ", id, " (token ", at,
                         "), outside the model's vocabulary of ", vocab_),
                     cat("use --vocab ", std::uint64_t{id} + 1, " or more, or data tokenized for this model"));
  }

  // Appends the shard's document starts with a whole window before its end to starts_
  // and returns how many: offset 0 and every offset after an end-of-text id. One pass by
  // pread (the map's pages stay out of the resident set), which checks every id too.
  std::uint64_t index_documents(const Shard& shard) {
    constexpr std::uint64_t chunk_tokens = std::uint64_t{1} << 18;
    const auto T = static_cast<std::uint64_t>(seq_len_);
    const std::size_t before = starts_.size();
    if (shard.tokens <= T) return 0;
    const std::uint64_t last_start = shard.tokens - T - 1;
    const bool encoded = shard.format == Format::encoded;  // ids in memory: no file to read
    std::vector<unsigned char> chunk(encoded ? 0 : chunk_tokens * static_cast<std::uint64_t>(shard.width));
    std::uint32_t largest = 0;
    std::uint64_t largest_at = 0;
    starts_.push_back(0);
    for (std::uint64_t first = 0; first < shard.tokens; first += chunk_tokens) {
      const std::uint64_t n = std::min(chunk_tokens, shard.tokens - first), width = static_cast<std::uint64_t>(shard.width);
      if (!encoded) shard.file.read(shard.offset + first * width, n * width, chunk.data());
      for (std::uint64_t i = 0; i < n; ++i) {
        const unsigned char* p = chunk.data() + i * width;
        const std::uint32_t id = encoded ? shard.ids[first + i]
                                 : width == 1 ? p[0]
                                 : width == 2 ? (std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8)
                                              : static_cast<std::uint32_t>(little_int32(p));
        if (id > largest) largest = id, largest_at = first + i;
        if (id == static_cast<std::uint64_t>(eot_) && first + i + 1 <= last_start) starts_.push_back(first + i + 1);
      }
    }
    if (largest >= static_cast<std::uint64_t>(vocab_)) throw out_of_vocabulary(shard, largest, largest_at);
    return starts_.size() - before;
  }

  std::vector<Shard> shards_;
  std::string what_, noun_;
  std::int64_t seq_len_, vocab_;
  std::uint64_t seed_;
  bool held_out_;
  Packing packing_;
  std::int64_t eot_;
  std::vector<std::uint64_t> first_;   // (shards + 1): candidate windows before each shard
  std::vector<std::uint64_t> starts_;  // documents: every candidate's offset in its shard, in stream order
};

}  // namespace

std::vector<std::string> token_files(const std::string& path, const std::string& option, bool& listed) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::string> files;
  listed = true;
  if (fs::is_directory(path, ec)) {
    for (const fs::directory_entry& entry : fs::directory_iterator(path, ec))
      if (entry.path().extension() == ".bin" && entry.is_regular_file(ec)) files.push_back(entry.path().string());
    MPIPE_REQUIRE(!ec, cat("check the directory given to ", option), "cannot list directory '", path, "': ", ec.message());
    MPIPE_REQUIRE(!files.empty(), "give a directory of llm.c shards (*.bin), or one file", option, " directory '", path,
                  "' holds no .bin files");
  } else if (!fs::exists(path, ec) && path.find_first_of("*?[") != std::string::npos) {
    glob_t matches{};
    const int status = ::glob(path.c_str(), GLOB_ERR, nullptr, &matches);
    for (std::size_t i = 0; status == 0 && i < matches.gl_pathc; ++i) files.emplace_back(matches.gl_pathv[i]);
    ::globfree(&matches);
    MPIPE_REQUIRE(!files.empty(), cat("check the pattern given to ", option, " (quote it, so that the shell leaves it to mpipe)"),
                  "no file matches ", option, " '", path, "'");
  } else {
    listed = false;
    files.push_back(path);
  }
  // Byte order, whatever the locale: every rank and every run reads the same stream.
  std::sort(files.begin(), files.end());
  return files;
}

std::unique_ptr<Dataset> make_token_data(bool text, const std::string& path, std::int64_t seq_len, std::int64_t vocab,
                                         std::uint64_t seed, bool held_out, const TokenOptions& options) {
  const std::string option = held_out ? "--eval-data" : "--data";
  const std::string noun = held_out ? "--eval-data file" : "data file";
  bool listed = false;
  const std::vector<std::string> files = text ? std::vector<std::string>{path} : token_files(path, option, listed);
  const Tokenizer* tokenizer = text ? options.tokenizer.get() : nullptr;
  if (text && !tokenizer) {
    MPIPE_REQUIRE(vocab >= 256, "use --vocab 256 or more with text data, or a --tokenizer", option,
                  " text: needs byte tokens (vocabulary 256), but the model's vocabulary is ", vocab);
  }
  std::vector<Shard> shards;
  for (const std::string& file : files) {
    shards.push_back(open_shard(file, text, listed, option));
    if (tokenizer) {  // the file encoded whole, as tokenize encodes a document (no end-of-text added)
      Shard& shard = shards.back();
      const std::vector<std::int32_t> ids = tokenize_text_file(*tokenizer, file);
      shard.ids.assign(ids.begin(), ids.end());
      shard.format = Format::encoded;
      shard.tokens = shard.ids.size();
      shard.width = 4;
    }
    MPIPE_REQUIRE(shards.back().format == shards.front().format, "give shards of one tokenizer (all uint16 or all uint32)",
                  "token shard '", file, "' is a ", format_name(shards.back().format), ", '", files.front(), "' a ",
                  format_name(shards.front().format));
  }
  const Format format = shards.front().format;
  std::int64_t eot = options.eot_id;
  if (eot < 0) eot = format == Format::gpt2_shard ? gpt2_eot_id : format == Format::llama3_shard ? llama3_eot_id : -1;
  if (eot < 0 && tokenizer && tokenizer->eot_id()) eot = *tokenizer->eot_id();
  if (options.packing == Packing::documents) {
    MPIPE_REQUIRE(eot >= 0, "give --eot-id N, the id that ends each document", "--data-packing documents on ", format_name(format),
                  " data needs --eot-id (only llm.c shards have a default)");
    MPIPE_REQUIRE(eot < vocab, cat("give --eot-id below ", vocab, ", or a model of the data's vocabulary"), "end-of-text id ", eot,
                  " is outside the model's vocabulary of ", vocab);
  }
  std::uint64_t tokens = 0;
  for (const Shard& shard : shards) tokens += shard.tokens;
  std::string what = text ? cat("text file ", path) : cat("tokens file ", path, " (", format_name(format), ")");
  if (tokenizer) what = cat("text file ", path, " (tokenizer: ", tokenizer->describe(), ")");
  if (listed) what = cat("tokens ", path, ": ", shards.size(), " shards (", format_name(format), ")");
  auto data = std::make_unique<TokenData>(std::move(shards), what, noun, seq_len, vocab, seed, held_out, options.packing, eot);
  if (data->candidates() == 0) {
    MPIPE_REQUIRE(options.packing == Packing::windows, "use longer documents or a smaller --seq-len", "no document of ", option,
                  " '", path, "' starts ", seq_len + 1, " tokens (a window of --seq-len ", seq_len, ") before its shard's end");
    MPIPE_REQUIRE(listed, "use a longer file or a smaller --seq-len", noun, " '", path, "' has ", tokens,
                  " tokens, too short for one sample of ", seq_len, " tokens (needs ", seq_len + 1, ")");
    throw UserError(cat("no shard of ", option, " '", path, "' holds ", seq_len + 1, " tokens (a window of --seq-len ", seq_len,
                        "): too short"),
                    "use longer shards or a smaller --seq-len");
  }
  return data;
}

}  // namespace mpipe
