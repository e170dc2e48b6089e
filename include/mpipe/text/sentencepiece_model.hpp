// The parts of a SentencePiece model file mpipe's encoder reads (text/sentencepiece_encoder):
// the ModelProto's fields, a double-array trie over byte strings (the pieces), UTF-8 as the
// library checks it, and the normaliser's precompiled charsmap. Inside text/ only.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mpipe::spm {

// ModelProto.SentencePiece.Type.
enum PieceType : std::uint8_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

struct ProtoPiece {
  std::string_view text;
  float score = 0;
  int type = kNormal;
};

struct Proto {
  std::vector<ProtoPiece> pieces;
  int model_type = 1;  // UNIGRAM
  bool treat_whitespace_as_suffix = false, byte_fallback = false;
  std::string_view charsmap;
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
};

// The serialized ModelProto `bytes` into *proto (its pieces and the strings point into
// `bytes`); false for a file that does not parse, or a field of the wrong wire type (the
// library's protobuf would refuse it too).
bool parse_proto(std::string_view bytes, Proto* proto);

struct TrieKey {
  std::string_view key;
  std::int32_t value;  // >= 0
  double score;        // not NaN
  bool operator<(const TrieKey& o) const { return key < o.key; }
};

// A double-array trie over byte strings: child(node, byte) is one load and one compare,
// and the node of a key holds its score (NaN at a node that ends no key) and value.
class Trie {
 public:
  struct Unit {
    std::int32_t base = 0, check = -1;
    double score = std::numeric_limits<double>::quiet_NaN();
  };
  // `keys`: distinct non-empty byte strings without NUL.
  void build(std::vector<TrieKey> keys);
  bool empty() const { return units_.empty(); }
  // The child of `node` by byte c, or -1.
  std::int32_t child(std::int32_t node, unsigned char c) const {
    const std::size_t i = static_cast<std::size_t>(units_[static_cast<std::size_t>(node)].base) + c;
    return units_[i].check == node ? static_cast<std::int32_t>(i) : -1;
  }
  std::int32_t value(std::int32_t node) const { return values_[static_cast<std::size_t>(node)]; }
  // The value of the key s[0, n), or -1.
  std::int32_t exact(const char* s, std::size_t n) const {
    const std::int32_t node = walk(0, s, n);
    return node >= 0 ? value(node) : -1;
  }
  // The node reached from `node` by s[0, n), or -1.
  std::int32_t walk(std::int32_t node, const char* s, std::size_t n) const {
    if (units_.empty()) return -1;
    for (std::size_t i = 0; i < n && node >= 0; ++i) node = child(node, static_cast<unsigned char>(s[i]));
    return node;
  }
  const std::int32_t* values() const { return values_.data(); }
  const Unit* units() const { return units_.data(); }
  // The longest key that is a prefix of s[0, n) among the first `max_results` prefixes
  // found (shortest first), as darts-clone's commonPrefixSearch reports them; 0 if none.
  std::size_t longest_prefix(const char* s, std::size_t n, std::size_t max_results) const {
    std::size_t longest = 0, found = 0;
    std::int32_t node = 0;
    for (std::size_t i = 0; i < n; ++i) {
      node = child(node, static_cast<unsigned char>(s[i]));
      if (node < 0) break;
      if (value(node) >= 0 && found++ < max_results) longest = i + 1;
    }
    return longest;
  }

 private:
  std::vector<Unit> units_;
  std::vector<std::int32_t> values_;  // per unit: the key's value, or -1
};

constexpr std::string_view kSpaceSymbol = "\xe2\x96\x81";  // U+2581, SentencePiece's escaped space
constexpr std::string_view kReplacement = "\xef\xbf\xbd";  // U+FFFD for a malformed UTF-8 byte

// sentencepiece's string_util::OneCharLen: the length a leading byte announces.
inline int one_char_len(unsigned char b) { return "\1\1\1\1\1\1\1\1\1\1\1\1\2\2\3\4"[b >> 4]; }

inline bool is_trail(unsigned char b) { return (b & 0xc0) == 0x80; }
inline bool valid_code_point(std::uint32_t c) { return c < 0xd800 || (c >= 0xe000 && c <= 0x10ffff); }

// sentencepiece's string_util::IsValidDecodeUTF8: the length of a valid UTF-8 character at
// s, or 0 for a malformed byte (U+FFFD itself is valid).
inline std::size_t valid_utf8_len(const unsigned char* s, std::size_t n) {
  const unsigned char b = s[0];
  if (b < 0x80) return 1;
  if (n >= 2 && (b & 0xe0) == 0xc0) {
    const std::uint32_t c = (b & 0x1fu) << 6 | (s[1] & 0x3fu);
    if (is_trail(s[1]) && c >= 0x80 && valid_code_point(c)) return 2;
  } else if (n >= 3 && (b & 0xf0) == 0xe0) {
    const std::uint32_t c = (b & 0x0fu) << 12 | (s[1] & 0x3fu) << 6 | (s[2] & 0x3fu);
    if (is_trail(s[1]) && is_trail(s[2]) && c >= 0x800 && valid_code_point(c)) return 3;
  } else if (n >= 4 && (b & 0xf8) == 0xf0) {
    const std::uint32_t c = (b & 0x07u) << 18 | (s[1] & 0x3fu) << 12 | (s[2] & 0x3fu) << 6 | (s[3] & 0x3fu);
    if (is_trail(s[1]) && is_trail(s[2]) && is_trail(s[3]) && c >= 0x10000 && valid_code_point(c)) return 4;
  }
  return 0;
}

// The precompiled charsmap: <uint32 trie size><darts-clone double array><strings, each
// ended by NUL>, the trie's values offsets into the strings.
class Charsmap {
 public:
  bool load(std::string_view blob);
  bool empty() const { return units_.empty(); }
  // Whether some rule starts with byte b (darts-clone's first step from the root).
  bool starts_rule(unsigned char b) const {
    if (units_.empty()) return false;
    const std::size_t pos = offset(units_[0]) ^ b;
    return pos < units_.size() && label(units_[pos]) == b;
  }
  // Whether byte b before an ASCII byte (or the end) is no rule's start: neither b alone
  // nor b and an ASCII byte begin a rule. NFKC's rules that start with a letter need a
  // combining mark after it (a non-ASCII byte).
  bool ascii_before_ascii_safe(unsigned char b) const {
    if (units_.empty()) return true;
    const std::size_t pos = offset(units_[0]) ^ b;
    if (pos >= units_.size() || label(units_[pos]) != b) return true;
    const std::uint32_t unit = units_[pos];
    if ((unit >> 8) & 1) return false;
    const std::size_t base = pos ^ offset(unit);
    for (unsigned c = 0; c < 0x80; ++c) {
      const std::size_t p = base ^ c;
      if (p < units_.size() && label(units_[p]) == c) return false;
    }
    return true;
  }
  // Normalizer::NormalizePrefix's search: the longest rule matching a prefix of s[0, n)
  // among the first 32 found; its length (0: none) and replacement in *out.
  std::size_t longest(const char* s, std::size_t n, std::string_view* out) const;

 private:
  static std::size_t offset(std::uint32_t unit) { return (unit >> 10) << ((unit & (1u << 9)) >> 6); }
  static std::uint32_t label(std::uint32_t unit) { return unit & ((1u << 31) | 0xff); }
  std::vector<std::uint32_t> units_;
  std::string strings_;
};

inline std::size_t Charsmap::longest(const char* s, std::size_t n, std::string_view* out) const {
    constexpr std::size_t kMaxResults = 32;  // Normalizer::kMaxTrieResultsSize
    std::size_t longest = 0, found = 0, value = 0;
    if (units_.empty()) return 0;
    std::size_t pos = offset(units_[0]);
    for (std::size_t i = 0; i < n; ++i) {
      const auto c = static_cast<unsigned char>(s[i]);
      pos ^= c;
      if (pos >= units_.size()) break;
      const std::uint32_t unit = units_[pos];
      if (label(unit) != c) break;
      pos ^= offset(unit);
      if ((unit >> 8) & 1) {  // has a leaf
        if (pos >= units_.size()) break;
        if (found++ < kMaxResults) {
          longest = i + 1;
          value = units_[pos] & ((1u << 31) - 1);
        }
      }
    }
    if (longest == 0) return 0;
    if (value >= strings_.size()) {
      *out = {};
    } else {
      const char* begin = strings_.data() + value;
      const void* nul = std::memchr(begin, 0, strings_.size() - value);
      *out = std::string_view(begin, nul ? static_cast<std::size_t>(static_cast<const char*>(nul) - begin)
                                         : strings_.size() - value);
    }
    return longest;
}

// BPE by words: the pieces that could cross a word's end (U+2581 after another character,
// or a cut U+2581 at an end; with whitespace as a suffix, before one), each at the offsets
// where a word's end would fall inside it, filed by the byte on the word's side of it. A
// word's end in a text is a cut (no merge and no user-defined symbol crosses it) unless
// one of them spells the text around it.
class WordEnds {
 public:
  explicit WordEnds(bool suffix = false) : suffix_(suffix) {}
  // Files `piece` where it could cross a word's end; false past kMaxCrossings offsets.
  bool add(std::string_view piece);
  bool suffix() const { return suffix_; }
  std::size_t crossings() const { return count_; }
  // Whether the word end at norm[e] (0 < e < size) is a cut.
  bool cut(const char* norm, std::size_t e, std::size_t size) const {
    if (count_ == 0) return true;
    for (const Crossing& c : by_byte_[static_cast<unsigned char>(suffix_ ? norm[e] : norm[e - 1])])
      if (c.offset <= e && e - c.offset + c.piece.size() <= size &&
          std::memcmp(norm + e - c.offset, c.piece.data(), c.piece.size()) == 0)
        return false;
    return true;
  }

 private:
  static constexpr std::size_t kMaxCrossings = 1 << 16;
  struct Crossing {
    std::string piece;  // a copy: the model file's bytes go when the encoder is made
    std::size_t offset;
  };
  bool suffix_;
  std::size_t count_ = 0;
  std::vector<Crossing> by_byte_[256];
};

// A word's ids, kept from text to text (BPE models whose merges stay inside words): byte
// strings of at most kMaxKey bytes to up to kMaxKey ids and a byte of flags, in an
// open-addressing table that is emptied once it holds kMaxEntries words. One per thread.
class WordCache {
 public:
  static constexpr std::size_t kMaxKey = 255, kMaxEntries = std::size_t{1} << 16;
  struct Hit {
    const std::int32_t* ids;
    std::uint32_t size;
    std::uint8_t flags;
  };
  static std::uint64_t hash(const char* s, std::size_t n) {
    std::uint64_t h = 0x9e3779b97f4a7c15ull ^ (n * 0xff51afd7ed558ccdull);
    for (; n >= 8; s += 8, n -= 8) {
      std::uint64_t v;
      std::memcpy(&v, s, 8);
      h = (h ^ v) * 0xbf58476d1ce4e5b9ull;
      h ^= h >> 29;
    }
    if (n) {
      std::uint64_t v = 0;
      std::memcpy(&v, s, n);
      h = (h ^ v) * 0x94d049bb133111ebull;
    }
    h ^= h >> 32;
    return h * 0xd6e8feb86659fd93ull;
  }
  // Empties the cache when it was another encoder's (`owner`: an encoder's number, never reused).
  void claim(std::uint64_t owner) {
    if (owner_ != owner) clear();
    owner_ = owner;
  }
  bool find(std::string_view key, std::uint64_t h, Hit* hit) const {
    if (slots_.empty()) return false;
    for (std::size_t i = h & kMask;; i = (i + 1) & kMask) {
      const Slot& slot = slots_[i];
      if (slot.key_size == 0) return false;
      if (slot.tag == static_cast<std::uint32_t>(h >> 32) && slot.key_size == key.size() &&
          std::memcmp(keys_.data() + slot.key, key.data(), key.size()) == 0) {
        *hit = Hit{ids_.data() + slot.ids, slot.ids_size, slot.flags};
        return true;
      }
    }
  }
  // `key`: 1 to kMaxKey bytes, not in the cache; `n` <= kMaxKey ids.
  void insert(std::string_view key, std::uint64_t h, const std::int32_t* ids, std::size_t n, std::uint8_t flags) {
    if (slots_.empty()) slots_.resize(kMask + 1);
    if (entries_ >= kMaxEntries) clear();
    std::size_t i = h & kMask;
    while (slots_[i].key_size != 0) i = (i + 1) & kMask;
    slots_[i] = Slot{static_cast<std::uint32_t>(h >> 32), static_cast<std::uint32_t>(keys_.size()),
                     static_cast<std::uint32_t>(ids_.size()), static_cast<std::uint8_t>(key.size()),
                     static_cast<std::uint8_t>(n), flags};
    keys_.append(key);
    ids_.insert(ids_.end(), ids, ids + n);
    ++entries_;
  }
  void clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    ids_.clear();
    entries_ = 0;
  }

 private:
  static constexpr std::size_t kMask = kMaxEntries * 2 - 1;  // at most half full
  struct Slot {
    std::uint32_t tag = 0, key = 0, ids = 0;
    std::uint8_t key_size = 0, ids_size = 0, flags = 0;  // key_size 0: empty
  };
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<std::int32_t> ids_;
  std::size_t entries_ = 0;
  std::uint64_t owner_ = 0;
};

}  // namespace mpipe::spm
