// SentencePiece models encoded by mpipe (include/mpipe/text/sentencepiece_encoder.hpp):
// the normaliser over the model's precompiled charsmap, the pieces in double-array tries
// (text/sentencepiece_model: the file's parts), the library's optimised Viterbi (unigram) and its
// merge loop (BPE). Each step follows libsentencepiece 0.1.97 (normalizer.cc,
// unigram_model.cc EncodeOptimized, bpe_model.cc SampleEncode, sentencepiece_processor.cc
// PopulateSentencePieceText); the unit tests compare the ids.
#include "mpipe/text/sentencepiece_encoder.hpp"
#include "mpipe/text/sentencepiece_model.hpp"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdio>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <utility>

namespace mpipe {

using namespace spm;  // the model file's parts (this file's own names stay in mpipe)

namespace {

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
  bool clamped = false;  // BPE: the last merge's text ended inside a character
  WordCache words;       // BPE by words: the words' ids (the encoder's cache_owner's)
  std::vector<std::int32_t> word_ids;
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
  // No UNUSED piece (their halves are the whole text's), spaces escaped, and not too many
  // pieces that could cross a word's end (a run of U+2581 and what follows): BPE from cut
  // to cut (word_ends), each span's ids cached per thread under cache_owner.
  bool by_words = false;
  WordEnds word_ends;
  std::uint64_t cache_owner = 0;
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

  // `text` normalised into s.normalized, its size in *size; false (left to the library)
  // past 2^31 - 2 bytes, the library's int positions.
  bool normalize_into(std::string_view text, Scratch& s, std::int32_t* size) const {
    const std::size_t normalized = normalize(text, s.normalized);
    if (normalized > kMaxNormalized) return false;
    *size = static_cast<std::int32_t>(normalized);
    return true;
  }

  // unigram::Model::EncodeOptimized and PopulateSentencePieceText's ids.
  // False (nothing appended) for a text whose normalised form passes 2^31 - 2 bytes: the
  // library's int positions; left to it.
  bool encode(std::string_view text, std::vector<std::int32_t>* ids) const {
    Scratch& s = scratch();
    std::int32_t size = 0;
    if (!normalize_into(text, s, &size)) return false;
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

  // bpe::Model::SampleEncode's symbols and merges (no dropout) over norm[begin, end) of a
  // normalised text of `size` bytes: the symbols' list in s.symbols from index 0. False
  // where a character or user-defined piece passes `end` (a word that is not one).
  bool merge(Scratch& s, const char* norm, std::int32_t begin, std::int32_t end, std::int32_t size) const {
    // One symbol per character, or per user-defined piece (frozen).
    auto& symbols = s.symbols;
    symbols.clear();
    s.clamped = false;
    for (std::int32_t pos = begin; pos < end;) {
      const auto rest = static_cast<std::size_t>(size - pos);
      std::size_t len = user_defined.empty() ? 0 : user_defined.longest_prefix(norm + pos, rest, 64);
      const bool freeze = len > 0;
      if (!freeze) {
        len = static_cast<std::size_t>(one_char_len(static_cast<unsigned char>(norm[pos])));
        if (len > rest) len = rest, s.clamped = true;  // a character cut by the text's end
      }
      if (pos + static_cast<std::int32_t>(len) > end) return false;
      const auto index = static_cast<std::int32_t>(symbols.size());
      symbols.push_back({index - 1, pos + static_cast<std::int32_t>(len) < end ? index + 1 : -1, pos,
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
    return true;
  }

  // The ids of s.symbols' list (an UNUSED piece split back into the halves it was made
  // of), after *prev_unknown; false where a piece is a control symbol. *first_unknown:
  // whether the first piece was unknown.
  bool symbol_ids(Scratch& s, const char* norm, bool* prev_unknown, bool* first_unknown,
                  std::vector<std::int32_t>* ids) const {
    bool control = false, first = true;
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
      if (first) *first_unknown = type[static_cast<std::size_t>(id)] == kUnknown;
      first = false;
      emit(reinterpret_cast<const unsigned char*>(piece.data()), static_cast<std::int32_t>(piece.size()), id,
           prev_unknown, ids);
    };
    for (std::int32_t i = 0; i != -1 && !s.symbols.empty(); i = s.symbols[static_cast<std::size_t>(i)].next) {
      const Symbol& sym = s.symbols[static_cast<std::size_t>(i)];
      resegment(resegment, std::string_view(norm + sym.start, static_cast<std::size_t>(sym.size)));
    }
    return !control;
  }

  // Where the word at norm[begin, size) ends: with whitespace first (the default), a run
  // of U+2581 and what follows up to the next U+2581; as a suffix, up to a U+2581 and the
  // run it starts.
  std::int32_t word_end(const char* norm, std::int32_t begin, std::int32_t size) const {
    auto is_space = [&](std::int32_t p) { return size - p >= 3 && std::memcmp(norm + p, kSpaceSymbol.data(), 3) == 0; };
    auto next_space = [&](std::int32_t p) {
      while (p < size) {
        const void* hit = std::memchr(norm + p, '\xe2', static_cast<std::size_t>(size - p));
        if (!hit) return size;
        p = static_cast<std::int32_t>(static_cast<const char*>(hit) - norm);
        if (is_space(p)) return p;
        ++p;
      }
      return size;
    };
    std::int32_t p = begin;
    do {  // to the next word's end that no piece spelt in the text crosses
      if (!whitespace_as_suffix) {
        while (is_space(p)) p += 3;
        p = next_space(p);
      } else {
        p = next_space(p);
        while (is_space(p)) p += 3;
      }
    } while (p < size && !word_ends.cut(norm, static_cast<std::size_t>(p), static_cast<std::size_t>(size)));
    return p;
  }

  // bpe::Model::SampleEncode without dropout (Encode), then the ids. False where a piece
  // comes out a control symbol, which the library then refuses: the caller asks it.
  // Where no merge can cross a word's end (by_words), word by word, each word's ids kept.
  bool encode_bpe(std::string_view text, std::vector<std::int32_t>* ids) const {
    Scratch& s = scratch();
    std::int32_t size = 0;
    if (!normalize_into(text, s, &size)) return false;
    if (size == 0) return true;
    const char* const norm = s.normalized.data();
    bool prev_unknown = false, first_unknown = false;
    if (by_words) {
      const std::size_t before = ids->size();
      s.words.claim(cache_owner);
      for (std::int32_t begin = 0, end; begin < size; begin = end) {
        end = word_end(norm, begin, size);
        const std::string_view word(norm + begin, static_cast<std::size_t>(end - begin));
        const bool cacheable = word.size() <= WordCache::kMaxKey;
        const std::uint64_t h = cacheable ? WordCache::hash(word.data(), word.size()) : 0;
        WordCache::Hit hit;
        if (!cacheable || !s.words.find(word, h, &hit)) {
          // A word's pieces cannot pass its end; a character (a malformed text) could.
          if (!merge(s, norm, begin, end, size)) break;
          s.word_ids.clear();
          bool last_unknown = false;
          if (!symbol_ids(s, norm, &last_unknown, &first_unknown, &s.word_ids)) return false;
          hit = WordCache::Hit{s.word_ids.data(), static_cast<std::uint32_t>(s.word_ids.size()),
                    static_cast<std::uint8_t>(first_unknown | last_unknown << 1)};
          if (cacheable && s.word_ids.size() <= WordCache::kMaxKey && !s.clamped)
            s.words.insert(word, h, hit.ids, hit.size, hit.flags);
        }
        // A run of unknown pieces across words is one unknown piece, as in the whole text.
        const std::uint32_t skip = prev_unknown && (hit.flags & 1) && !byte_fallback ? 1 : 0;
        ids->insert(ids->end(), hit.ids + skip, hit.ids + hit.size);
        prev_unknown = (hit.flags & 2) != 0;
        if (end == size) return true;
      }
      ids->resize(before);  // a character across a word's end: the whole text
      prev_unknown = false;
    }
    merge(s, norm, 0, size, size);
    return symbol_ids(s, norm, &prev_unknown, &first_unknown, ids);
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
    m->by_words = !m->has_unused && proto.escape_whitespaces;
    m->word_ends = WordEnds(proto.treat_whitespace_as_suffix);
    for (std::size_t i = 0; i < n && m->by_words; ++i) {
      const ProtoPiece& p = proto.pieces[i];
      if (p.type == kNormal || p.type == kUserDefined || p.type == kUnused) m->by_words = m->word_ends.add(p.text);
    }
    static std::atomic<std::uint64_t> encoders{0};
    m->cache_owner = ++encoders;
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

bool SentencePieceEncoder::bpe_by_words() const { return model_->bpe && model_->by_words; }

void SentencePieceEncoder::normalize(std::string_view text, std::string* out) const {
  Bytes buf;
  const std::size_t n = model_->normalize(text, buf);
  out->assign(n ? buf.data() : "", n);
}

}  // namespace mpipe
