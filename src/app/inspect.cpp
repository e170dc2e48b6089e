// `mpipe inspect`: a checkpoint's tree, shapes, parameter counts, training state and
// options, per-tensor statistics, and its checksums verified.
#include "mpipe/app/inspect.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <vector>

#include "mpipe/core/file_kind.hpp"
#include "mpipe/io/checkpoint_format.hpp"
#include "mpipe/io/checkpoint_tokenizer.hpp"

namespace mpipe {

namespace fs = std::filesystem;

namespace {
// "float32", "int32", "uint8", "float64", "string", ...: what a dataset holds.
std::string type_name(hid_t type) {
  const std::size_t bits = 8 * H5Tget_size(type);
  switch (H5Tget_class(type)) {
    case H5T_FLOAT: return cat("float", bits);
    case H5T_INTEGER: return cat(H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int", bits);
    case H5T_STRING: return "string";
    default: return "other";
  }
}
}  // namespace

int run_inspect(const std::string& path, bool stats, bool verify, const std::string& print) {
  quiet_hdf5();
  {
    const std::string kind = not_a_file(path);
    MPIPE_REQUIRE(kind.empty(), "give the path of a checkpoint file (ckpt-*.h5)", "'", path, "' ", kind);
  }
  MPIPE_REQUIRE(H5Fis_hdf5(path.c_str()) > 0, "mpipe checkpoints are HDF5 files (ckpt-*.h5)",
                "'", path, "' is not an HDF5 file");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  MPIPE_REQUIRE(file.ok(), "the file is damaged; use an older checkpoint", "'", path, "' cannot be opened");
  const auto format = read_string_attribute(file.get(), "format");
  MPIPE_REQUIRE(format && *format == checkpoint_format, "this is some other HDF5 file", "'", path,
                "' is not an mpipe checkpoint");
  if (!print.empty()) {  // the run's options or its layer list alone, as train reads them
    const auto text = read_string_attribute(file.get(), print.c_str());
    MPIPE_REQUIRE(text.has_value(), print == "model" ? "checkpoints of mpipe before model files have none" : "the file is damaged; use an older checkpoint",
                  "'", path, "' has no ", print, " attribute");
    std::printf("# the %s of the run that wrote %s\n%s", print == "model" ? "model" : "options", path.c_str(), text->c_str());
    return 0;
  }
  std::printf("%s\n", path.c_str());
  for (const char* a : {"format", "mpipe_version", "model_signature", "optimizer"})
    std::printf("  %-16s %s\n", a, read_string_attribute(file.get(), a).value_or("?").c_str());
  std::printf("  %-16s %d\n", "format_version", read_scalar_attribute<int>(file.get(), "format_version", H5T_NATIVE_INT).value_or(-1));
  {
    Handle train(H5Gopen2(file.get(), "/train", H5P_DEFAULT), H5Gclose);
    if (train.ok()) {
      for (const char* a : {"step", "optimizer_updates", "samples_consumed"})
        std::printf("  %-16s %lld\n", a,
                    static_cast<long long>(read_scalar_attribute<int64_t>(train.get(), a, H5T_NATIVE_INT64).value_or(-1)));
      std::printf("  %-16s %s\n", "run_id", read_string_attribute(train.get(), "run_id").value_or("(none)").c_str());
    }
  }
  {  // The tokenizer the run trained with, if it kept one (its checksum checked as it is read).
    std::string problem;
    if (const auto tokenizer = read_checkpoint_tokenizer(file.get(), &problem))
      std::printf("  %-16s %s (%s, %zu bytes, crc32 %08x)\n", "tokenizer", tokenizer->name.c_str(), tokenizer->kind.c_str(),
                  tokenizer->bytes.size(), static_cast<unsigned>(tokenizer->crc32()));
    else
      std::printf("  %-16s %s\n", "tokenizer", problem.empty() ? "(none)" : cat("FAILED (", problem, ")").c_str());
  }
  // The datasets the file's model says it holds: --stats reads only those, and only once
  // their structure checks out, and checks their data against its checksum as --verify
  // does (read_checked: nothing is allocated by a size the file merely claims); a dataset
  // that breaks a rule is marked FAILED and the command ends with exit 2.
  std::map<std::string, Shape> expected;
  std::string no_model;  // why there are none
  try {
    TrainState state;
    if (auto bad = read_train_state(file.get(), path, state)) throw UserError(*bad, "");
    for (const DatasetSpec& d : checkpoint_datasets(checkpoint_model(file.get(), path), state.optimizer)) expected[d.path] = d.shape;
  } catch (const UserError& e) {
    no_model = e.what();
  }
  // The tree, with per-layer parameter counts.
  struct Walk {
    hid_t file;
    bool stats;
    const std::map<std::string, Shape>& expected;
    std::vector<std::pair<std::string, long long>> per_layer;
    long long total = 0;
    std::vector<float> values;
    const std::string& no_model;
    std::vector<std::string> failed;  // --stats: the problems of the datasets that broke a rule
    std::set<std::string> seen;       // the model's datasets the walk met under their own names
  } walk{file.get(), stats, expected, {}, 0, {}, no_model, {}, {}};
  std::printf("tree:\n");
  H5Ovisit2(
      file.get(), H5_INDEX_NAME, H5_ITER_NATIVE,
      [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
        auto* w = static_cast<Walk*>(data);
        const std::string n = name;
        if (info->type == H5O_TYPE_GROUP) {
          if (n != ".") std::printf("  /%s/\n", name);
          return 0;
        }
        if (info->type != H5O_TYPE_DATASET) return 0;
        Handle set(H5Dopen2(w->file, name, H5P_DEFAULT), H5Dclose);
        Handle space(H5Dget_space(set.get()), H5Sclose);
        Handle type(H5Dget_type(set.get()), H5Tclose);
        hsize_t d[H5S_MAX_RANK] = {};
        const int rank = H5Sget_simple_extent_dims(space.get(), d, nullptr);
        std::string shape = "(";
        for (int i = 0; i < rank; ++i) shape += (i ? ", " : "") + std::to_string(d[i]);
        shape += ")";
        const long long count = H5Sget_simple_extent_npoints(space.get());
        std::printf("  /%-40s %-7s %-16s", name, type_name(type.get()).c_str(), shape.c_str());
        const auto wanted = w->expected.find("/" + n);
        if (n.rfind("model/", 0) == 0 && wanted != w->expected.end()) {
          w->total += count;
          const std::string layer = n.substr(6, n.find('/', 6) - 6);
          if (w->per_layer.empty() || w->per_layer.back().first != layer) w->per_layer.emplace_back(layer, 0);
          w->per_layer.back().second += count;
        }
        if (w->stats) {
          // Why a dataset is not read: no usable layer list (the file's training state or
          // list is damaged, or it predates them), or it is none of the list's.
          const bool model_dataset = n.rfind("model/", 0) == 0 || n.rfind("optimizer/", 0) == 0;
          std::optional<std::string> problem;
          if (wanted != w->expected.end()) {  // sized by the model, not by the file
            w->seen.insert(wanted->first);
            w->values.assign(static_cast<std::size_t>(wanted->second.numel()), 0.0f);
            problem = read_checked(w->file, "/" + n, wanted->second, w->values.data());
          }
          if (n == std::string(checkpoint_tokenizer_path).substr(1)) {
            std::printf(" (the tokenizer: read and checked above)");
          } else if (wanted == w->expected.end()) {
            std::printf(" (not read: %s)", !w->no_model.empty() && model_dataset
                                               ? "no usable layer list to check it against; see below"
                                               : "not one of the model's datasets");
          } else if (problem) {
            std::printf(" FAILED (%s)", problem->c_str());
            w->failed.push_back(*problem);
          } else if (count > 0) {
            const std::vector<float>& v = w->values;
            double lo = v[0], hi = v[0], sum = 0, sq = 0;
            for (float x : v) {
              lo = std::min<double>(lo, x);
              hi = std::max<double>(hi, x);
              sum += x;
              sq += static_cast<double>(x) * x;
            }
            const double mean = sum / count;
            std::printf(" min %+.4e max %+.4e mean %+.4e std %.4e norm %.4e", lo, hi, mean,
                        std::sqrt(std::max(0.0, sq / count - mean * mean)), std::sqrt(sq));
          }
        }
        std::printf("\n");
        return 0;
      },
      &walk, H5O_INFO_BASIC);
  // The model's datasets the walk did not meet (missing, or reached only through a link):
  // as --verify, each is a failure, said by the rule it breaks.
  if (stats)
    for (const auto& [name, shape] : expected)
      if (!walk.seen.contains(name)) {
        const std::string problem = check_dataset(file.get(), name, shape).value_or(cat("dataset ", name, " cannot be read"));
        std::printf("  %-41s FAILED (%s)\n", name.c_str(), problem.c_str());
        walk.failed.push_back(problem);
      }
  if (!no_model.empty()) std::printf("layer list: none usable (%s)\n", no_model.c_str());
  std::printf("parameters per layer:");
  for (const auto& [layer, count] : walk.per_layer) std::printf(" %s:%lld", layer.c_str(), count);
  std::printf("\nparameters: %lld\n", walk.total);
  std::printf("config:\n%s", read_string_attribute(file.get(), "config").value_or("?\n").c_str());
  if (verify) {
    if (auto bad = verify_checkpoint(path)) {
      std::printf("verify: FAILED\n");
      std::fflush(stdout);  // before the error line on stderr
      throw UserError(cat("checkpoint damaged: ", *bad), "use an older checkpoint");
    }
    std::printf("verify: every checksum matches\n");
  }
  // A training state that fails its checksum is damage too (the datasets were not read).
  if (stats && no_model.find("fails its checksum") != std::string::npos) walk.failed.push_back(no_model);
  if (!walk.failed.empty()) {
    std::printf("stats: FAILED (%zu problem%s)\n", walk.failed.size(), walk.failed.size() == 1 ? "" : "s");
    std::fflush(stdout);  // before the error line on stderr
    throw UserError(cat("checkpoint damaged: ", walk.failed.front(),
                        walk.failed.size() > 1 ? cat(" (and ", walk.failed.size() - 1, " more, marked FAILED above)") : ""),
                    "use an older checkpoint");
  }
  return 0;
}

}  // namespace mpipe
