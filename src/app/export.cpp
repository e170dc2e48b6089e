// `mpipe export`: a checkpoint's parameters (and BatchNorm's running statistics) as a
// safetensors file, under the names of the model's family (Hugging Face GPT-2's or
// Llama's, torchvision's, else the layer list's own: io/weights.hpp), read through the
// checkpoint reader's one set of rules; into a directory, with Hugging Face's config.json.
#include "mpipe/app/export.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>

#include "mpipe/core/version.hpp"
#include "mpipe/io/checkpoint_format.hpp"
#include "mpipe/io/checkpoint_tokenizer.hpp"
#include "mpipe/io/safetensors.hpp"
#include "mpipe/io/weights.hpp"

namespace mpipe {

namespace fs = std::filesystem;

namespace {

// An output never replaces an input, nor anything that is not a file.
void check_output(const std::string& out, const std::string& checkpoint) {
  std::error_code ec;
  if (fs::exists(out, ec)) {
    MPIPE_REQUIRE(fs::is_regular_file(out, ec), "give a file name for OUT", "'", out, "' exists and is not a file");
    MPIPE_REQUIRE(!fs::equivalent(out, checkpoint, ec), "give another file name for OUT", "'", out,
                  "' is the checkpoint itself");
  }
  MPIPE_REQUIRE(!fs::is_symlink(out, ec) || fs::exists(out, ec), "give a file name for OUT", "'", out,
                "' is a link to nothing");
  // Nor a checkpoint directory's lock (io/checkpoint_dir), by its name or another of its
  // inode: written over, it would let a second job into the directory.
  const fs::path lock = fs::path(checkpoint).parent_path() / ".mpipe.lock";
  const bool is_lock = fs::path(out).filename() == ".mpipe.lock" || (fs::exists(lock, ec) && fs::equivalent(out, lock, ec));
  MPIPE_REQUIRE(!is_lock, "give OUT a file name of its own", "'", out,
                "' is a checkpoint directory's lock file, which keeps a second job out of it");
}

}  // namespace

int run_export(const std::string& checkpoint, const std::string& out) {
  const CheckpointToRead source = open_checkpoint_to_read(checkpoint, "export");
  const std::string& path = source.path;
  const Model& model = source.model;
  const Handle& file = source.file;
  // OUT a directory (a name ending in '/', or one that exists): DIR/model.safetensors and,
  // for a family Hugging Face has a class of, the DIR/config.json its from_pretrained reads.
  std::error_code ec;
  const bool directory = out.ends_with('/') || fs::is_directory(out, ec);
  const std::string weights = directory ? (fs::path(out) / "model.safetensors").string() : out;
  const Json config = directory ? hf_config(model) : Json();
  const std::string config_path = config.is_null() ? "" : (fs::path(out) / "config.json").string();
  // The tokenizer the run trained with (train --tokenizer), under Hugging Face's name for
  // its kind: the directory form only, where from_pretrained looks for it.
  std::string problem;
  const std::optional<TokenizerFile> tokenizer = directory ? read_checkpoint_tokenizer(file.get(), &problem) : std::nullopt;
  MPIPE_REQUIRE(problem.empty(), "export an older checkpoint (mpipe inspect --verify finds one)", "'", path, "': ", problem);
  const std::string tokenizer_path =
      tokenizer ? (fs::path(out) / (tokenizer->kind == "bpe" ? "tokenizer.json" : "tokenizer.model")).string() : "";
  check_output(weights, path);
  if (!config_path.empty()) check_output(config_path, path);
  if (!tokenizer_path.empty()) check_output(tokenizer_path, path);
  if (directory && !fs::is_directory(out, ec)) {
    fs::create_directories(out, ec);
    MPIPE_REQUIRE(!ec, "give OUT a directory you can write", "cannot make directory '", out, "': ", ec.message());
  }
  // Every parameter as the checkpoint holds it, [out, in] ...
  std::map<std::pair<int, std::string>, std::vector<float>> params;
  std::map<std::pair<int, std::string>, std::int64_t> rows;
  for (const DatasetSpec& d : parameter_datasets(model, "/model")) {
    std::vector<float>& v = params[{d.layer, d.name}];
    v.resize(static_cast<std::size_t>(d.shape.numel()));
    rows[{d.layer, d.name}] = d.shape.rank > 0 ? d.shape[0] : 1;
    if (auto bad = read_checked(file.get(), d.path, d.shape, v.data()))
      throw UserError(cat("'", path, "': ", *bad), "export an older checkpoint (mpipe inspect --verify finds one)");
  }
  // ... as the family's tensors: each made of parameters' rows (taken whole where it is
  // one whole parameter), GPT-2's Conv1D transposed.
  const std::vector<ExportedTensor> tensors = exported_tensors(model);
  std::map<std::pair<int, std::string>, int> uses;
  for (const ExportedTensor& t : tensors)
    for (const ExportedTensor::Part& p : t.parts) ++uses[{p.layer, p.param}];
  std::vector<std::vector<float>> values(tensors.size());
  std::vector<SafetensorsEntry> entries;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const ExportedTensor& t = tensors[i];
    std::vector<float>& v = values[i];
    std::int64_t numel = 1;
    for (const std::int64_t d : t.shape) numel *= d;
    for (const ExportedTensor::Part& p : t.parts) {
      const std::pair<int, std::string> key{p.layer, p.param};
      std::vector<float>& param = params.at(key);
      const std::int64_t per_row = static_cast<std::int64_t>(param.size()) / rows.at(key);
      if (t.parts.size() == 1 && p.rows_end - p.rows_begin == rows.at(key) && uses.at(key) == 1) {
        v = std::move(param);
      } else {
        v.resize(static_cast<std::size_t>(numel));
        std::copy_n(param.begin() + p.rows_begin * per_row, (p.rows_end - p.rows_begin) * per_row, v.begin() + p.at * per_row);
      }
      if (--uses.at(key) == 0) std::vector<float>().swap(param);
    }
    if (t.transposed) v = transposed(v, t.shape[1], t.shape[0]);  // [out, in] -> [in, out]
    entries.push_back(f32_entry(t.name, t.shape, v));
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
  write_safetensors(weights, entries, metadata);
  if (!config_path.empty()) {
    const std::string text = config.dump(2) + "\n";
    write_file_atomically(config_path, "config.json", [&](std::FILE* f) { std::fwrite(text.data(), 1, text.size(), f); });
  }
  if (tokenizer)
    write_file_atomically(tokenizer_path, "tokenizer", [&](std::FILE* f) {
      std::fwrite(tokenizer->bytes.data(), 1, tokenizer->bytes.size(), f);
    });
  double count = 0;
  for (const auto& v : values) count += static_cast<double>(v.size());
  std::printf("exported %zu tensors, %.0f values (%s names) from %s to %s%s%s\n", entries.size(), count,
              family_title(weight_family(model)), path.c_str(), weights.c_str(),
              config_path.empty() ? "" : cat(" and ", config_path).c_str(),
              tokenizer_path.empty() ? "" : cat(" and ", tokenizer_path).c_str());
  return 0;
}

}  // namespace mpipe
