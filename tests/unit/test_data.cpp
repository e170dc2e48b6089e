// Datasets: batches are a function of (seed, sample index) only; file errors are
// user errors naming the file.
#include <doctest/doctest.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <hdf5.h>

#include "mpipe/core/error.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/pipeline/run/prefetch.hpp"
#include "documented_rng.hpp"
#include "hdf5_data_file.hpp"
#include "temp_dir.hpp"

using namespace mpipe;
namespace fs = std::filesystem;

namespace {

ModelConfig gpt(int vocab = 256, int seq_len = 8) {
  ModelConfig m;
  m.kind = "gpt";
  m.vocab = vocab;
  m.seq_len = seq_len;
  return m;
}

struct Batch {
  std::vector<std::int32_t> inputs, targets;
  Batch(int samples, int T) : inputs(samples * T), targets(samples * T) {}
  void fill(const Dataset& d, std::uint64_t first, int count, int T, int offset = 0) {
    d.fill(first, count, make_tensor(inputs.data() + offset * T, Shape{count, T}),
           make_tensor(targets.data() + offset * T, Shape{count, T}));
  }
};

fs::path temp_file(const std::string& name, const std::string& bytes) {
  const fs::path path = mpipe::testing::test_file(name);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string user_error(const std::string& spec, const ModelConfig& model) {
  try {
    make_dataset(spec, Model(model), 1);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("synthetic tokens: a sample is the same however the batch is split") {
  const int T = 8;
  auto data = make_dataset("synthetic", Model(gpt()), 5);
  Batch whole(6, T), parts(6, T);
  whole.fill(*data, 100, 6, T);
  parts.fill(*data, 100, 2, T, 0);
  parts.fill(*data, 102, 4, T, 2);
  CHECK(whole.inputs == parts.inputs);
  CHECK(whole.targets == parts.targets);
  // Targets are the inputs shifted by one.
  for (int s = 0; s < 6; ++s)
    for (int t = 0; t + 1 < T; ++t) CHECK(whole.inputs[s * T + t + 1] == whole.targets[s * T + t]);
  // Another seed, other data.
  auto other = make_dataset("synthetic", Model(gpt()), 6);
  Batch b(6, T);
  b.fill(*other, 100, 6, T);
  CHECK(b.inputs != whole.inputs);
}

TEST_CASE("synthetic tokens: the chain's empirical entropy matches the stated floor") {
  const int T = 64, V = 32, S = 400;
  auto data = make_dataset("synthetic", Model(gpt(V, T)), 1);
  Batch b(S, T);
  b.fill(*data, 0, S, T);
  // Conditional entropy of x[t] given (x[t-2], x[t-1]), estimated from counts.
  std::vector<int> counts(V * V * V, 0), context(V * V, 0);
  for (int s = 0; s < S; ++s)
    for (int t = 1; t < T; ++t) {
      const int a = b.inputs[s * T + t - 1], c = b.inputs[s * T + t], next = b.targets[s * T + t];
      ++counts[(a * V + c) * V + next];
      ++context[a * V + c];
    }
  double h = 0.0, n = 0.0;
  for (int i = 0; i < V * V * V; ++i)
    if (counts[i] > 0) {
      h -= counts[i] * std::log(static_cast<double>(counts[i]) / context[i / V]);
      n += counts[i];
    }
  const double chain = -(0.7 * std::log(0.7) + 3 * 0.1 * std::log(0.1));
  CHECK(h / n == doctest::Approx(chain).epsilon(0.08));
}

TEST_CASE("text data: byte tokens, windows inside the file") {
  const std::string text = "the quick brown fox jumps over the lazy dog";
  const fs::path path = temp_file("text.txt", text);
  auto data = make_dataset("text:" + path.string(), Model(gpt(256, 8)), 1);
  Batch b(4, 8);
  b.fill(*data, 0, 4, 8);
  for (int s = 0; s < 4; ++s) {
    const std::string window(b.inputs.begin() + s * 8, b.inputs.begin() + s * 8 + 8);
    CHECK(text.find(window) != std::string::npos);
  }
  fs::remove(path);
}

TEST_CASE("token files: uint16 little-endian ids") {
  std::string bytes;
  for (int i = 0; i < 20; ++i) bytes += {static_cast<char>(i * 37 % 256), static_cast<char>(i % 3)};
  const fs::path path = temp_file("tokens.bin", bytes);
  auto data = make_dataset("tokens:" + path.string(), Model(gpt(1024, 4)), 1);
  Batch b(3, 4);
  b.fill(*data, 0, 3, 4);
  for (int32_t token : b.inputs) CHECK(token < 1024);
  fs::remove(path);
}

TEST_CASE("bad data: one clear user error naming the problem") {
  CHECK(user_error("text:/nonexistent/file.txt", gpt()).find("cannot open data file '/nonexistent/file.txt'") != std::string::npos);
  const fs::path empty = temp_file("empty", "");
  CHECK(user_error("text:" + empty.string(), gpt()).find("is empty") != std::string::npos);
  const fs::path short_text = temp_file("short", "abc");
  CHECK(user_error("text:" + short_text.string(), gpt(256, 8)).find("too short") != std::string::npos);
  const fs::path odd = temp_file("odd.bin", "abc");
  CHECK(user_error("tokens:" + odd.string(), gpt()).find("odd size") != std::string::npos);
  // An id past the vocabulary is said where a window reads it (test_token_data.cpp).
  CHECK(user_error("text:" + short_text.string(), gpt(100)).find("vocabulary is 100") != std::string::npos);
  CHECK(user_error("csv:foo", gpt()).find("unknown data kind") != std::string::npos);
  CHECK(user_error("nonsense", gpt()).find("bad --data") != std::string::npos);
  for (const auto& p : {empty, short_text, odd}) fs::remove(p);
}

TEST_CASE("synthetic images: the same however split, labels in range, and learnable from the pixels") {
  const auto path = mpipe::testing::test_file("images.toml");
  std::ofstream(path) << "input = [2, 6, 5]\n[[layer]]\nkind = \"conv2d\"\nout = 4\nkernel = 3\n"
                         "[[layer]]\nkind = \"global-avgpool\"\n[[layer]]\nkind = \"linear\"\nout = 5\n"
                         "[[layer]]\nkind = \"cross_entropy\"\n";
  ModelConfig m;
  m.kind = path.string();
  const Model model(m);
  fs::remove(path);
  auto data = make_dataset("synthetic", model, 9);
  CHECK(data->describe().find("synthetic images: 2x6x5, 5 classes") != std::string::npos);
  const int per = 2 * 6 * 5, n = 768;
  std::vector<float> x(static_cast<std::size_t>(n * per)), parts(x.size());
  std::vector<std::int32_t> y(n), y_parts(n);
  data->fill(0, n, make_tensor(x.data(), Shape{n, 2, 6, 5}), make_tensor(y.data(), Shape{n}));
  data->fill(0, 100, make_tensor(parts.data(), Shape{100, 2, 6, 5}), make_tensor(y_parts.data(), Shape{100}));
  data->fill(100, n - 100, make_tensor(parts.data() + 100 * per, Shape{n - 100, 2, 6, 5}),
             make_tensor(y_parts.data() + 100, Shape{n - 100}));
  CHECK(x == parts);
  CHECK(y == y_parts);
  // Class means of the first 512 samples classify the other 256 by the nearest mean.
  std::vector<double> mean(static_cast<std::size_t>(5 * per), 0.0);
  std::vector<int> count(5, 0);
  for (int s = 0; s < 512; ++s) {
    REQUIRE((y[s] >= 0 && y[s] < 5));
    ++count[y[s]];
    for (int i = 0; i < per; ++i) mean[static_cast<std::size_t>(y[s] * per + i)] += x[static_cast<std::size_t>(s * per + i)];
  }
  for (int k = 0; k < 5; ++k) {
    REQUIRE(count[k] > 50);  // every class drawn
    for (int i = 0; i < per; ++i) mean[static_cast<std::size_t>(k * per + i)] /= count[k];
  }
  int right = 0;
  for (int s = 512; s < n; ++s) {
    int best = 0;
    double best_distance = 1e300;
    for (int k = 0; k < 5; ++k) {
      double d = 0;
      for (int i = 0; i < per; ++i) {
        const double e = x[static_cast<std::size_t>(s * per + i)] - mean[static_cast<std::size_t>(k * per + i)];
        d += e * e;
      }
      if (d < best_distance) best_distance = d, best = k;
    }
    right += best == y[s] ? 1 : 0;
  }
  CHECK(right > 0.8 * (n - 512));
}

TEST_CASE("hdf5 data: rows read by part, scaled and normalised, every row once per epoch, labels alone") {
  // 7 samples of (2, 3, 2) uint8 with per-channel mean and std; sample s, channel c,
  // pixel i holds 10 s + 3 c + i, and label s % 4.
  const auto path = mpipe::testing::test_file("labelled.h5");
  constexpr int N = 7, C = 2, plane = 6, per = C * plane;
  {
    std::vector<std::uint8_t> pixels(N * per);
    std::vector<std::int32_t> labels(N);
    for (int s = 0; s < N; ++s) {
      labels[static_cast<std::size_t>(s)] = s % 4;
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < plane; ++i) pixels[static_cast<std::size_t>(s * per + c * plane + i)] = static_cast<std::uint8_t>(10 * s + 3 * c + i);
    }
    const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    const hsize_t dims[4] = {N, C, 3, 2}, label_dims[1] = {N}, channel_dims[1] = {C};
    const hid_t space = H5Screate_simple(4, dims, nullptr), label_space = H5Screate_simple(1, label_dims, nullptr);
    const hid_t inputs = H5Dcreate2(file, "inputs", H5T_NATIVE_UINT8, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(inputs, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, pixels.data());
    const hid_t ls = H5Dcreate2(file, "labels", H5T_NATIVE_INT32, label_space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ls, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, labels.data());
    const hid_t channel_space = H5Screate_simple(1, channel_dims, nullptr);
    const float mean[C] = {0.1f, 0.2f}, stdev[C] = {0.5f, 0.25f};
    for (auto [name, values] : {std::pair{"mean", mean}, std::pair{"std", stdev}}) {
      const hid_t a = H5Acreate2(inputs, name, H5T_NATIVE_FLOAT, channel_space, H5P_DEFAULT, H5P_DEFAULT);
      H5Awrite(a, H5T_NATIVE_FLOAT, values);
      H5Aclose(a);
    }
    for (hid_t id : {channel_space, space, label_space}) H5Sclose(id);
    H5Dclose(inputs);
    H5Dclose(ls);
    H5Fclose(file);
  }
  const auto model_path = mpipe::testing::test_file("labelled.toml");
  std::ofstream(model_path) << "input = [2, 3, 2]\n[[layer]]\nkind = \"flatten\"\n[[layer]]\nkind = \"linear\"\nout = 4\n"
                               "[[layer]]\nkind = \"cross_entropy\"\n";
  ModelConfig m;
  m.kind = model_path.string();
  const Model model(m);
  fs::remove(model_path);
  const auto expected = [&](int s, int c, int i) {
    const float mean = c == 0 ? 0.1f : 0.2f, inv = 1.0f / (c == 0 ? 0.5f : 0.25f);
    return (static_cast<float>(10 * s + 3 * c + i) / 255.0f - mean) * inv;
  };
  // Held-out order (the file's): samples 5 .. 5 + 2N - 1 wrap around the epoch.
  auto held_out = make_dataset("hdf5:" + path.string(), model, 3, /*held_out=*/true);
  CHECK(held_out->size() == N);
  CHECK(held_out->targets_alone());
  std::vector<float> x(2 * N * per);
  std::vector<std::int32_t> y(2 * N);
  held_out->fill(5, 2 * N, make_tensor(x.data(), Shape{2 * N, C, 3, 2}), make_tensor(y.data(), Shape{2 * N}));
  for (int k = 0; k < 2 * N; ++k) {
    const int s = (5 + k) % N;
    CHECK(y[static_cast<std::size_t>(k)] == s % 4);
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < plane; ++i) CHECK(x[static_cast<std::size_t>(k * per + c * plane + i)] == expected(s, c, i));
  }
  // Training order: each epoch a permutation of the rows, the rows intact; the labels
  // alone (an empty inputs tensor: the last stage) are the same labels.
  auto train = make_dataset("hdf5:" + path.string(), model, 3);
  train->fill(0, 2 * N, make_tensor(x.data(), Shape{2 * N, C, 3, 2}), make_tensor(y.data(), Shape{2 * N}));
  std::vector<std::int32_t> alone(2 * N);
  train->fill(0, 2 * N, Tensor{}, make_tensor(alone.data(), Shape{2 * N}));
  CHECK(alone == y);
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<int> seen(N, 0);
    for (int k = epoch * N; k < (epoch + 1) * N; ++k) {
      const int s = static_cast<int>(std::lround((x[static_cast<std::size_t>(k * per)] * 0.5f + 0.1f) * 255.0f)) / 10;
      REQUIRE((s >= 0 && s < N));
      ++seen[static_cast<std::size_t>(s)];
      CHECK(y[static_cast<std::size_t>(k)] == s % 4);
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < plane; ++i) CHECK(x[static_cast<std::size_t>(k * per + c * plane + i)] == expected(s, c, i));
    }
    CHECK(seen == std::vector<int>(N, 1));
  }
  fs::remove(path);
}

namespace {

using mpipe::testing::documented_philox;

// The shuffle exactly as docs/data.md states it (with documented_philox).
std::vector<std::uint32_t> documented_order(std::uint64_t seed, std::uint64_t epoch, std::uint32_t n) {
  std::vector<std::uint32_t> order(n);
  for (std::uint32_t i = 0; i < n; ++i) order[i] = i;
  const std::uint64_t key = seed ^ (std::uint64_t{4} << 56);
  for (std::uint64_t i = n; i > 1; --i) {
    const std::uint64_t block = i / 4;
    const auto words = documented_philox({static_cast<std::uint32_t>(block), 7u,
                                          static_cast<std::uint32_t>(epoch) ^ static_cast<std::uint32_t>(block >> 32),
                                          static_cast<std::uint32_t>(epoch >> 32)},
                                         key);
    std::swap(order[i - 1], order[words[i % 4] % i]);
  }
  return order;
}

}  // namespace

TEST_CASE("hdf5 data: a run's batches follow the rule docs/data.md states, shuffle and replica split included") {
  // 11 rows labelled by their index, so a batch's labels are its rows.
  const auto path = mpipe::testing::test_file("batch_rule.h5");
  constexpr int N = 11;
  {
    std::vector<float> pixels(N * 4, 0.5f);
    std::vector<std::int32_t> labels(N);
    for (int s = 0; s < N; ++s) labels[static_cast<std::size_t>(s)] = s;
    mpipe::testing::write_data_file(path.string(), {N, 1, 2, 2}, pixels, {N}, labels);
  }
  const auto model_path = mpipe::testing::test_file("batch_rule.toml");
  std::ofstream(model_path) << "input = [1, 2, 2]\n[[layer]]\nkind = \"flatten\"\n[[layer]]\nkind = \"linear\"\nout = 16\n"
                               "[[layer]]\nkind = \"cross_entropy\"\n";
  ModelConfig m;
  m.kind = model_path.string();
  const Model model(m);
  fs::remove(model_path);
  const std::uint64_t seed = 1234;
  auto data = make_dataset("hdf5:" + path.string(), model, seed);
  // Steps of B = 6 samples over D = 2 replicas: replica r of step t reads 3 samples from
  // t B + r B / D (what Executor::read_batch asks for), across three epochs.
  constexpr int B = 6, D = 2, share = B / D;
  for (int t = 0; t < 5; ++t)
    for (int r = 0; r < D; ++r) {
      CAPTURE(t);
      CAPTURE(r);
      const std::uint64_t first = static_cast<std::uint64_t>(t) * B + static_cast<std::uint64_t>(r) * share;
      std::vector<float> x(share * 4);
      std::vector<std::int32_t> y(share);
      data->fill(first, share, make_tensor(x.data(), Shape{share, 1, 2, 2}), make_tensor(y.data(), Shape{share}));
      for (int j = 0; j < share; ++j) {
        const std::uint64_t s = first + static_cast<std::uint64_t>(j);
        const std::vector<std::uint32_t> order = documented_order(seed, s / N, N);
        CHECK(y[static_cast<std::size_t>(j)] == static_cast<std::int32_t>(order[s % N]));
      }
    }
  // The order is a shuffle: not the file's, and another each epoch.
  CHECK(documented_order(seed, 0, N) != documented_order(seed, 1, N));
  std::vector<std::uint32_t> identity(N);
  for (std::uint32_t i = 0; i < N; ++i) identity[i] = i;
  CHECK(documented_order(seed, 0, N) != identity);
  fs::remove(path);
}

TEST_CASE("prefetch: a batch read ahead is taken once by its key, its error comes at its take, others are dropped") {
  // The reader fills each sample s of inputs with step * 10 + s (and its target with the
  // training flag), and fails at step 3's sample 2. As any thread in one piece (a GPU's
  // reader) and of the idle class on any core in pieces of one sample (the CPU's).
  for (const bool background : {false, true}) {
    CAPTURE(background);
    std::vector<float> a(4, -1.0f), b(4, -1.0f);
    std::vector<std::int32_t> ta(4, -1), tb(4, -1);
    Prefetch reader(
        [](std::int64_t step, bool training, const Tensor& inputs, const Tensor& targets, std::int64_t begin,
           std::int64_t end) {
          for (std::int64_t s = begin; s < end; ++s) {
            if (step == 3 && s == 2) throw UserError("step 3 sample 2 is broken", "a hint");
            inputs.f32()[s] = static_cast<float>(step * 10 + s);
            targets.i32()[s] = training ? 1 : 0;
          }
        },
        2, background, background ? 1 : 0);
    const auto in = [](std::vector<float>& v) { return make_tensor(v.data(), Shape{4}); };
    const auto tg = [](std::vector<std::int32_t>& v) { return Tensor{v.data(), Shape{4}, DType::i32, Device::cpu}; };
    CHECK_FALSE(reader.take(0, true));  // nothing read ahead
    reader.start(1, true, in(a), tg(ta), 4);
    CHECK(reader.take(1, true));
    CHECK(a == std::vector<float>{10, 11, 12, 13});  // every sample, by the reader or by take()
    CHECK(ta == std::vector<std::int32_t>{1, 1, 1, 1});
    CHECK_FALSE(reader.take(1, true));  // taken once
    reader.start(2, true, in(b), tg(tb), 4);
    CHECK_FALSE(reader.take(2, false));  // another key: dropped (an evaluation batch asked for)
    CHECK_FALSE(reader.take(2, true));
    reader.start(3, true, in(a), tg(ta), 4);
    CHECK_THROWS_WITH_AS(reader.take(3, true), doctest::Contains("step 3 sample 2 is broken"), UserError);
    reader.start(3, true, in(a), tg(ta), 4);
    CHECK_FALSE(reader.take(4, true));  // a failed read not asked for says nothing
    reader.start(7, false, in(b), tg(tb), 4);
    CHECK(reader.take(7, false));
    CHECK(b == std::vector<float>{70, 71, 72, 73});
    CHECK(tb == std::vector<std::int32_t>{0, 0, 0, 0});
    CHECK(reader.started() == 5);
    CHECK(reader.taken() == 2);
    CHECK(reader.read_ahead() + reader.read_late() == 8);  // the two taken batches' samples
    reader.start(8, true, in(a), tg(ta), 4);  // in flight at the end: the destructor stops it
  }
}

TEST_CASE("prefetch: take() stops the reader after its piece in flight and fills the rest on its own thread") {
  // The reader's first piece (sample 0) is in flight when take() is called, and stays so
  // until take() has filled the rest (or 10 s have passed: an order that waited for the
  // piece first would wait here, then fill the rest after it). take() must not let the
  // reader start another piece, fills samples 1-3 itself, and does so while the reader's
  // piece is still in flight.
  std::atomic<bool> entered{false}, rest_filled{false}, piece_done{false};
  std::array<std::thread::id, 4> filled_by{};
  std::array<bool, 4> in_flight{};
  Prefetch reader(
      [&](std::int64_t, bool, const Tensor&, const Tensor&, std::int64_t begin, std::int64_t end) {
        if (begin == 0) {
          entered = true;
          for (int ms = 0; ms < 10000 && !rest_filled; ++ms) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        for (std::int64_t s = begin; s < end; ++s) {
          filled_by[static_cast<std::size_t>(s)] = std::this_thread::get_id();
          in_flight[static_cast<std::size_t>(s)] = !piece_done;
        }
        if (begin == 0) piece_done = true;
        else if (end == 4) rest_filled = true;
      },
      1, true, 1);
  std::vector<float> x(4);
  std::vector<std::int32_t> y(4);
  reader.start(5, true, make_tensor(x.data(), Shape{4}), Tensor{y.data(), Shape{4}, DType::i32, Device::cpu}, 4);
  while (!entered) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(reader.take(5, true));
  CHECK(piece_done);  // take() returned after the reader's piece
  CHECK(reader.read_ahead() == 1);
  CHECK(reader.read_late() == 3);
  CHECK(filled_by[0] != std::this_thread::get_id());
  for (std::size_t s = 1; s < 4; ++s) {
    CHECK(filled_by[s] == std::this_thread::get_id());
    CHECK(in_flight[s]);  // take() filled its samples while the reader's piece was in flight
  }
}
