// The safetensors format (Hugging Face's; what PyTorch's tools and the Hub read): an
// 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
// and byte range, then the tensors' raw little-endian bytes. No Python package is
// needed to write or read it. mpipe writes float32 tensors (`mpipe export`) and reads
// them back with every claim of the header checked against the file before a byte of
// data is trusted.
#pragma once
#include <cstddef>
#include <cstdint>
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
  // A float32 tensor's values (UserError where it is another dtype, or the file can no
  // longer be read).
  std::vector<float> floats(const std::string& name) const;

 private:
  std::string path_;
  std::uint64_t data_start_ = 0;  // the data's offset in the file
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace mpipe
