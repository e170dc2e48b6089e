// The SentencePiece model file's parts (include/mpipe/text/sentencepiece_model.hpp): the
// protobuf wire reader and the ModelProto's fields, the pieces trie's construction, and
// the precompiled charsmap's layout.
#include "mpipe/text/sentencepiece_model.hpp"

namespace mpipe::spm {

namespace {

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

}  // namespace

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
void Trie::build(std::vector<TrieKey> keys) {
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

bool Charsmap::load(std::string_view blob) {
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

bool WordEnds::add(std::string_view piece) {
  // With whitespace first a word ends before a U+2581 that follows another character; a
  // piece crosses it at an offset where U+2581 (or its cut start, at the piece's end)
  // begins. Conservatively every such offset past 0, the leading run's too; a piece with
  // U+2581 only in a run at its start and no cut one at its end has none it can cross
  // (nor, with whitespace as a suffix, one with them only in a run at its end).
  std::string_view core = piece;
  if (!suffix_) {
    while (core.substr(0, 3) == kSpaceSymbol) core.remove_prefix(3);
    if (core.find(kSpaceSymbol) == std::string_view::npos && !core.ends_with("\xe2") && !core.ends_with("\xe2\x96"))
      return true;
    for (std::size_t o = 1; o < piece.size(); ++o)
      if (kSpaceSymbol.starts_with(piece.substr(o, 3))) {
        if (++count_ > kMaxCrossings) return false;
        by_byte_[static_cast<unsigned char>(piece[o - 1])].push_back({std::string(piece), o});
      }
    return true;
  }
  while (core.size() >= 3 && core.substr(core.size() - 3) == kSpaceSymbol) core.remove_suffix(3);
  if (core.find(kSpaceSymbol) == std::string_view::npos && !core.starts_with("\x81") && !core.starts_with("\x96\x81"))
    return true;
  // A word ends after a U+2581 before another character: offsets where one (or its cut end,
  // at the piece's start) ends.
  for (std::size_t o = 1; o < piece.size(); ++o)
    if (kSpaceSymbol.ends_with(piece.substr(o >= 3 ? o - 3 : 0, o >= 3 ? 3 : o))) {
      if (++count_ > kMaxCrossings) return false;
      by_byte_[static_cast<unsigned char>(piece[o])].push_back({std::string(piece), o});
    }
  return true;
}

}  // namespace mpipe::spm
