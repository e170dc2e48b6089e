// The checkpoint file's format, which needs no MPI (docs/checkpoint-format.md): one
// HDF5 file per checkpoint, keyed by global layer index and parameter name so it loads
// onto any stage count K and replica count D; every dataset carries a CRC-32, and the
// training state (/train and the root attributes) one of its own. Names, the model's
// signature, verification, and the pieces the collective writer, the loader and
// `mpipe inspect` share.
#pragma once
#include <hdf5.h>

#include <cerrno>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mpipe/core/error.hpp"
#include "mpipe/data/hdf5.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/nn/params.hpp"

namespace mpipe {

inline constexpr const char* checkpoint_format = "mpipe-checkpoint";
inline constexpr int checkpoint_format_version = 2;  // 2: run id and a checksum of /train
inline constexpr int checkpoint_oldest_readable_version = 1;
// DIR/ckpt-<step as 8 digits>.h5
std::string checkpoint_path(const std::string& dir, std::int64_t step);
// The step a checkpoint's file name gives, or -1 when the name is not ckpt-<8 digits>.h5.
std::int64_t checkpoint_step_of_name(const std::string& path);
// The files of `dir` named as checkpoints (ckpt-<8 digits>.h5), newest first.
std::vector<std::string> checkpoint_files(const std::string& dir);
// A run directory's newest checkpoint that verifies (verify_checkpoint), each damaged one
// before it named in a warning on stderr; UserError when none does (export, generate).
std::string newest_verified_checkpoint(const std::string& dir);
// A checkpoint to read weights from (export, generate): CHECKPOINT a file, or a run
// directory's newest that verifies; the whole file verified as resume verifies it, open,
// and its model rebuilt. UserError naming the problem, the hint saying what to `verb`.
struct CheckpointToRead {
  std::string path;
  Handle file;
  Model model;
  std::int64_t step = -1;  // /train's, -1 where it has none
};
// `verify` false: a file another process verified (generate's ranks after the first).
CheckpointToRead open_checkpoint_to_read(const std::string& checkpoint, const std::string& verb, bool verify = true);
// The run id a checkpoint file holds ("" for a version-1 file), or nothing when the
// file cannot be read as a checkpoint or its training state fails its checksum.
std::optional<std::string> checkpoint_run_id(const std::string& path);
// A string that changes whenever the parameter layout would: model kind, sizes,
// every parameter's layer, name and shape.
std::string model_signature(const Model& model);

// Checks a checkpoint file without MPI: HDF5, format and version, the training state,
// that it holds `model` (its signature; where they differ, the first layer that does),
// every dataset of the model and of its optimizer's state under check_dataset's rules,
// and (read_data) the CRC-32 of every one's data. Without a model (`mpipe inspect`), the
// model is the file's own layer list (the root attribute `model`), checked against the
// layout its checksummed signature names: inspect and resume apply one set of rules.
// Returns the problem, or nothing.
std::optional<std::string> verify_checkpoint(const std::string& path, const Model* model = nullptr,
                                             bool read_data = true);
// The model a checkpoint holds, rebuilt from its layer list (the root attribute
// `model`) and checked against the layout of its signature; UserError when it has none
// (a file of mpipe before model files) or the list does not build.
Model checkpoint_model(hid_t file, const std::string& path);

// ---- the format's pieces ------------------------------------------------------------

// A failed call's message ends with the system's reason where the disk gave one (HDF5's
// own message leaves it out: a full disk at a flush read "cannot flush" alone).
#define H5_CHECK(expr, ...)                                                    \
  do {                                                                         \
    errno = 0;                                                                 \
    if ((expr) < 0) throw Error(cat("HDF5: ", __VA_ARGS__, disk_reason(errno))); \
  } while (0)
// ": No space left on device" for errno values a disk gives (ENOSPC, EDQUOT, EIO, EROFS,
// EFBIG), else "" (HDF5 leaves other values behind from its probes).
std::string disk_reason(int error);

std::uint32_t crc32_of(const void* data, std::size_t bytes);
std::string layer_key(int layer);  // "0004": a layer's group under /model and /optimizer/<state>
// The model's layer list as a model file, without the name line (the same list read
// from another path is the same model): the root attribute `model`.
std::string model_text(const Model& model);

// One dataset of parameters or optimizer state, as every rank names it.
struct DatasetSpec {
  std::string path;
  Shape shape;
  int layer;
  std::string name;
};
// Every parameter's dataset under `root` ("/model"), a tied copy's left to its owner.
std::vector<DatasetSpec> parameter_datasets(const Model& model, const std::string& root);
std::vector<hsize_t> dims(const Shape& s);

void write_string_attribute(hid_t object, const char* name, const std::string& value);
std::optional<std::string> read_string_attribute(hid_t object, const char* name);
template <class T>
void write_scalar_attribute(hid_t object, const char* name, hid_t type, T value) {
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(object, name, type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  H5_CHECK(attr.get(), "cannot create attribute ", name);
  H5_CHECK(H5Awrite(attr.get(), type, &value), "cannot write attribute ", name);
}
template <class T>
std::optional<T> read_scalar_attribute(hid_t object, const char* name, hid_t type) {
  if (H5Aexists(object, name) <= 0) return std::nullopt;
  Handle attr(H5Aopen(object, name, H5P_DEFAULT), H5Aclose);
  T value{};
  if (H5Aread(attr.get(), type, &value) < 0) return std::nullopt;
  return value;
}
// Every dataset a checkpoint of `model` holds: the parameters under /model, then each
// state of `optimizer` ("adamw", "sgd"; "" for none) under /optimizer/<state>.
std::vector<DatasetSpec> checkpoint_datasets(const Model& model, const std::string& optimizer);
// The rules every parameter and optimizer dataset obeys, the one set that resume, load
// and `mpipe inspect` apply: reached through hard links alone (a soft or external link
// would let one dataset stand in for another, or for a file elsewhere), IEEE float32
// little-endian (HDF5 would convert other types silently), of `shape` exactly, its
// storage allocated and, when contiguous, within the file (else HDF5 reads fill values
// or zeros past the end as data), with a CRC-32. Nothing is read or allocated by size
// before these hold. Returns the problem, or nothing.
std::optional<std::string> check_dataset(hid_t file, const std::string& path, const Shape& shape);
// check_dataset, then its data into `out` (shape.numel() floats) against its CRC-32.
std::optional<std::string> read_checked(hid_t file, const std::string& path, const Shape& shape, float* out);

// A store entry's values from the dataset of its owner under `root` ("/model", or
// "/optimizer/<state>"), through read_checked: a tied copy of some of the owner's rows
// reads the owner's whole dataset into `rows` (reused between calls) and keeps its rows.
// Returns the problem, or nothing.
std::optional<std::string> read_entry(hid_t file, const Model& model, const ParamEntry& entry, const std::string& root,
                                      float* out, std::vector<float>& rows);

// What steers a resume: /train's attributes and the root attributes that say which
// model, optimizer and options the state belongs to. Version 2 covers them all by one
// CRC-32 (/train's `crc32`) of their text, so an altered step cannot pass for a real one.
struct TrainState {
  int version = checkpoint_format_version;
  std::int64_t step = 0, updates = 0, samples = 0, position = 0;
  std::uint64_t seed = 0;
  std::string data, run_id, signature, optimizer, config;
};
// Writes the training state and provenance into an open checkpoint (the same on every
// writer), with the model's layer list.
void write_train_state(hid_t file, const TrainState& state, const Model& model);
// Reads and checks the training state of an open checkpoint: present, within the
// checksum (version 2), and consistent (updates <= step, samples = data position, the
// step the file's name gives). Returns the problem, or nothing.
std::optional<std::string> read_train_state(hid_t file, const std::string& path, TrainState& state);

}  // namespace mpipe
