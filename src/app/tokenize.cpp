// `mpipe tokenize`: text to llm.c token shards. Inputs are read in batches of whole
// documents; the threads take documents (never part of one) from a shared counter and
// the ids are written in input order, so the shards are the same bytes whatever
// --threads. Each shard is written under a temporary name and renamed once complete.
#include "mpipe/app/tokenize.hpp"

#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <thread>

#include "mpipe/core/error.hpp"
#include "mpipe/text/tokenizer.hpp"

namespace mpipe {

namespace {

// A batch's text is read until it holds this many bytes (then encoded by every thread).
constexpr std::size_t kBatchBytes = std::size_t{64} << 20;

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// Shards PREFIX_000000.bin, ...: ids appended, a shard closed and renamed when full.
class ShardWriter {
 public:
  ShardWriter(const TokenizeOptions& o, ShardKind kind) : o_(o), kind_(kind) {}
  ~ShardWriter() {
    if (file_) {  // an error left it unfinished: no partial shard stays
      std::fclose(file_);
      std::filesystem::remove(temporary_);
    }
  }

  void append(std::span<const std::int32_t> ids) {
    while (!ids.empty()) {
      if (!file_) open();
      const std::size_t room = static_cast<std::size_t>(o_.shard_size - count_);
      const std::size_t take = std::min(room, ids.size());
      buffer_.resize(take * static_cast<std::size_t>(kind_.token_bytes));
      for (std::size_t i = 0; i < take; ++i) {
        const auto id = static_cast<std::uint32_t>(ids[i]);
        for (int b = 0; b < kind_.token_bytes; ++b)
          buffer_[i * static_cast<std::size_t>(kind_.token_bytes) + static_cast<std::size_t>(b)] = static_cast<char>(id >> (8 * b));
      }
      write(buffer_.data(), buffer_.size());
      count_ += static_cast<std::int64_t>(take);
      total_ += static_cast<std::int64_t>(take);
      ids = ids.subspan(take);
      if (count_ == o_.shard_size) close();
    }
  }

  // Closes the last shard and removes shards of an earlier, longer run under this prefix.
  int finish() {
    if (file_) close();
    for (int stale = shards_;; ++stale) {
      std::error_code ec;
      if (!std::filesystem::remove(name(stale), ec)) break;
    }
    return shards_;
  }
  std::int64_t total() const { return total_; }

 private:
  std::string name(int shard) const {
    char number[16];
    std::snprintf(number, sizeof number, "%06d", shard);
    return (std::filesystem::path(o_.out) / cat(o_.prefix, "_", number, ".bin")).string();
  }
  void open() {
    final_ = name(shards_);
    temporary_ = final_ + ".partial";
    file_ = std::fopen(temporary_.c_str(), "wb");
    MPIPE_REQUIRE(file_ != nullptr, "check that --out is a directory you may write", "cannot create '", temporary_, "': ",
                  std::strerror(errno));
    count_ = 0;
    const std::vector<char> header(kShardHeaderInts * 4, 0);
    write(header.data(), header.size());  // the count is known at the close
  }
  void close() {
    std::int32_t head[3] = {kind_.magic, kind_.version, static_cast<std::int32_t>(count_)};
    char bytes[12];
    for (int i = 0; i < 12; ++i) bytes[i] = static_cast<char>(static_cast<std::uint32_t>(head[i / 4]) >> (8 * (i % 4)));
    MPIPE_REQUIRE(std::fseek(file_, 0, SEEK_SET) == 0, "check the disk", "cannot seek in '", temporary_, "': ", std::strerror(errno));
    write(bytes, sizeof bytes);
    const bool flushed = std::fflush(file_) == 0 && fsync(fileno(file_)) == 0;
    const int error = errno;
    const bool closed = std::fclose(file_) == 0;
    file_ = nullptr;
    if (!flushed || !closed) {
      std::filesystem::remove(temporary_);
      throw UserError(cat("cannot write '", temporary_, "': ", std::strerror(flushed ? errno : error)),
                      "free space on the disk, or give another --out");
    }
    std::error_code ec;
    std::filesystem::rename(temporary_, final_, ec);
    MPIPE_REQUIRE(!ec, "check --out", "cannot rename '", temporary_, "' to '", final_, "': ", ec.message());
    ++shards_;
  }
  void write(const char* data, std::size_t bytes) {
    MPIPE_REQUIRE(std::fwrite(data, 1, bytes, file_) == bytes, "free space on the disk, or give another --out",
                  "cannot write '", temporary_, "': ", std::strerror(errno));
  }

  const TokenizeOptions& o_;
  ShardKind kind_;
  std::FILE* file_ = nullptr;
  std::string final_, temporary_;
  std::vector<char> buffer_;
  std::int64_t count_ = 0, total_ = 0;
  int shards_ = 0;
};

std::string read_input(const std::string& path) {
  if (path != "-") return read_whole_file(path, "input");
  std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  MPIPE_REQUIRE(!std::cin.bad(), "check standard input", "cannot read standard input");
  return text;
}

// The documents of one input: all of it, or the parts between separators (empty parts
// dropped).
void split_documents(std::string_view text, const std::string& separator, std::vector<std::string_view>& documents) {
  if (separator.empty()) {
    if (!text.empty()) documents.push_back(text);
    return;
  }
  for (std::size_t at = 0; at <= text.size();) {
    const std::size_t end = std::min(text.find(separator, at), text.size());
    if (end > at) documents.push_back(text.substr(at, end - at));
    at = end + separator.size();
  }
}

}  // namespace

int run_tokenize(const TokenizeOptions& o) {
  const std::string hint = "see mpipe tokenize --help";
  MPIPE_REQUIRE(!o.inputs.empty(), "give text files (or - for standard input)", "tokenize needs at least one input");
  MPIPE_REQUIRE(o.shard_size >= 1 && o.shard_size < (std::int64_t{1} << 31), hint,
                "--shard-size must be from 1 to 2^31-1 tokens, got ", o.shard_size);
  MPIPE_REQUIRE(o.threads >= 0, hint, "--threads must be from 0, got ", o.threads);
  MPIPE_REQUIRE(!o.prefix.empty() && o.prefix.find('/') == std::string::npos, hint, "--prefix must be a file name, got '",
                o.prefix, "'");
  MPIPE_REQUIRE(o.progress == "auto" || o.progress == "on" || o.progress == "off", "use auto, on or off",
                "--progress must be auto, on or off, got '", o.progress, "'");
  const auto tokenizer = load_tokenizer(o.tokenizer);
  std::optional<std::int32_t> eot = tokenizer->eot_id();
  if (o.eot_id >= 0) {
    MPIPE_REQUIRE(o.eot_id < tokenizer->vocab_size(), "give an id of the tokenizer's vocabulary", "--eot-id ", o.eot_id,
                  " is past the vocabulary of '", o.tokenizer, "' (", tokenizer->vocab_size(), " tokens)");
    eot = static_cast<std::int32_t>(o.eot_id);
  }
  MPIPE_REQUIRE(eot.has_value(), "give the id that separates documents with --eot-id", "tokenizer '", o.tokenizer,
                "' has no end-of-text token");
  const std::optional<std::int32_t> bos = tokenizer->bos_id();
  MPIPE_REQUIRE(!o.bos || bos.has_value(), "leave out --bos", "tokenizer '", o.tokenizer, "' has no begin-of-text token");
  for (const std::string& input : o.inputs)
    if (input != "-") require_regular_file(input, "input");  // every input checked before any shard is written
  std::error_code ec;
  std::filesystem::create_directories(o.out, ec);
  MPIPE_REQUIRE(std::filesystem::is_directory(o.out, ec), "give a directory you may write", "--out '", o.out,
                "' is not a directory and cannot be made one");

  const ShardKind kind = shard_kind_for(tokenizer->vocab_size());
  const int threads = o.threads > 0 ? o.threads : available_cores();
  const bool live = o.progress == "on" || (o.progress == "auto" && isatty(STDERR_FILENO));
  std::fprintf(stderr, "mpipe: tokenizing %zu input%s with %s (%s) on %d thread%s into %s/%s_*.bin (uint%d)\n",
               o.inputs.size(), o.inputs.size() == 1 ? "" : "s", o.tokenizer.c_str(), tokenizer->describe().c_str(), threads,
               threads == 1 ? "" : "s", o.out.c_str(), o.prefix.c_str(), kind.token_bytes * 8);
  ShardWriter writer(o, kind);
  const auto start = std::chrono::steady_clock::now();
  auto shown = start;
  std::int64_t bytes_read = 0, documents_done = 0;
  std::size_t next_input = 0;
  std::vector<std::string> texts;
  std::vector<std::string_view> documents;
  std::vector<std::vector<std::int32_t>> encoded;
  while (next_input < o.inputs.size()) {
    texts.clear();
    documents.clear();
    std::size_t batch = 0;
    while (next_input < o.inputs.size() && batch < kBatchBytes) {
      texts.push_back(read_input(o.inputs[next_input++]));
      batch += texts.back().size();
    }
    for (const std::string& text : texts) split_documents(text, o.document_separator, documents);
    encoded.assign(documents.size(), {});
    std::atomic<std::size_t> next{0};
    std::vector<std::thread> workers;
    std::vector<std::exception_ptr> failures(static_cast<std::size_t>(threads));
    for (int t = 0; t < threads; ++t)
      workers.emplace_back([&, t] {
        try {
          for (std::size_t d; (d = next.fetch_add(1)) < documents.size();) encoded[d] = tokenizer->encode(documents[d]);
        } catch (...) {
          failures[static_cast<std::size_t>(t)] = std::current_exception();
        }
      });
    for (std::thread& w : workers) w.join();
    for (const std::exception_ptr& failure : failures)
      if (failure) std::rethrow_exception(failure);
    for (std::size_t d = 0; d < documents.size(); ++d) {
      writer.append(std::span<const std::int32_t>(&*eot, 1));  // llm.c's order: each document after an end-of-text
      if (o.bos) writer.append(std::span<const std::int32_t>(&*bos, 1));
      writer.append(encoded[d]);
      std::vector<std::int32_t>().swap(encoded[d]);
    }
    bytes_read += static_cast<std::int64_t>(batch);
    documents_done += static_cast<std::int64_t>(documents.size());
    const auto now = std::chrono::steady_clock::now();
    if (live && now - shown > std::chrono::milliseconds(500)) {
      shown = now;
      const double seconds = std::chrono::duration<double>(now - start).count();
      std::fprintf(stderr, "\r\033[Kmpipe: tokenize: %zu/%zu inputs, %.1f MB, %lld tokens, %.1f MB/s", next_input,
                   o.inputs.size(), bytes_read / 1e6, static_cast<long long>(writer.total()), bytes_read / 1e6 / seconds);
    }
  }
  const int shards = writer.finish();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (live) std::fprintf(stderr, "\r\033[K");
  std::fprintf(stderr,
               "mpipe: tokenized %.1f MB (%lld documents) into %lld tokens, %d shard%s, in %.2f s: %.1f MB/s on %d thread%s\n",
               bytes_read / 1e6, static_cast<long long>(documents_done), static_cast<long long>(writer.total()), shards,
               shards == 1 ? "" : "s", seconds, bytes_read / 1e6 / seconds, threads, threads == 1 ? "" : "s");
  return 0;
}

void require_tokenizer_fits(const Tokenizer& tokenizer, const std::string& source, std::int64_t vocab) {
  MPIPE_REQUIRE(tokenizer.vocab_size() <= vocab,
                cat("give the tokenizer the model was trained with, or a model of --vocab ", tokenizer.vocab_size(), " or more"),
                "tokenizer '", source, "' has ", tokenizer.vocab_size(), " tokens, more than the model's vocabulary of ", vocab);
}

std::unique_ptr<Tokenizer> load_run_tokenizer(const std::string& path, std::int64_t vocab, TokenizerFile* kept) {
  std::string bytes, file;
  std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(path, &bytes, &file);
  require_tokenizer_fits(*tokenizer, file, vocab);
  *kept = TokenizerFile{.name = std::filesystem::path(file).filename().string(),
                        .kind = tokenizer->file_name() == "tokenizer.json" ? "bpe" : "sentencepiece",
                        .bytes = std::move(bytes),
                        .source = file};
  return tokenizer;
}

}  // namespace mpipe
