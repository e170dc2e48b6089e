// --data hdf5:PATH: a labelled data set in an HDF5 file (images or feature vectors).
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <numeric>

#include "mpipe/core/rng.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/data/hdf5.hpp"
#include "mpipe/data/mapped_file.hpp"

namespace mpipe {

namespace {

// The labels are read once (N integers, checked against the model's classes); the inputs
// are read by part: each fill() reads the rows it draws straight into the batch, as
// float, then scales and normalises them in place. Only the ranks that need inputs (the
// first stage) read them.
class LabelledFile final : public Dataset {
 public:
  struct Source {
    Handle file, inputs, rows, row;  // the file, /inputs, its dataspace, one row's
    int fd = -1;                     // HDF5's descriptor of the file (its sec2 driver's)
    struct stat opened {};           // the file as it was opened
    std::int64_t per_sample = 0, channels = 1;
    bool bytes = false;              // uint8, scaled to [0, 1]
    std::vector<float> mean, inverse_std;
    mutable std::vector<std::uint8_t> staging;  // one uint8 row, converted here (HDF5's conversion is slower)
  };

  // `labels`: `per` of them a sample (1, or a label map's H x W).
  LabelledFile(Source source, std::vector<std::int32_t> labels, std::int64_t per, std::string what, std::uint64_t seed,
               bool shuffle)
      : source_(std::move(source)), labels_(std::move(labels)), per_(per), what_(std::move(what)), seed_(seed),
        shuffle_(shuffle), order_(labels_.size() / static_cast<std::size_t>(per)) {}

  // Sample s is row order(s / N)[s % N]: every row once per epoch, in an order drawn
  // from (seed, epoch) when shuffled, in file order otherwise (held-out data).
  void fill(std::uint64_t first, std::int64_t count, const Tensor& inputs, const Tensor& targets) const override {
    if (!inputs.empty()) check_unchanged();
    const auto n = static_cast<std::uint64_t>(size());
    std::int32_t* y = targets.i32();
    for (std::int64_t i = 0; i < count; ++i) {
      const std::uint64_t s = first + static_cast<std::uint64_t>(i);
      const std::uint64_t row = shuffle_ ? order(s / n)[s % n] : s % n;
      if (!inputs.empty()) read_row(row, inputs.f32() + i * source_.per_sample);
      std::copy_n(labels_.data() + row * static_cast<std::uint64_t>(per_), per_, y + i * per_);
    }
  }

  bool targets_alone() const override { return true; }
  bool fills_aside() const override { return false; }  // reads through HDF5
  std::int64_t size() const override { return static_cast<std::int64_t>(labels_.size()) / per_; }

  std::string describe() const override {
    return cat(what_, ": ", size(), " samples", per_ > 1 ? " with a label per pixel" : "", shuffle_ ? ", shuffled per epoch" : ", in file order",
               ", read by part");
  }

  // HDF5 reads past the end of a file truncated under it as zeros, and a file rewritten
  // in place as whatever is there now, without an error: the run would train on nothing.
  // So each read first checks that the file is the one opened (one fstat a batch).
  void check_unchanged() const {
    if (source_.fd >= 0) mpipe::check_unchanged(source_.fd, source_.opened, what_);  // else HDF5's own errors stand
  }

  // Row `row` of /inputs into x (per_sample floats), scaled and normalised.
  void read_row(std::uint64_t row, float* x) const {
    const Source& src = source_;
    std::unique_lock hdf5(hdf5_mutex());  // --checkpoint-async may write a checkpoint meanwhile
    hsize_t start[8] = {row}, count[8] = {1};
    const int rank = H5Sget_simple_extent_ndims(src.rows.get());
    hsize_t dims[8] = {};
    H5Sget_simple_extent_dims(src.rows.get(), dims, nullptr);
    for (int d = 1; d < rank; ++d) count[d] = dims[d];
    void* into = src.bytes ? static_cast<void*>(src.staging.data()) : static_cast<void*>(x);
    if (H5Sselect_hyperslab(src.rows.get(), H5S_SELECT_SET, start, nullptr, count, nullptr) < 0 ||
        H5Dread(src.inputs.get(), src.bytes ? H5T_NATIVE_UINT8 : H5T_NATIVE_FLOAT, src.row.get(), src.rows.get(),
                H5P_DEFAULT, into) < 0)
      throw Error(cat(what_, ": cannot read row ", row, " of /inputs (the file changed or the disk failed)"));
    hdf5.unlock();
    if (src.bytes)
      for (std::int64_t i = 0; i < src.per_sample; ++i) x[i] = static_cast<float>(src.staging[static_cast<std::size_t>(i)]);
    const std::int64_t plane = src.per_sample / src.channels;
    for (std::int64_t c = 0; c < src.channels; ++c) {
      float* p = x + c * plane;
      const float m = src.mean[static_cast<std::size_t>(c)], inv = src.inverse_std[static_cast<std::size_t>(c)];
      if (src.bytes)
        for (std::int64_t i = 0; i < plane; ++i) p[i] /= 255.0f;
      for (std::int64_t i = 0; i < plane; ++i) p[i] = (p[i] - m) * inv;
    }
  }

 private:
  const std::vector<std::uint32_t>& order(std::uint64_t epoch) const {
    if (epoch != epoch_) {  // Fisher-Yates, from (seed, epoch)
      std::iota(order_.begin(), order_.end(), 0u);
      const RandomStream r = make_stream(seed_, Stream::data_setup, 7, static_cast<std::uint32_t>(epoch),
                                         static_cast<std::uint32_t>(epoch >> 32));
      for (std::size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[r.word(i) % i]);
      epoch_ = epoch;
    }
    return order_;
  }

  Source source_;
  std::vector<std::int32_t> labels_;
  std::int64_t per_;
  std::string what_;
  std::uint64_t seed_;
  bool shuffle_;
  mutable std::vector<std::uint32_t> order_;
  mutable std::uint64_t epoch_ = ~std::uint64_t{0};
};

}  // namespace

std::unique_ptr<Dataset> make_labelled_file(const std::string& path, const Model& model, std::uint64_t seed, bool shuffle) {
  namespace fs = std::filesystem;
  const std::string hint = "see docs/data.md for the layout (/inputs N x ..., /labels N)";
  const std::string option = shuffle ? "--data" : "--eval-data";  // held-out data is read in order
  const std::string file_name = cat(shuffle ? "data file" : "--eval-data file", " '", path, "'");
  std::error_code ec;
  MPIPE_REQUIRE(fs::exists(path, ec), cat("no such file: check the path given to ", option), "cannot open ", file_name);
  MPIPE_REQUIRE(fs::is_regular_file(path, ec), "give the path of an HDF5 file", file_name, " is not a regular file");
  MPIPE_REQUIRE(model.tokens() == 0, "use hdf5 data with a model of 'input = [...]' (mlp, a CNN)",
                option, " hdf5: labelled samples are for models of inputs, not of tokens");
  quiet_hdf5();
  MPIPE_REQUIRE(H5Fis_hdf5(path.c_str()) > 0, hint, file_name, " is not an HDF5 file");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  MPIPE_REQUIRE(file.ok(), hint, file_name, " cannot be opened");
  for (const char* name : {"inputs", "labels"})
    MPIPE_REQUIRE(H5Lexists(file.get(), name, H5P_DEFAULT) > 0, hint, file_name, " has no /", name, " dataset");
  Handle inputs(H5Dopen2(file.get(), "inputs", H5P_DEFAULT), H5Dclose), labels{H5Dopen2(file.get(), "labels", H5P_DEFAULT), H5Dclose};
  const Handle in_space(H5Dget_space(inputs.get()), H5Sclose), label_space{H5Dget_space(labels.get()), H5Sclose};
  hsize_t dims[8] = {}, label_dims[8] = {};
  const int rank = H5Sget_simple_extent_dims(in_space.get(), dims, nullptr);
  const int label_rank = H5Sget_simple_extent_dims(label_space.get(), label_dims, nullptr);
  // One sample of the model: (1, C, H, W) or (1, features).
  const Shape sample = model.input_shape(1);
  std::string want = "(N", got = "(";
  for (int i = 1; i < sample.rank; ++i) want += cat(", ", sample[i]);
  for (int i = 0; i < std::max(rank, 0); ++i) got += cat(i ? ", " : "", dims[i]);
  want += ")", got += ")";
  bool same = rank == sample.rank && dims[0] > 0;
  for (int i = 1; same && i < sample.rank; ++i) same = static_cast<std::int64_t>(dims[i]) == sample[i];
  MPIPE_REQUIRE(same, "make the file's /inputs match the model's input", file_name, ": /inputs is ", got,
                ", the model takes ", want);
  // A label per sample, or per pixel where the loss takes (N, classes, H, W): /labels (N, H, W).
  const Shape target = model.target_shape(1);
  if (target.rank == 1) {
    MPIPE_REQUIRE(label_rank == 1 && label_dims[0] == dims[0], "give one label per sample", file_name, ": /labels has ",
                  label_rank == 1 ? cat(label_dims[0], " entries") : cat(label_rank, " dimensions"), " for ", dims[0],
                  " samples");
  } else {
    const bool maps = label_rank == 3 && label_dims[0] == dims[0] && static_cast<std::int64_t>(label_dims[1]) == target[1] &&
                      static_cast<std::int64_t>(label_dims[2]) == target[2];
    MPIPE_REQUIRE(maps, cat("give a label map per sample: /labels (", dims[0], ", ", target[1], ", ", target[2], ")"), file_name,
                  ": /labels is ", label_rank == 3 ? cat("(", label_dims[0], ", ", label_dims[1], ", ", label_dims[2], ")") : cat(std::max(label_rank, 0), "-dimensional"),
                  "; the model's loss takes a label per pixel");
  }
  const std::int64_t per_label = target.numel();
  const Handle type(H5Dget_type(inputs.get()), H5Tclose);
  const bool bytes = H5Tget_class(type.get()) == H5T_INTEGER && H5Tget_size(type.get()) == 1 && H5Tget_sign(type.get()) == H5T_SGN_NONE;
  MPIPE_REQUIRE(bytes || H5Tget_class(type.get()) == H5T_FLOAT, "store /inputs as uint8 or float32", file_name,
                ": /inputs is neither uint8 nor floating point");
  const std::int64_t n = static_cast<std::int64_t>(dims[0]), per_sample = sample.numel();
  MPIPE_REQUIRE(n < (std::int64_t{1} << 32), "split the file", file_name, " holds more than 2^32 samples");
  // Optional per-channel normalisation: attributes mean and std of C values.
  LabelledFile::Source source;
  source.per_sample = per_sample;
  source.channels = sample.rank == 4 ? sample[1] : 1;
  source.bytes = bytes;
  if (bytes) source.staging.resize(static_cast<std::size_t>(per_sample));
  const auto channels = static_cast<std::size_t>(source.channels);
  std::vector<float> mean(channels, 0.0f), stdev(channels, 1.0f);
  for (auto [name, values] : {std::pair{"mean", &mean}, std::pair{"std", &stdev}}) {
    if (H5Aexists(inputs.get(), name) <= 0) continue;
    const Handle attribute(H5Aopen(inputs.get(), name, H5P_DEFAULT), H5Aclose);
    const Handle space(H5Aget_space(attribute.get()), H5Sclose);
    MPIPE_REQUIRE(H5Sget_simple_extent_npoints(space.get()) == source.channels,
                  cat("give ", source.channels, " values, one per channel"), file_name, ": /inputs attribute ", name,
                  " has ", H5Sget_simple_extent_npoints(space.get()), " values");
    MPIPE_REQUIRE(H5Aread(attribute.get(), H5T_NATIVE_FLOAT, values->data()) >= 0, hint, file_name, ": cannot read ", name);
  }
  for (std::size_t c = 0; c < channels; ++c) {
    MPIPE_REQUIRE(stdev[c] > 0, "give positive std values", file_name, ": std of channel ", c, " is not positive");
    stdev[c] = 1.0f / stdev[c];
  }
  source.mean = std::move(mean);
  source.inverse_std = std::move(stdev);
  // Integers only: HDF5 would convert floating-point labels (0.5 ... 9.5) by truncation.
  const Handle label_type(H5Dget_type(labels.get()), H5Tclose);
  MPIPE_REQUIRE(H5Tget_class(label_type.get()) == H5T_INTEGER, "store /labels as integers (class indices)", file_name,
                ": /labels is not of an integer type");
  std::vector<std::int64_t> wide(static_cast<std::size_t>(n * per_label));
  MPIPE_REQUIRE(H5Dread(labels.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, wide.data()) >= 0,
                "store /labels as integers", file_name, ": cannot read /labels as integers");
  std::vector<std::int32_t> y(static_cast<std::size_t>(n * per_label));
  const std::int64_t classes = model.classes();
  for (std::int64_t s = 0; s < n * per_label; ++s) {
    const std::int64_t label = wide[static_cast<std::size_t>(s)];
    MPIPE_REQUIRE(label >= 0 && label < classes, cat("labels must be 0 to ", classes - 1, " for a model of ", classes, " classes"),
                  file_name, ": label ", label, " of sample ", s / per_label, " is out of range");
    y[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(label);
  }
  // The inputs stay in the file: its handles move into the data set, which reads rows.
  const hsize_t row_dims[1] = {static_cast<hsize_t>(per_sample)};
  source.row = Handle(H5Screate_simple(1, row_dims, nullptr), H5Sclose);
  source.rows = Handle(H5Dget_space(inputs.get()), H5Sclose);
  source.inputs = std::move(inputs);
  void* descriptor = nullptr;
  if (H5Fget_vfd_handle(file.get(), H5P_DEFAULT, &descriptor) >= 0 && descriptor &&
      ::fstat(*static_cast<int*>(descriptor), &source.opened) == 0)
    source.fd = *static_cast<int*>(descriptor);
  source.file = std::move(file);
  MPIPE_REQUIRE(source.row.ok() && source.rows.ok(), hint, file_name, ": cannot select rows of /inputs");
  auto data = std::make_unique<LabelledFile>(std::move(source), std::move(y), per_label, cat("hdf5 file ", path), seed, shuffle);
  // One row read now: a dataset HDF5 cannot convert to float fails here, not mid-run.
  std::vector<float> probe(static_cast<std::size_t>(per_sample));
  try {
    data->read_row(0, probe.data());
  } catch (const Error&) {
    throw UserError(cat(file_name, ": cannot read /inputs as numbers"), hint);
  }
  return data;
}

}  // namespace mpipe
