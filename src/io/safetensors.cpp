// Writing and reading safetensors files: the 8-byte header length, the JSON header and
// the raw tensors, every claim of a file read checked against the file; float16 and
// bfloat16 read as float32; a sharded checkpoint's index and its shards.
#include "mpipe/io/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <unistd.h>

#include "mpipe/core/file_kind.hpp"
#include "mpipe/io/json.hpp"

namespace mpipe {

namespace fs = std::filesystem;

namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian, written as it lies in memory");

// A header longer than this is not one mpipe wrote or would read (the Hub's reader
// refuses over 100 MB too): a corrupt length is said, not allocated.
constexpr std::uint64_t max_header_bytes = 100'000'000;
constexpr std::size_t header_alignment = 8;  // the header is padded with spaces to it

std::uint64_t dtype_bytes(const std::string& dtype) {
  static const std::map<std::string, std::uint64_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
      {"U64", 8}, {"U32", 4}, {"U16", 2}, {"U8", 1}, {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

const std::string hint_damaged = "the file is damaged or not safetensors; export it again (mpipe export CKPT OUT.safetensors)";

}  // namespace

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header["__metadata__"] = meta;
  }
  std::uint64_t offset = 0;
  for (const SafetensorsEntry& e : entries) {
    MPIPE_CHECK(!e.name.empty() && e.name != "__metadata__" && !header.contains(e.name), "safetensors: tensor name '",
                e.name, "' empty, reserved or given twice");
    std::uint64_t numel = 1;
    for (const std::int64_t d : e.shape) numel *= static_cast<std::uint64_t>(d);
    const std::uint64_t bytes = e.bytes.size();
    MPIPE_CHECK(dtype_bytes(e.dtype) > 0 && numel * dtype_bytes(e.dtype) == bytes, "safetensors: '", e.name, "' has ", bytes,
                " bytes for ", numel, " elements of ", e.dtype);
    header[e.name] = Json{{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((header_alignment - text.size() % header_alignment) % header_alignment, ' ');
  write_file_atomically(path, "safetensors", [&](std::FILE* out) {
    const std::uint64_t length = text.size();
    std::fwrite(&length, sizeof length, 1, out);
    std::fwrite(text.data(), 1, text.size(), out);
    for (const SafetensorsEntry& e : entries) std::fwrite(e.bytes.data(), 1, e.bytes.size(), out);
  });
}

void write_file_atomically(const std::string& path, const char* what, const std::function<void(std::FILE*)>& write) {
  // Under a temporary name, renamed once complete and on disk; removed on any failure.
  const std::string temp = cat(path, ".tmp-", ::getpid());
  try {
    std::FILE* out = std::fopen(temp.c_str(), "wb");
    int synced = 0;  // fsync's errno
    if (out) {
      write(out);
      if (std::fflush(out) == 0 && ::fsync(::fileno(out)) != 0) synced = errno;
    }
    close_output(out, path, what, "OUT");
    if (synced) throw write_error(path, what, "OUT", synced);
    std::error_code ec;
    fs::rename(temp, path, ec);
    if (ec) throw write_error(path, what, "OUT", ec.value());
  } catch (const UserError&) {
    std::error_code ec;
    fs::remove(temp, ec);
    throw;
  }
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  std::error_code ec;
  const std::string kind = not_a_file(path);
  MPIPE_REQUIRE(kind.empty(), "give the path of a .safetensors file (mpipe export writes one)", "'", path, "' ", kind);
  const std::uint64_t size = fs::file_size(path, ec);
  MPIPE_REQUIRE(!ec, hint_damaged, "cannot read '", path, "': ", ec.message());
  std::ifstream in(path, std::ios::binary);
  MPIPE_REQUIRE(in.good(), "give a file you can read", "cannot open '", path, "'");
  std::uint64_t length = 0;
  MPIPE_REQUIRE(size >= sizeof length && in.read(reinterpret_cast<char*>(&length), sizeof length), hint_damaged, "'", path,
                "' is ", size, " bytes: too short for a safetensors header");
  MPIPE_REQUIRE(length <= size - sizeof length && length <= max_header_bytes, hint_damaged, "'", path, "': its header says ",
                length, " bytes, the file has ", size - sizeof length, " after the length");
  std::string text(length, '\0');
  MPIPE_REQUIRE(static_cast<bool>(in.read(text.data(), static_cast<std::streamsize>(length))), hint_damaged, "cannot read '",
                path, "''s header");
  Json header;
  try {
    header = Json::parse(text);
  } catch (const Json::parse_error& e) {
    throw UserError(cat("'", path, "': its header is not JSON (", e.what(), ")"), hint_damaged);
  }
  MPIPE_REQUIRE(header.is_object(), hint_damaged, "'", path, "': its header is not a JSON object");
  const std::uint64_t data_bytes = size - sizeof length - length;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      MPIPE_REQUIRE(value.is_object(), hint_damaged, "'", path, "': __metadata__ is not an object");
      for (const auto& [key, v] : value.items()) {
        MPIPE_REQUIRE(v.is_string(), hint_damaged, "'", path, "': metadata '", key, "' is not a string");
        metadata_[key] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = cat("'", path, "': tensor '", name, "'");
    MPIPE_REQUIRE(value.is_object() && value.contains("dtype") && value["dtype"].is_string() && value.contains("shape") &&
                      value["shape"].is_array() && value.contains("data_offsets") && value["data_offsets"].is_array() &&
                      value["data_offsets"].size() == 2,
                  hint_damaged, where, " lacks its dtype, shape or data_offsets");
    Tensor t;
    t.dtype = value["dtype"].get<std::string>();
    const std::uint64_t word = dtype_bytes(t.dtype);
    MPIPE_REQUIRE(word > 0, hint_damaged, where, " has an unknown dtype '", t.dtype, "'");
    std::uint64_t numel = 1;
    for (const Json& d : value["shape"]) {
      MPIPE_REQUIRE(d.is_number_unsigned() && d.get<std::uint64_t>() <= data_bytes, hint_damaged, where,
                    " has a dimension that is not a size within the file: ", d.dump());
      const std::uint64_t dim = d.get<std::uint64_t>();
      MPIPE_REQUIRE(dim == 0 || numel <= data_bytes / dim, hint_damaged, where, " claims more elements than the file holds");
      numel *= dim;
      t.shape.push_back(static_cast<std::int64_t>(dim));
    }
    for (const Json& o : value["data_offsets"])
      MPIPE_REQUIRE(o.is_number_unsigned(), hint_damaged, where, " has an offset that is not a byte count: ", o.dump());
    t.begin = value["data_offsets"][0].get<std::uint64_t>();
    t.end = value["data_offsets"][1].get<std::uint64_t>();
    MPIPE_REQUIRE(t.begin <= t.end && t.end <= data_bytes, hint_damaged, where, " lies at bytes ", t.begin, "-", t.end,
                  " of data ", data_bytes, " bytes long (the file is truncated, or its header lies)");
    MPIPE_REQUIRE(numel <= std::numeric_limits<std::uint64_t>::max() / word && t.end - t.begin == numel * word, hint_damaged,
                  where, " has ", t.end - t.begin, " bytes for ", numel, " elements of ", t.dtype);
    ranges.emplace_back(t.begin, t.end);
    tensors_.emplace(name, std::move(t));
  }
  // The ranges tile the data: no two tensors share bytes, and none are left over.
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t at = 0;
  for (const auto& [begin, end] : ranges) {
    MPIPE_REQUIRE(begin == at, hint_damaged, "'", path, "': ", begin < at ? "two tensors share bytes" : "bytes no tensor names",
                  " at data offset ", std::min(begin, at));
    at = end;
  }
  MPIPE_REQUIRE(at == data_bytes, hint_damaged, "'", path, "': ", data_bytes - at, " bytes after the last tensor");
  data_start_ = sizeof length + length;
}

bool float_dtype(const std::string& dtype) { return dtype == "F32" || dtype == "BF16" || dtype == "F16"; }

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  // float16: 5 exponent bits biased by 15, 10 mantissa bits; float32: 8 by 127, 23.
  constexpr std::uint32_t rebias = 127 - 15;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + rebias) << 23) | (mantissa << 13));
  if (mantissa == 0) return std::bit_cast<float>(sign);  // +-0
  // A subnormal, mantissa x 2^-24: normal in float32 once its leading 1 is shifted to bit 10.
  std::uint32_t shifts = 0;
  while ((mantissa & 0x400u) == 0) mantissa <<= 1, ++shifts;
  return std::bit_cast<float>(sign | ((rebias + 1 - shifts) << 23) | ((mantissa & 0x3ffu) << 13));
}

std::vector<float> SafetensorsFile::floats(const std::string& name) const {
  const auto it = tensors_.find(name);
  MPIPE_CHECK(it != tensors_.end(), "safetensors: no tensor '", name, "'");
  const Tensor& t = it->second;
  MPIPE_REQUIRE(float_dtype(t.dtype), "convert it to float32, bfloat16 or float16", "'", path_, "': tensor '", name, "' is ",
                t.dtype, ", not F32, BF16 or F16");
  const std::uint64_t word = dtype_bytes(t.dtype);
  std::vector<float> out((t.end - t.begin) / word);
  std::vector<std::uint16_t> halves(word == 2 ? out.size() : 0);
  char* into = word == 2 ? reinterpret_cast<char*>(halves.data()) : reinterpret_cast<char*>(out.data());
  std::ifstream in(path_, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(data_start_ + t.begin));
  MPIPE_REQUIRE(in.good() && in.read(into, static_cast<std::streamsize>(t.end - t.begin)), hint_damaged,
                "cannot read tensor '", name, "' of '", path_, "' (the file changed or was cut short)");
  if (t.dtype == "BF16") std::transform(halves.begin(), halves.end(), out.begin(), bfloat16_to_float);
  if (t.dtype == "F16") std::transform(halves.begin(), halves.end(), out.begin(), half_to_float);
  return out;
}

SafetensorsSet::SafetensorsSet(const std::string& path) {
  const std::string index_suffix = ".index.json";
  if (!path.ends_with(index_suffix)) {
    files_.emplace_back(path);
    for (const auto& [name, t] : files_[0].tensors()) file_[name] = 0, tensors_[name] = t;
    return;
  }
  const std::string hint = "give the index and its shards as Hugging Face's save_pretrained writes them";
  std::error_code ec;
  const std::string kind = not_a_file(path);
  MPIPE_REQUIRE(kind.empty(), hint, "'", path, "' ", kind);
  Json index;
  try {
    std::ifstream in(path);
    MPIPE_REQUIRE(in.good(), "give a file you can read", "cannot open '", path, "'");
    index = Json::parse(in);
  } catch (const Json::exception& e) {
    throw UserError(cat("'", path, "' is not JSON (", e.what(), ")"), hint);
  }
  MPIPE_REQUIRE(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), hint, "'", path,
                "' has no weight_map object");
  const fs::path dir = fs::path(path).parent_path();
  std::map<std::string, std::size_t> shard_index;  // shard file name -> files_
  std::map<std::string, std::string> mapped;       // tensor -> shard file name
  for (const auto& [name, shard] : index["weight_map"].items()) {
    MPIPE_REQUIRE(shard.is_string(), hint, "'", path, "': weight_map's '", name, "' is not a file name: ", shard.dump());
    const std::string file = shard.get<std::string>();
    MPIPE_REQUIRE(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", hint, "'", path,
                  "' names shard '", file, "' for tensor '", name, "': not a file beside the index");
    mapped[name] = file;
    if (shard_index.count(file)) continue;
    const std::string shard_path = (dir / file).string();
    MPIPE_REQUIRE(fs::exists(shard_path, ec), cat("put the index's shards beside it (", dir.empty() ? "." : dir.string(), ")"),
                  "'", path, "' names shard '", file, "', which is not there");
    shard_index[file] = files_.size();
    files_.emplace_back(shard_path);
  }
  for (const auto& [name, file] : mapped) {
    const SafetensorsFile& shard = files_[shard_index.at(file)];
    const auto it = shard.tensors().find(name);
    MPIPE_REQUIRE(it != shard.tensors().end(), hint, "'", path, "' puts tensor '", name, "' in '", shard.path(),
                  "', which has no such tensor");
    file_[name] = shard_index.at(file);
    tensors_[name] = it->second;
  }
  for (const SafetensorsFile& shard : files_)
    for (const auto& [name, t] : shard.tensors()) {
      const auto it = file_.find(name);
      MPIPE_REQUIRE(it != file_.end() && &files_[it->second] == &shard, hint, "'", shard.path(), "' holds tensor '", name,
                    "', which '", path, "' ", it == file_.end() ? "does not map" : "maps to another shard");
    }
}

const std::string& SafetensorsSet::file_of(const std::string& name) const { return files_.at(file_.at(name)).path(); }

std::vector<float> SafetensorsSet::floats(const std::string& name) const {
  const auto it = file_.find(name);
  MPIPE_CHECK(it != file_.end(), "safetensors: no tensor '", name, "'");
  return files_[it->second].floats(name);
}

}  // namespace mpipe
