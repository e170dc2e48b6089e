// The safetensors format (Hugging Face's; what PyTorch's tools and the Hub read): an
// 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
// and byte range, then the tensors' raw little-endian bytes. No Python package is
// needed to write or read it. mpipe writes float32 tensors (`mpipe export`) and reads
// float32, bfloat16 and float16 ones as float32, with every claim of the header checked
// against the file before a byte of data is trusted; a checkpoint sharded over files
// with an index (Hugging Face's model.safetensors.index.json) reads as one.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace mpipe {

// One tensor to write: its name, dtype ("F32", "I64"), shape and raw little-endian
// bytes (row-major, the shape's elements).
struct SafetensorsEntry {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> bytes;
};
inline SafetensorsEntry f32_entry(std::string name, std::vector<std::int64_t> shape, std::span<const float> values) {
  return {std::move(name), "F32", std::move(shape), std::as_bytes(values)};
}

// Writes `entries` in order (data offsets ascending) with `metadata` (string values, the
// format's __metadata__) to `path`, through a temporary beside it renamed into place:
// an interrupted write leaves no partial file under the name. UserError on a write
// problem (naming the file), or on a duplicate or empty name.
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata);
// Writes `path` through `write` into a temporary beside it, synced and renamed into place
// once complete (write_safetensors' way, for a config.json beside it); `what` names the
// file in errors ("safetensors"). UserError on a write problem; the temporary is removed.
void write_file_atomically(const std::string& path, const char* what, const std::function<void(std::FILE*)>& write);

// A safetensors file's header, read and checked against the file: its length within the
// file and under a bound, valid JSON of the format's form, every tensor's dtype known,
// its shape non-negative, its byte range the shape's size and inside the data, the
// ranges disjoint and covering the data. UserError naming the file and the first
// problem. A tensor's data is read when asked for (a rank reads the tensors it holds).
class SafetensorsFile {
 public:
  struct Tensor {
    std::string dtype;  // "F32", "BF16", ...
    std::vector<std::int64_t> shape;
    std::uint64_t begin = 0, end = 0;  // bytes, from the start of the data
  };
  explicit SafetensorsFile(const std::string& path);
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  // A float32, bfloat16 or float16 tensor's values as float32 (each exactly; UserError
  // where it is another dtype, or the file can no longer be read).
  std::vector<float> floats(const std::string& name) const;

 private:
  std::string path_;
  std::uint64_t data_start_ = 0;  // the data's offset in the file
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Whether floats() reads `dtype` ("F32", "BF16", "F16").
bool float_dtype(const std::string& dtype);
// One float16 or bfloat16 value's bits as float32 (exact: every such value is a float32).
float half_to_float(std::uint16_t bits);
inline float bfloat16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

// The tensors of one safetensors file, or of the shards an index names (Hugging Face's
// *.safetensors.index.json: {"metadata": ..., "weight_map": {tensor: shard file}}, the
// shards beside it): each shard checked as a file, and the index against them (every
// shard it names present and a plain file name beside it, every tensor it maps in its
// shard, every shard's tensor mapped to that shard). UserError naming the index or the
// shard and the first problem.
class SafetensorsSet {
 public:
  explicit SafetensorsSet(const std::string& path);
  const std::map<std::string, SafetensorsFile::Tensor>& tensors() const { return tensors_; }
  // The file holding tensor `name` (for messages).
  const std::string& file_of(const std::string& name) const;
  std::vector<float> floats(const std::string& name) const;  // SafetensorsFile::floats

 private:
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::size_t> file_;  // tensor -> files_ index
  std::map<std::string, SafetensorsFile::Tensor> tensors_;
};

}  // namespace mpipe
