// Byte-level BPE as Hugging Face's tokenizers library runs it for GPT-2 and Llama 3:
// added tokens (<|endoftext|>) are cut out first; the rest is split by the
// pre-tokenizer's regex (PCRE2, JIT, Unicode properties); each piece's bytes start as
// one token each and the merges are applied lowest rank first (leftmost first among
// equals), as tokenizers' word.rs does with its priority queue. The vocabulary is kept
// by raw bytes: GPT-2's byte-to-unicode map is undone once, at load.
#include "mpipe/text/bpe.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "mpipe/core/error.hpp"

namespace mpipe {

namespace {

// GPT-2's pre-tokenizer pattern (ByteLevel with use_regex).
const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for
// code points from 256 on, in byte order.
std::array<char32_t, 256> byte_to_unicode() {
  std::array<char32_t, 256> map{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    map[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
  }
  return map;
}

// The raw bytes a byte-level token's text stands for; false when a character is outside
// the map (the token is then taken as its UTF-8 bytes).
bool unicode_to_bytes(const std::string& text, std::string& bytes) {
  static const std::unordered_map<char32_t, unsigned char> inverse = [] {
    std::unordered_map<char32_t, unsigned char> m;
    const auto map = byte_to_unicode();
    for (int b = 0; b < 256; ++b) m[map[static_cast<std::size_t>(b)]] = static_cast<unsigned char>(b);
    return m;
  }();
  bytes.clear();
  for (std::size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    const std::size_t length = lead < 0x80 ? 1 : lead >= 0xf0 ? 4 : lead >= 0xe0 ? 3 : 2;
    if (i + length > text.size()) return false;
    char32_t code = length == 1 ? lead : lead & (0x3f >> (length - 1));
    for (std::size_t k = 1; k < length; ++k) code = (code << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3f);
    const auto found = inverse.find(code);
    if (found == inverse.end()) return false;
    bytes.push_back(static_cast<char>(found->second));
    i += length;
  }
  return true;
}

std::uint64_t pair_key(std::int32_t left, std::int32_t right) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32) | static_cast<std::uint32_t>(right);
}

std::atomic<std::uint64_t> next_serial{1};

class BpeTokenizer final : public Tokenizer {
 public:
  BpeTokenizer(const std::string& text, const std::string& path) : path_(path), serial_(next_serial++) {
    const std::string hint = "give a Hugging Face tokenizer.json of a byte-level BPE model (GPT-2's or Llama 3's kind)";
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    MPIPE_REQUIRE(j.is_object(), hint, "'", path, "' is not a tokenizer (not valid JSON)");
    try {
      read(j, hint);
    } catch (const nlohmann::json::exception& e) {
      throw UserError(cat("'", path, "' is not a tokenizer.json this program reads: ", e.what()), hint);
    }
    compile(hint);
  }
  ~BpeTokenizer() override {
    if (regex_) pcre2_code_free(regex_);
  }

  std::vector<std::int32_t> encode(std::string_view text) const override {
    std::vector<std::int32_t> ids;
    ids.reserve(text.size() / 3);
    pcre2_match_data* match = pcre2_match_data_create_from_pattern(regex_, nullptr);
    MPIPE_CHECK(match != nullptr, "out of memory");
    std::size_t begin = 0;
    while (begin < text.size()) {
      std::size_t special_at = text.size();
      std::int32_t special_id = -1;
      std::size_t special_length = 0;
      find_added(text, begin, special_at, special_id, special_length);
      encode_ordinary(text.substr(begin, special_at - begin), match, ids);
      if (special_id < 0) break;
      ids.push_back(special_id);
      begin = special_at + special_length;
    }
    pcre2_match_data_free(match);
    return ids;
  }

  std::string decode(std::span<const std::int32_t> ids) const override {
    std::string text;
    for (const std::int32_t id : ids) {
      MPIPE_REQUIRE(id >= 0 && id < vocab_size(), "give ids of the tokenizer's vocabulary", "id ", id,
                    " is past the vocabulary of '", path_, "' (", vocab_size(), " tokens)");
      text += bytes_of_[static_cast<std::size_t>(id)];
    }
    return text;
  }
  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(bytes_of_.size()); }
  std::optional<std::int32_t> eot_id() const override { return added_id({"<|endoftext|>", "<|end_of_text|>"}); }
  std::optional<std::int32_t> bos_id() const override { return added_id({"<|begin_of_text|>"}); }
  std::string describe() const override {
    return cat("byte-level BPE, ", vocab_size(), " tokens, ", merges_.size(), " merges");
  }
  std::string file_name() const override { return "tokenizer.json"; }

 private:
  struct Merge {
    std::int32_t rank, id;
  };
  struct Added {
    std::string content;
    std::int32_t id;
  };

  void read(const nlohmann::json& j, const std::string& hint) {
    const nlohmann::json& model = j.at("model");
    const std::string type = model.value("type", std::string("BPE"));
    MPIPE_REQUIRE(type == "BPE", hint, "'", path_, "' is a ", type, " tokenizer.json; only byte-level BPE is read");
    MPIPE_REQUIRE(!j.contains("normalizer") || j["normalizer"].is_null(), hint, "'", path_,
                  "' has a normalizer, which byte-level BPE (GPT-2, Llama 3) does not; it is not read");
    ignore_merges_ = model.value("ignore_merges", false);
    // The pre-tokenizer: ByteLevel (GPT-2's regex unless use_regex is false), alone or
    // after a Split by a regex (Llama 3).
    bool byte_level = false;
    std::vector<const nlohmann::json*> steps;
    const nlohmann::json& pre = j.at("pre_tokenizer");
    if (pre.is_object() && pre.value("type", "") == "Sequence")
      for (const auto& step : pre.at("pretokenizers")) steps.push_back(&step);
    else if (pre.is_object()) steps.push_back(&pre);
    for (const nlohmann::json* step : steps) {
      const std::string kind = step->value("type", "");
      if (kind == "ByteLevel") {
        byte_level = true;
        add_prefix_space_ = step->value("add_prefix_space", false);
        if (step->value("use_regex", true)) pattern_ = kGpt2Pattern;
      } else if (kind == "Split") {
        const nlohmann::json& p = step->at("pattern");
        if (p.contains("Regex")) pattern_ = p["Regex"].get<std::string>();
        else pattern_ = cat("\\Q", p.at("String").get<std::string>(), "\\E");
        MPIPE_REQUIRE(step->value("behavior", "Isolated") == "Isolated" && !step->value("invert", false), hint, "'", path_,
                      "': only a Split that isolates its matches is read");
      } else {
        throw UserError(cat("'", path_, "': pre-tokenizer '", kind, "' is not read (byte-level BPE: ByteLevel, Split)"), hint);
      }
    }
    MPIPE_REQUIRE(byte_level, hint, "'", path_, "' is not byte-level BPE (no ByteLevel pre-tokenizer)");
    MPIPE_REQUIRE(!pattern_.empty(), hint, "'", path_, "' has no split pattern");
    // The vocabulary, by raw bytes.
    std::string bytes;
    std::int32_t largest = -1;
    for (const auto& [token, id_json] : model.at("vocab").items()) {
      const auto id = id_json.get<std::int32_t>();
      MPIPE_REQUIRE(id >= 0, hint, "'", path_, "': token '", token, "' has the negative id ", id);
      if (!unicode_to_bytes(token, bytes)) bytes = token;
      by_bytes_[bytes] = id;
      largest = std::max(largest, id);
      set_bytes(id, bytes);
    }
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (const auto& a : j["added_tokens"]) {
        Added added{a.at("content").get<std::string>(), a.at("id").get<std::int32_t>()};
        MPIPE_REQUIRE(added.id >= 0 && !added.content.empty(), hint, "'", path_, "': a bad added token '", added.content, "'");
        set_bytes(added.id, added.content);
        added_.push_back(std::move(added));
      }
    std::sort(added_.begin(), added_.end(), [](const Added& a, const Added& b) { return a.content.size() > b.content.size(); });
    for (const Added& a : added_) starts_added_[static_cast<unsigned char>(a.content[0])] = true;
    const auto map = byte_to_unicode();
    for (int b = 0; b < 256; ++b) {
      const auto found = by_bytes_.find(std::string(1, static_cast<char>(b)));
      MPIPE_REQUIRE(found != by_bytes_.end(), hint, "'", path_, "' is not byte-level BPE: no token for byte ", b, " (U+",
                    static_cast<std::uint32_t>(map[static_cast<std::size_t>(b)]), ")");
      byte_id_[static_cast<std::size_t>(b)] = found->second;
    }
    // Merges: "a b" strings (older files) or [a, b] pairs.
    std::int32_t rank = 0;
    std::string left, right;
    for (const auto& m : model.at("merges")) {
      std::string a, b;
      if (m.is_string()) {
        const std::string line = m.get<std::string>();
        const std::size_t space = line.find(' ');
        MPIPE_REQUIRE(space != std::string::npos, hint, "'", path_, "': merge '", line, "' is not two tokens");
        a = line.substr(0, space);
        b = line.substr(space + 1);
      } else {
        a = m.at(0).get<std::string>();
        b = m.at(1).get<std::string>();
      }
      if (!unicode_to_bytes(a, left)) left = a;
      if (!unicode_to_bytes(b, right)) right = b;
      const auto l = by_bytes_.find(left), r = by_bytes_.find(right), merged = by_bytes_.find(left + right);
      MPIPE_REQUIRE(l != by_bytes_.end() && r != by_bytes_.end() && merged != by_bytes_.end(), hint, "'", path_, "': merge '",
                    a, " ", b, "' names a token not in the vocabulary");
      merges_.emplace(pair_key(l->second, r->second), Merge{rank++, merged->second});
    }
  }

  void set_bytes(std::int32_t id, const std::string& bytes) {
    if (bytes_of_.size() <= static_cast<std::size_t>(id)) bytes_of_.resize(static_cast<std::size_t>(id) + 1);
    bytes_of_[static_cast<std::size_t>(id)] = bytes;
  }

  void compile(const std::string& hint) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    regex_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern_.data()), pattern_.size(),
                           PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    if (!regex_) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      throw UserError(cat("'", path_, "': the split pattern does not compile at offset ", offset, ": ",
                          reinterpret_cast<const char*>(message.data())),
                      hint);
    }
    jit_ = pcre2_jit_compile(regex_, PCRE2_JIT_COMPLETE) == 0;
  }

  std::optional<std::int32_t> added_id(std::initializer_list<std::string_view> names) const {
    for (const std::string_view name : names)
      for (const Added& a : added_)
        if (a.content == name) return a.id;
    return std::nullopt;
  }

  // The first added token at or after `from` (the longest where several start there).
  void find_added(std::string_view text, std::size_t from, std::size_t& at, std::int32_t& id, std::size_t& length) const {
    if (added_.empty()) return;
    for (std::size_t i = from; i < text.size(); ++i) {
      if (!starts_added_[static_cast<unsigned char>(text[i])]) continue;
      for (const Added& a : added_)
        if (text.compare(i, a.content.size(), a.content) == 0) {
          at = i;
          id = a.id;
          length = a.content.size();
          return;
        }
    }
  }

  // Text without added tokens: split by the pattern (the gaps between matches, bytes
  // that are not UTF-8, are pieces too), each piece merged.
  void encode_ordinary(std::string_view text, pcre2_match_data* match, std::vector<std::int32_t>& ids) const {
    if (text.empty()) return;
    std::string prefixed;
    if (add_prefix_space_ && text.front() != ' ') {
      prefixed = cat(" ", text);
      text = prefixed;
    }
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
    std::size_t at = 0;
    while (at < text.size()) {
      const int found = jit_ ? pcre2_jit_match(regex_, subject, text.size(), at, 0, match, nullptr)
                             : pcre2_match(regex_, subject, text.size(), at, 0, match, nullptr);
      MPIPE_CHECK(found >= 0 || found == PCRE2_ERROR_NOMATCH, "PCRE2 match error ", found);
      std::size_t begin = found >= 0 ? ovector[0] : text.size(), end = found >= 0 ? ovector[1] : text.size();
      if (begin > at) merge_piece(text.substr(at, begin - at), ids);
      if (end == begin) {  // an empty match: step over one character (UTF-8 aware) as its own piece
        if (begin >= text.size()) break;
        end = begin + 1;
        while (end < text.size() && (static_cast<unsigned char>(text[end]) & 0xc0) == 0x80) ++end;
      }
      if (end > begin) merge_piece(text.substr(begin, end - begin), ids);
      at = end;
    }
  }

  // One piece's ids: a word seen before on this thread comes from its cache.
  void merge_piece(std::string_view piece, std::vector<std::int32_t>& ids) const {
    if (ignore_merges_) {
      if (const auto whole = by_bytes_.find(std::string(piece)); whole != by_bytes_.end()) {
        ids.push_back(whole->second);
        return;
      }
    }
    if (piece.size() == 1) {
      ids.push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
      return;
    }
    struct Cache {
      std::uint64_t owner = 0;
      std::unordered_map<std::string, std::vector<std::int32_t>> words;
    };
    thread_local Cache cache;
    static constexpr std::size_t kCacheWords = 1 << 16;
    if (cache.owner != serial_ || cache.words.size() > kCacheWords) {
      cache.words.clear();
      cache.owner = serial_;
    }
    const bool cached = piece.size() <= 64;
    std::string key;
    if (cached) {
      key.assign(piece);
      if (const auto hit = cache.words.find(key); hit != cache.words.end()) {
        ids.insert(ids.end(), hit->second.begin(), hit->second.end());
        return;
      }
    }
    const std::size_t first = ids.size();
    merge(piece, ids);
    if (cached) cache.words.emplace(std::move(key), std::vector<std::int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(first), ids.end()));
  }

  // The merges on one piece: a linked list of symbols and a queue of candidate pairs by
  // (rank, position); a popped pair whose symbols changed since it was queued is skipped.
  void merge(std::string_view piece, std::vector<std::int32_t>& ids) const {
    struct Symbol {
      std::int32_t id, prev, next;
      bool alive;
    };
    struct Candidate {
      std::int32_t rank, position, id;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : position > o.position; }
    };
    const auto n = static_cast<std::int32_t>(piece.size());
    std::vector<Symbol> symbols(piece.size());
    for (std::int32_t i = 0; i < n; ++i)
      symbols[static_cast<std::size_t>(i)] = {byte_id_[static_cast<unsigned char>(piece[static_cast<std::size_t>(i)])], i - 1,
                                              i + 1 < n ? i + 1 : -1, true};
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
    auto consider = [&](std::int32_t left) {
      const Symbol& l = symbols[static_cast<std::size_t>(left)];
      if (l.next < 0) return;
      const auto found = merges_.find(pair_key(l.id, symbols[static_cast<std::size_t>(l.next)].id));
      if (found != merges_.end()) queue.push({found->second.rank, left, found->second.id});
    };
    for (std::int32_t i = 0; i + 1 < n; ++i) consider(i);
    while (!queue.empty()) {
      const Candidate c = queue.top();
      queue.pop();
      Symbol& l = symbols[static_cast<std::size_t>(c.position)];
      if (!l.alive || l.next < 0) continue;
      Symbol& r = symbols[static_cast<std::size_t>(l.next)];
      const auto now = merges_.find(pair_key(l.id, r.id));
      if (now == merges_.end() || now->second.rank != c.rank) continue;  // stale
      l.id = c.id;
      r.alive = false;
      l.next = r.next;
      if (r.next >= 0) symbols[static_cast<std::size_t>(r.next)].prev = c.position;
      if (l.prev >= 0) consider(l.prev);
      consider(c.position);
    }
    for (std::int32_t i = 0; i >= 0; i = symbols[static_cast<std::size_t>(i)].next) ids.push_back(symbols[static_cast<std::size_t>(i)].id);
  }

  std::string path_;
  std::uint64_t serial_;
  std::string pattern_;
  pcre2_code* regex_ = nullptr;
  bool jit_ = false;
  bool add_prefix_space_ = false;
  bool ignore_merges_ = false;
  std::unordered_map<std::string, std::int32_t> by_bytes_;
  std::vector<std::string> bytes_of_;  // by id
  std::array<std::int32_t, 256> byte_id_{};
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::vector<Added> added_;  // longest first
  std::array<bool, 256> starts_added_{};
};

}  // namespace

std::string byte_level_text(std::string_view bytes) {
  static const auto map = byte_to_unicode();
  std::string text;
  for (const char c : bytes) {
    const char32_t code = map[static_cast<unsigned char>(c)];
    if (code < 0x80) {
      text.push_back(static_cast<char>(code));
    } else {  // all below 0x800: two bytes
      text.push_back(static_cast<char>(0xc0 | (code >> 6)));
      text.push_back(static_cast<char>(0x80 | (code & 0x3f)));
    }
  }
  return text;
}

std::unique_ptr<Tokenizer> make_bpe_tokenizer(const std::string& json, const std::string& path) {
  return std::make_unique<BpeTokenizer>(json, path);
}

}  // namespace mpipe
