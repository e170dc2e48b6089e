// SentencePiece models encoded by mpipe (include/mpipe/text/sentencepiece_encoder.hpp):
// the model file's protobuf read by hand, the normaliser over the precompiled charsmap,
// the pieces in double-array tries, the library's optimised Viterbi (unigram) and its
// merge loop (BPE). Each step follows libsentencepiece 0.1.97 (normalizer.cc,
// unigram_model.cc EncodeOptimized, bpe_model.cc SampleEncode, sentencepiece_processor.cc
// PopulateSentencePieceText); the unit tests compare the ids.
#include "mpipe/text/sentencepiece_encoder.hpp"

#include <algorithm>
#include <cfloat>
#include <cstdio>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <utility>

namespace mpipe {

namespace {

// ModelProto.SentencePiece.Type.
enum PieceType : std::uint8_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

// Protobuf's wire format, as far as a ModelProto needs: varints, 32- and 64-bit fixed
// fields, length-delimited fields. Any malformation makes ok() false.
class Wire {
 public:
  explicit Wire(std::string_view bytes)
      : p_(reinterpret_cast<const unsigned char*>(bytes.data())), end_(p_ + bytes.size()) {}
  bool more() const { return ok_ && p_ < end_; }
  bool ok() const { return ok_; }
  bool key(std::uint32_t* field, std::uint32_t* type) {
    std::uint64_t k = 0;
    if (!varint(&k)) return false;
    *field = static_cast<std::uint32_t>(k >> 3);
    *type = static_cast<std::uint32_t>(k & 7);
    return *field != 0 || fail();
  }
  bool varint(std::uint64_t* v) {
    std::uint64_t r = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ == end_) return fail();
      const unsigned char b = *p_++;
      r |= static_cast<std::uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) {
        *v = r;
        return true;
      }
    }
    return fail();
  }
  bool bytes(std::string_view* out) {
    std::uint64_t n = 0;
    if (!varint(&n)) return false;
    if (n > static_cast<std::uint64_t>(end_ - p_)) return fail();
    *out = std::string_view(reinterpret_cast<const char*>(p_), static_cast<std::size_t>(n));
    p_ += n;
    return true;
  }
  bool fixed32(std::uint32_t* v) {
    if (end_ - p_ < 4) return fail();
    *v = static_cast<std::uint32_t>(p_[0]) | static_cast<std::uint32_t>(p_[1]) << 8 |
         static_cast<std::uint32_t>(p_[2]) << 16 | static_cast<std::uint32_t>(p_[3]) << 24;
    p_ += 4;
    return true;
  }
  bool skip(std::uint32_t type) {
    std::uint64_t v = 0;
    std::uint32_t f = 0;
    std::string_view s;
    switch (type) {
      case 0: return varint(&v);
      case 1:
        if (end_ - p_ < 8) return fail();
        p_ += 8;
        return true;
      case 2: return bytes(&s);
      case 5: return fixed32(&f);
      default: return fail();  // groups: not in a ModelProto
    }
  }

 private:
  bool fail() {
    ok_ = false;
    return false;
  }
  const unsigned char* p_;
  const unsigned char* end_;
  bool ok_ = true;
};

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

// A message's fields; `on` reads a field it knows (true) or leaves it to be skipped (false).
template <class On>
bool read_message(std::string_view bytes, On on) {
  Wire w(bytes);
  while (w.more()) {
    std::uint32_t field = 0, type = 0;
    if (!w.key(&field, &type)) return false;
    if (!on(w, field, type) && !w.skip(type)) return false;
  }
  return w.ok();
}

bool read_bool(Wire& w, std::uint32_t type, bool* out) {
  std::uint64_t v = 0;
  if (type != 0 || !w.varint(&v)) return false;
  *out = v != 0;
  return true;
}

// Wire-type mismatches fail the read (the library's protobuf would refuse them too).
bool parse_proto(std::string_view bytes, Proto* proto) {
  bool good = true;
  const bool read = read_message(bytes, [&](Wire& w, std::uint32_t field, std::uint32_t type) {
    std::string_view sub;
    if (field < 1 || field > 3) return false;
    if (type != 2 || !w.bytes(&sub)) return good = false, true;
    if (field == 1) {
      ProtoPiece piece;
      good = good && read_message(sub, [&](Wire& p, std::uint32_t f, std::uint32_t t) {
        std::uint64_t v = 0;
        std::uint32_t bits = 0;
        if (f == 1) return (t == 2 && p.bytes(&piece.text)) || (good = false, true);
        if (f == 2) {
          if (t != 5 || !p.fixed32(&bits)) return good = false, true;
          std::memcpy(&piece.score, &bits, 4);
          return true;
        }
        if (f == 3) {
          if (t != 0 || !p.varint(&v)) return good = false, true;
          piece.type = static_cast<int>(static_cast<std::int64_t>(v));
          return true;
        }
        return false;
      });
      proto->pieces.push_back(piece);
    } else if (field == 2) {
      good = good && read_message(sub, [&](Wire& t, std::uint32_t f, std::uint32_t ty) {
        std::uint64_t v = 0;
        if (f == 3) {
          if (ty != 0 || !t.varint(&v)) return good = false, true;
          proto->model_type = static_cast<int>(static_cast<std::int64_t>(v));
          return true;
        }
        if (f == 24) return read_bool(t, ty, &proto->treat_whitespace_as_suffix) || (good = false, true);
        if (f == 35) return read_bool(t, ty, &proto->byte_fallback) || (good = false, true);
        return false;
      });
    } else {
      good = good && read_message(sub, [&](Wire& n, std::uint32_t f, std::uint32_t ty) {
        if (f == 2) return (ty == 2 && n.bytes(&proto->charsmap)) || (good = false, true);
        if (f == 3) return read_bool(n, ty, &proto->add_dummy_prefix) || (good = false, true);
        if (f == 4) return read_bool(n, ty, &proto->remove_extra_whitespaces) || (good = false, true);
        if (f == 5) return read_bool(n, ty, &proto->escape_whitespaces) || (good = false, true);
        return false;
      });
    }
    return true;
  });
  return read && good;
}

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
  void build(std::vector<TrieKey> keys) {
    std::sort(keys.begin(), keys.end());
    // A pointer trie first, its children in byte order (the keys are sorted).
    struct Node {
      std::vector<std::pair<unsigned char, std::int32_t>> kids;
      std::int32_t value = -1;
      double score = std::numeric_limits<double>::quiet_NaN();
    };
    std::vector<Node> nodes(1);
    for (const auto& [key, value, score] : keys) {
      std::int32_t n = 0;
      for (const char ch : key) {
        const auto c = static_cast<unsigned char>(ch);
        auto& kids = nodes[static_cast<std::size_t>(n)].kids;
        if (kids.empty() || kids.back().first != c) {
          kids.emplace_back(c, static_cast<std::int32_t>(nodes.size()));
          nodes.emplace_back();
        }
        n = nodes[static_cast<std::size_t>(n)].kids.back().second;
      }
      nodes[static_cast<std::size_t>(n)].value = value;
      nodes[static_cast<std::size_t>(n)].score = score;
    }
    // Then the double array, breadth first: each node's children at base + byte. The
    // array always reaches 256 past every base (a leaf's is 0), so base + byte is inside.
    units_.assign(256, Unit{});
    units_[0].check = -2;
    values_.assign(units_.size(), -1);
    // Free slots found in order through `next`: next[i] == i marks i free, else points
    // further on (path-compressed), so a base search steps over the filled parts.
    std::vector<std::size_t> next(units_.size());
    for (std::size_t i = 0; i < next.size(); ++i) next[i] = i;
    next[0] = 1;
    auto first_free_from = [&](std::size_t i) {
      std::size_t r = i;
      while (r < next.size() && next[r] != r) r = next[r];
      while (i < next.size() && next[i] != i) {
        const std::size_t t = next[i];
        next[i] = r;
        i = t;
      }
      return r;
    };
    auto grow = [&](std::size_t size) {
      if (units_.size() >= size) return;
      const std::size_t old = units_.size();
      units_.resize(std::max(size, old + old / 2), Unit{});
      next.resize(units_.size());
      values_.resize(units_.size(), -1);
      for (std::size_t i = old; i < next.size(); ++i) next[i] = i;
    };
    std::size_t last_used = 0;
    std::vector<std::pair<std::int32_t, std::int32_t>> queue{{0, 0}};  // (pointer node, unit)
    for (std::size_t q = 0; q < queue.size(); ++q) {
      const auto [n, u] = queue[q];
      const auto& kids = nodes[static_cast<std::size_t>(n)].kids;
      if (kids.empty()) continue;
      // The first base >= 1 whose slots are all free, looking at the free slots for the
      // first child; after 256 misses, past the last slot in use.
      std::size_t slot = first_free_from(kids[0].first + 1u), base = 0;
      for (int misses = 0;; ++misses) {
        base = slot - kids[0].first;
        grow(base + 256);
        bool fits = true;
        for (const auto& kid : kids)
          if (units_[base + kid.first].check != -1) {
            fits = false;
            break;
          }
        if (fits) break;
        slot = misses < 256 ? first_free_from(slot + 1) : last_used + 1 + kids[0].first;
      }
      units_[static_cast<std::size_t>(u)].base = static_cast<std::int32_t>(base);
      for (const auto& [c, child] : kids) {
        Unit& unit = units_[base + c];
        unit.check = u;
        unit.score = nodes[static_cast<std::size_t>(child)].score;
        values_[base + c] = nodes[static_cast<std::size_t>(child)].value;
        next[base + c] = base + c + 1;
        last_used = std::max(last_used, base + c);
        queue.emplace_back(child, static_cast<std::int32_t>(base + c));
      }
    }
  }
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
  bool load(std::string_view blob) {
    if (blob.empty()) return true;
    if (blob.size() <= 4) return false;
    std::uint32_t trie_bytes = 0;
    std::memcpy(&trie_bytes, blob.data(), 4);  // little-endian, as the file stores it (x86, aarch64)
    if (trie_bytes >= blob.size()) return false;
    blob.remove_prefix(4);
    if (trie_bytes > blob.size()) return false;
    units_.resize(trie_bytes / 4);
    if (!units_.empty()) std::memcpy(units_.data(), blob.data(), units_.size() * 4);
    strings_.assign(blob.substr(trie_bytes));
    return true;
  }
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
  std::size_t longest(const char* s, std::size_t n, std::string_view* out) const {
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

 private:
  static std::size_t offset(std::uint32_t unit) { return (unit >> 10) << ((unit & (1u << 9)) >> 6); }
  static std::uint32_t label(std::uint32_t unit) { return unit & ((1u << 31) | 0xff); }
  std::vector<std::uint32_t> units_;
  std::string strings_;
};

struct BestPath {
  float score;
  std::int32_t starts_at;
  std::int32_t id;
};

// A byte buffer that grows and is never cleared or filled (std::string's resize would
// write every byte).
class Bytes {
 public:
  char* data() { return data_.get(); }
  // Room for `need` bytes, the first `used` kept.
  char* reserve(std::size_t need, std::size_t used) {
    if (need > capacity_) {
      const std::size_t capacity = std::max(need, capacity_ * 2);
      std::unique_ptr<char[]> grown(new char[capacity]);
      if (used) std::memcpy(grown.get(), data_.get(), used);
      data_ = std::move(grown);
      capacity_ = capacity;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<char[]> data_;
  std::size_t capacity_ = 0;
};

// Each thread's work buffers, kept from call to call.
struct Symbol {  // BPE: a run of the normalised text, merged or not
  std::int32_t prev, next, start, size;
  std::int32_t node;  // its bytes' node in the pieces trie, or -1
  bool freeze;        // a user-defined piece: never merged
};
struct SymbolPair {  // BPE: two neighbours whose concatenation is a piece
  std::int32_t left, right, size, node;
  float score;
};
// bpe_model.cc's SymbolPairComparator: the highest score first, then the leftmost.
inline bool pair_less(const SymbolPair& a, const SymbolPair& b) {
  return a.score < b.score || (a.score == b.score && a.left > b.left);
}

struct Scratch {
  Bytes normalized;
  std::vector<BestPath> best;
  std::vector<std::pair<std::int32_t, std::int32_t>> path;  // (start, id), last piece first
  std::vector<Symbol> symbols;
  std::vector<SymbolPair> agenda;  // a heap by pair_less
  // BPE's rev_merge: an UNUSED piece's last-seen halves, to split it back.
  std::unordered_map<std::string_view, std::pair<std::string_view, std::string_view>> rev_merge;
};

constexpr std::size_t kMaxNormalized = static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()) - 1;

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}


}  // namespace

struct SentencePieceEncoder::Model {
  // Pieces.
  Trie pieces;  // NORMAL and USER_DEFINED pieces and their scores (UNUSED ones, which the library skips, left out)
  std::vector<std::uint8_t> type;
  float min_score = FLT_MAX, max_score = FLT_MIN;  // over NORMAL pieces, the library's initial values
  std::int32_t unk_id = -1;
  bool byte_fallback = false;
  std::int32_t byte_id[256] = {};
  // BPE models (model_type BPE): merges by the pieces' scores.
  bool bpe = false, has_unused = false;
  Trie bpe_pieces;       // the library's pieces_: NORMAL, USER_DEFINED and UNUSED pieces, id values
  Trie reserved_pieces;  // its reserved_id_map_: UNKNOWN, CONTROL and BYTE pieces
  std::vector<float> score;  // per id
  // Normaliser.
  Charsmap charsmap;
  Trie user_defined;  // the library's PrefixMatcher: user-defined pieces pass unnormalised
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
  bool whitespace_as_suffix = false;  // the trainer's treat_whitespace_as_suffix: the dummy space goes last
  bool plain[128] = {};       // ASCII bytes that normalise to themselves alone
  bool before_ascii[128] = {};  // ASCII bytes that do so before an ASCII byte or the end

  // Normalizer::NormalizePrefix: the normalised form of the text's first unit and the
  // bytes it takes.
  std::string_view prefix(const char* s, std::size_t n, std::size_t* consumed) const {
    if (!user_defined.empty()) {
      const std::size_t len = user_defined.longest_prefix(s, n, 64);  // PrefixMatcher's kResultSize
      if (len > 0) {
        *consumed = len;
        return {s, len};
      }
    }
    std::string_view out;
    if (const std::size_t len = charsmap.longest(s, n, &out); len > 0) {
      *consumed = len;
      return out;
    }
    const std::size_t len = valid_utf8_len(reinterpret_cast<const unsigned char*>(s), n);
    if (len == 0) {
      *consumed = 1;
      return kReplacement;
    }
    *consumed = len;
    return {s, len};
  }

  // Normalizer::Normalize, without the offsets back into the input: the normalised text
  // in buf, its length returned.
  std::size_t normalize(std::string_view input, Bytes& buf) const {
    if (input.empty()) return 0;
    std::size_t consumed = 0;
    if (remove_extra_whitespaces)
      while (!input.empty()) {
        const std::string_view p = prefix(input.data(), input.size(), &consumed);
        if (p != " ") break;
        input.remove_prefix(consumed);
      }
    if (input.empty()) return 0;
    const char* in = input.data();
    const char* const end = in + input.size();
    // The buffer always has room for 3 bytes per input byte left, and 3 more: an ASCII
    // byte writes at most 3 (an escaped space), so the common path checks nothing.
    char* out = buf.reserve(input.size() * 3 + 3, 0);
    std::size_t n = 0;
    const char* const space = escape_whitespaces ? kSpaceSymbol.data() : " ";
    const std::size_t space_size = escape_whitespaces ? kSpaceSymbol.size() : 1;
    auto put_space = [&] {
      std::memcpy(out + n, space, space_size);
      n += space_size;
    };
    if (add_dummy_prefix && !whitespace_as_suffix) put_space();
    bool prev_space = remove_extra_whitespaces;
    while (in < end) {
      const auto b = static_cast<unsigned char>(*in);
      // The common case: an ASCII byte no rule or user-defined symbol touches.
      if (b < 0x80 && (plain[b] || (before_ascii[b] && (in + 1 == end || static_cast<unsigned char>(in[1]) < 0x80)))) {
        if (b == ' ') {
          if (!prev_space) put_space();
          prev_space = remove_extra_whitespaces;
        } else {
          out[n++] = static_cast<char>(b);
          prev_space = false;
        }
        ++in;
        continue;
      }
      std::string_view sp = prefix(in, static_cast<std::size_t>(end - in), &consumed);
      in += consumed;
      out = buf.reserve(n + sp.size() * 3 + static_cast<std::size_t>(end - in) * 3 + 3, n);
      if (prev_space)
        while (!sp.empty() && sp[0] == ' ') sp.remove_prefix(1);
      if (!sp.empty()) {
        for (const char c : sp) {
          if (c == ' ' && escape_whitespaces)
            put_space();
          else
            out[n++] = c;
        }
        prev_space = sp.back() == ' ';
      }
      if (!remove_extra_whitespaces) prev_space = false;
    }
    if (remove_extra_whitespaces)
      while (n >= space_size && std::memcmp(out + n - space_size, space, space_size) == 0) n -= space_size;
    if (add_dummy_prefix && whitespace_as_suffix) put_space();
    return n;
  }

  // unigram::Model::EncodeOptimized and PopulateSentencePieceText's ids.
  // False (nothing appended) for a text whose normalised form passes 2^31 - 2 bytes: the
  // library's int positions; left to it.
  bool encode(std::string_view text, std::vector<std::int32_t>* ids) const {
    Scratch& s = scratch();
    const std::size_t normalized = normalize(text, s.normalized);
    if (normalized > kMaxNormalized) return false;
    const auto size = static_cast<std::int32_t>(normalized);
    if (size == 0) return true;
    const auto* const bytes = reinterpret_cast<const unsigned char*>(s.normalized.data());
    const float unk_score = min_score - 10.0f;  // kUnkPenalty
    s.best.assign(static_cast<std::size_t>(size) + 1, BestPath{0.0f, -1, -1});
    BestPath* const best = s.best.data();
    const Trie::Unit* const units = pieces.units();
    const std::int32_t* const values = pieces.values();
    for (std::int32_t starts_at = 0; starts_at < size;) {
      const float till_here = best[starts_at].score;
      const std::int32_t mblen = std::min<std::int32_t>(one_char_len(bytes[starts_at]), size - starts_at);
      bool has_single_node = false;
      std::int32_t node = 0;
      for (std::int32_t key_pos = starts_at; key_pos < size;) {
        const std::int32_t next = units[node].base + bytes[key_pos++];
        if (units[next].check != node) break;
        node = next;
        // The library's `IsUserDefined ? length * max_score_ - 0.1 : score` is a double (a
        // user-defined piece's a float product then double, by its length: kept in the trie
        // so), added to the float best score in double, compared in double, kept as float.
        const double piece_score = units[node].score;
        if (piece_score != piece_score) continue;  // NaN: no piece ends here
        BestPath& target = best[key_pos];
        const std::int32_t length = key_pos - starts_at;
        const double candidate = piece_score + static_cast<double>(till_here);
        if (target.starts_at == -1 || candidate > static_cast<double>(target.score))
          target = BestPath{static_cast<float>(candidate), starts_at, values[node]};
        if (length == mblen) has_single_node = true;
      }
      if (!has_single_node) {
        BestPath& target = best[starts_at + mblen];
        const float candidate = unk_score + till_here;
        if (target.starts_at == -1 || candidate > target.score) target = BestPath{candidate, starts_at, unk_id};
      }
      starts_at += mblen;
    }
    s.path.clear();
    for (std::int32_t ends_at = size; ends_at > 0; ends_at = best[ends_at].starts_at)
      s.path.emplace_back(best[ends_at].starts_at, best[ends_at].id);
    bool prev_unknown = false;
    for (auto it = s.path.rbegin(); it != s.path.rend(); ++it) {
      const std::int32_t end = it + 1 == s.path.rend() ? size : (it + 1)->first;
      emit(bytes + it->first, end - it->first, it->second, &prev_unknown, ids);
    }
    return true;
  }

  // PopulateSentencePieceText's ids for one piece: an unknown piece's bytes' pieces with
  // byte fallback, else a run of unknown pieces is one.
  void emit(const unsigned char* piece, std::int32_t size, std::int32_t id, bool* prev_unknown,
            std::vector<std::int32_t>* ids) const {
    const bool unknown = type[static_cast<std::size_t>(id)] == kUnknown;
    if (unknown && byte_fallback) {
      for (std::int32_t i = 0; i < size; ++i) ids->push_back(byte_id[piece[i]]);
    } else if (!(unknown && *prev_unknown)) {
      ids->push_back(id);
    }
    *prev_unknown = unknown;
  }

  // ModelInterface::PieceToId.
  std::int32_t piece_id(const char* piece, std::size_t size) const {
    if (const std::int32_t id = reserved_pieces.exact(piece, size); id >= 0) return id;
    if (const std::int32_t id = bpe_pieces.exact(piece, size); id >= 0) return id;
    return unk_id;
  }

  // bpe::Model::SampleEncode without dropout (Encode), then the ids. False where a piece
  // comes out a control symbol, which the library then refuses: the caller asks it.
  bool encode_bpe(std::string_view text, std::vector<std::int32_t>* ids) const {
    Scratch& s = scratch();
    const std::size_t normalized = normalize(text, s.normalized);
    if (normalized > kMaxNormalized) return false;
    const auto size = static_cast<std::int32_t>(normalized);
    if (size == 0) return true;
    const char* const norm = s.normalized.data();
    // One symbol per character, or per user-defined piece (frozen).
    auto& symbols = s.symbols;
    symbols.clear();
    for (std::int32_t pos = 0; pos < size;) {
      const auto rest = static_cast<std::size_t>(size - pos);
      std::size_t len = user_defined.empty() ? 0 : user_defined.longest_prefix(norm + pos, rest, 64);
      const bool freeze = len > 0;
      if (!freeze) len = std::min<std::size_t>(one_char_len(static_cast<unsigned char>(norm[pos])), rest);
      const auto index = static_cast<std::int32_t>(symbols.size());
      symbols.push_back({index - 1, pos + static_cast<std::int32_t>(len) < size ? index + 1 : -1, pos,
                         static_cast<std::int32_t>(len), bpe_pieces.walk(0, norm + pos, len), freeze});
      pos += static_cast<std::int32_t>(len);
    }
    auto& agenda = s.agenda;
    agenda.clear();
    if (has_unused) s.rev_merge.clear();
    auto add_pair = [&](std::int32_t left, std::int32_t right) {
      if (left == -1 || right == -1 || symbols[static_cast<std::size_t>(left)].freeze ||
          symbols[static_cast<std::size_t>(right)].freeze)
        return;
      const Symbol& l = symbols[static_cast<std::size_t>(left)];
      const Symbol& r = symbols[static_cast<std::size_t>(right)];
      if (l.node < 0) return;  // the concatenation's walk goes through the left symbol's node
      const std::int32_t node = bpe_pieces.walk(l.node, norm + r.start, static_cast<std::size_t>(r.size));
      const std::int32_t id = node >= 0 ? bpe_pieces.value(node) : -1;
      if (id < 0) return;
      agenda.push_back({left, right, l.size + r.size, node, score[static_cast<std::size_t>(id)]});
      std::push_heap(agenda.begin(), agenda.end(), pair_less);
      if (type[static_cast<std::size_t>(id)] == kUnused)
        s.rev_merge[std::string_view(norm + l.start, static_cast<std::size_t>(l.size + r.size))] = {
            std::string_view(norm + l.start, static_cast<std::size_t>(l.size)),
            std::string_view(norm + r.start, static_cast<std::size_t>(r.size))};
    };
    for (std::int32_t i = 1; i < static_cast<std::int32_t>(symbols.size()); ++i) add_pair(i - 1, i);
    while (!agenda.empty()) {
      std::pop_heap(agenda.begin(), agenda.end(), pair_less);
      const SymbolPair top = agenda.back();
      agenda.pop_back();
      Symbol& l = symbols[static_cast<std::size_t>(top.left)];
      Symbol& r = symbols[static_cast<std::size_t>(top.right)];
      if (l.size == 0 || r.size == 0 || l.size + r.size != top.size) continue;  // no longer there
      l.size += r.size;
      l.node = top.node;
      l.next = r.next;
      if (r.next >= 0) symbols[static_cast<std::size_t>(r.next)].prev = top.left;
      r.size = 0;
      add_pair(l.prev, top.left);
      add_pair(top.left, symbols[static_cast<std::size_t>(top.left)].next);
    }
    // The symbols' ids; an UNUSED piece split back into the halves it was made of.
    bool prev_unknown = false, control = false;
    auto resegment = [&](auto& self, std::string_view piece) -> void {
      const std::int32_t id = piece_id(piece.data(), piece.size());
      if (type[static_cast<std::size_t>(id)] == kUnused) {
        if (const auto it = s.rev_merge.find(piece); it != s.rev_merge.end()) {
          const auto halves = it->second;
          self(self, halves.first);
          self(self, halves.second);
          return;
        }
      }
      control = control || type[static_cast<std::size_t>(id)] == kControl;
      emit(reinterpret_cast<const unsigned char*>(piece.data()), static_cast<std::int32_t>(piece.size()), id,
           &prev_unknown, ids);
    };
    for (std::int32_t i = 0; i != -1; i = symbols[static_cast<std::size_t>(i)].next) {
      const Symbol& sym = symbols[static_cast<std::size_t>(i)];
      resegment(resegment, std::string_view(norm + sym.start, static_cast<std::size_t>(sym.size)));
    }
    return !control;
  }
};

SentencePieceEncoder::SentencePieceEncoder(std::unique_ptr<Model> model) : model_(std::move(model)) {}
SentencePieceEncoder::~SentencePieceEncoder() = default;

std::unique_ptr<SentencePieceEncoder> SentencePieceEncoder::from_model(std::string_view bytes, std::string* why) {
  Proto proto;
  auto refuse = [&](const char* reason) {
    if (why) *why = reason;
    return std::unique_ptr<SentencePieceEncoder>();
  };
  if (!parse_proto(bytes, &proto)) return refuse("the model file does not parse");
  if (proto.model_type != 1 && proto.model_type != 2) return refuse("neither a unigram nor a BPE model");
  if (proto.pieces.empty()) return refuse("no pieces");

  auto m = std::make_unique<Model>();
  const std::size_t n = proto.pieces.size();
  if (n >= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) return refuse("too many pieces");
  m->type.resize(n);
  std::vector<TrieKey> trie_keys, user_keys;
  bool any_matchable = false;  // the library's trie holds UNUSED pieces too, and must not be empty
  std::unordered_map<std::string_view, std::int32_t> reserved, normal;  // the library's PieceToId
  for (std::size_t i = 0; i < n; ++i) {
    const ProtoPiece& p = proto.pieces[i];
    const auto id = static_cast<std::int32_t>(i);
    if (p.text.empty() || p.type < kNormal || p.type > kByte) return refuse("a piece the library refuses");
    if (p.text.find('\0') != std::string_view::npos) return refuse("a piece with a NUL byte");
    m->type[i] = static_cast<std::uint8_t>(p.type);
    const bool is_normal = p.type == kNormal || p.type == kUserDefined || p.type == kUnused;
    if (!(is_normal ? normal : reserved).emplace(p.text, id).second) return refuse("a piece defined twice");
    any_matchable = any_matchable || is_normal;
    if (p.score != p.score) return refuse("a piece scored NaN");
    if (p.type == kUserDefined) user_keys.push_back({p.text, id, 0.0});
    if (p.type == kUnknown) {
      if (m->unk_id >= 0) return refuse("two unknown pieces");
      m->unk_id = id;
    }
    if (p.type == kNormal) {
      m->min_score = std::min(m->min_score, p.score);
      m->max_score = std::max(m->max_score, p.score);
    }
  }
  if (m->unk_id < 0) return refuse("no unknown piece");
  m->bpe = proto.model_type == 2;
  if (!any_matchable && !m->bpe) return refuse("no pieces to match");
  for (std::size_t i = 0; i < n; ++i) {
    const ProtoPiece& p = proto.pieces[i];
    if (p.type == kNormal) trie_keys.push_back({p.text, static_cast<std::int32_t>(i), static_cast<double>(p.score)});
    if (p.type == kUserDefined)  // the library's bonus, `length * max_score_ - 0.1`
      trie_keys.push_back({p.text, static_cast<std::int32_t>(i),
                           static_cast<double>(static_cast<float>(p.text.size()) * m->max_score) - 0.1});
  }
  m->byte_fallback = proto.byte_fallback;
  for (int b = 0; b < 256; ++b) {
    char piece[8];
    std::snprintf(piece, sizeof piece, "<0x%02X>", b);
    if (auto it = reserved.find(piece); it != reserved.end())
      m->byte_id[b] = it->second;
    else if (auto jt = normal.find(piece); jt != normal.end())
      m->byte_id[b] = jt->second;
    else
      m->byte_id[b] = m->unk_id;
  }
  if (m->bpe) {
    std::vector<TrieKey> normal_keys, reserved_keys;
    m->score.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const ProtoPiece& p = proto.pieces[i];
      const bool is_normal = p.type == kNormal || p.type == kUserDefined || p.type == kUnused;
      (is_normal ? normal_keys : reserved_keys).push_back({p.text, static_cast<std::int32_t>(i), 0.0});
      m->score[i] = p.score;
      m->has_unused = m->has_unused || p.type == kUnused;
    }
    m->bpe_pieces.build(std::move(normal_keys));
    m->reserved_pieces.build(std::move(reserved_keys));
  } else {
    m->pieces.build(std::move(trie_keys));
  }
  if (!user_keys.empty()) m->user_defined.build(std::move(user_keys));
  if (!m->charsmap.load(proto.charsmap)) return refuse("a broken precompiled charsmap");
  m->add_dummy_prefix = proto.add_dummy_prefix;
  m->remove_extra_whitespaces = proto.remove_extra_whitespaces;
  m->escape_whitespaces = proto.escape_whitespaces;
  m->whitespace_as_suffix = proto.treat_whitespace_as_suffix;
  for (int b = 0; b < 128; ++b) {
    const auto c = static_cast<unsigned char>(b);
    const bool no_symbol = m->user_defined.empty() || m->user_defined.child(0, c) < 0;
    m->plain[b] = !m->charsmap.starts_rule(c) && no_symbol;
    m->before_ascii[b] = m->charsmap.ascii_before_ascii_safe(c) && no_symbol;
  }
  return std::unique_ptr<SentencePieceEncoder>(new SentencePieceEncoder(std::move(m)));
}

bool SentencePieceEncoder::encode(std::string_view text, std::vector<std::int32_t>* ids) const {
  if (model_->bpe) return model_->encode_bpe(text, ids);
  return model_->encode(text, ids);
}

bool SentencePieceEncoder::is_bpe() const { return model_->bpe; }

void SentencePieceEncoder::normalize(std::string_view text, std::string* out) const {
  Bytes buf;
  const std::size_t n = model_->normalize(text, buf);
  out->assign(n ? buf.data() : "", n);
}

}  // namespace mpipe
