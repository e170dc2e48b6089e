// `mpipe export`: a checkpoint's parameters (and BatchNorm's running statistics) as a
// safetensors file, under Hugging Face GPT-2's names for the GPT preset and the layer
// list's own for the rest (io/weights.hpp), read through the checkpoint reader's one
// set of rules.
#include "mpipe/app/export.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "mpipe/core/version.hpp"
#include "mpipe/io/checkpoint_format.hpp"
#include "mpipe/io/safetensors.hpp"
#include "mpipe/io/weights.hpp"

namespace mpipe {

namespace fs = std::filesystem;

int run_export(const std::string& checkpoint, const std::string& out) {
  const CheckpointToRead source = open_checkpoint_to_read(checkpoint, "export");
  const std::string& path = source.path;
  const Model& model = source.model;
  const Handle& file = source.file;
  // An output never replaces an input, nor anything that is not a file.
  std::error_code ec;
  if (fs::exists(out, ec)) {
    MPIPE_REQUIRE(fs::is_regular_file(out, ec), "give a file name for OUT", "'", out, "' exists and is not a file");
    MPIPE_REQUIRE(!fs::equivalent(out, path, ec), "give another file name for OUT", "'", out, "' is the checkpoint itself");
  }
  MPIPE_REQUIRE(!fs::is_symlink(out, ec) || fs::exists(out, ec), "give a file name for OUT", "'", out,
                "' is a link to nothing");
  const std::vector<DatasetSpec> datasets = parameter_datasets(model, "/model");
  std::vector<std::vector<float>> values(datasets.size());
  std::vector<SafetensorsEntry> entries;
  for (std::size_t i = 0; i < datasets.size(); ++i) {
    const DatasetSpec& d = datasets[i];
    std::vector<float>& v = values[i];
    v.resize(static_cast<std::size_t>(d.shape.numel()));
    if (auto bad = read_checked(file.get(), d.path, d.shape, v.data()))
      throw UserError(cat("'", path, "': ", *bad), "export an older checkpoint (mpipe inspect --verify finds one)");
    const ExportedName name = exported_name(model, d.layer, d.name);
    std::vector<std::int64_t> shape(d.shape.rank);
    for (int k = 0; k < d.shape.rank; ++k) shape[static_cast<std::size_t>(k)] = d.shape[k];
    if (name.transposed) {
      v = transposed(v, d.shape[0], d.shape[1]);
      std::swap(shape[0], shape[1]);
    }
    entries.push_back(f32_entry(name.name, shape, v));
  }
  // torchvision's BatchNorm has a batch count beside its statistics (read only where its
  // momentum is None): the checkpoint's step, an int64 scalar.
  const std::int64_t step = source.step;
  const bool torchvision = torchvision_resnet_layout(model);
  const std::string running_mean = ".running_mean";
  std::vector<std::string> tracked;
  for (const SafetensorsEntry& e : entries)
    if (torchvision && e.name.size() > running_mean.size() && e.name.ends_with(running_mean))
      tracked.push_back(e.name.substr(0, e.name.size() - running_mean.size()) + ".num_batches_tracked");
  const std::int64_t batches = std::max<std::int64_t>(step, 0);
  for (const std::string& name : tracked)
    entries.push_back({name, "I64", {}, std::as_bytes(std::span<const std::int64_t>(&batches, 1))});
  std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"mpipe_version", cat(version(), " (git ", git_hash(), ")")}, {"mpipe_checkpoint", path}};
  if (auto text = read_string_attribute(file.get(), "model")) metadata["mpipe_model"] = *text;
  if (auto signature = read_string_attribute(file.get(), "model_signature")) metadata["mpipe_model_signature"] = *signature;
  metadata["mpipe_step"] = cat(step);
  write_safetensors(out, entries, metadata);
  double count = 0;
  for (const auto& v : values) count += static_cast<double>(v.size());
  std::printf("exported %zu tensors, %.0f values (%s names) from %s to %s\n", entries.size(), count,
              gpt2_layout(model) ? "Hugging Face GPT-2" : torchvision ? "torchvision ResNet" : "mpipe layer", path.c_str(),
              out.c_str());
  return 0;
}

}  // namespace mpipe
