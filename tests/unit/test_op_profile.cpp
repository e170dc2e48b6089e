// The op-kind profile (--profile-ops) on the CPU: each op's wall time goes to its kind,
// an op inside another counts once in the outer one's kind, nothing counts outside
// begin() and end() or on another thread.
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "mpipe/backend/op_profile.hpp"
#include "mpipe/backend/ops.hpp"

using namespace mpipe;
using ops::OpKind;

namespace {
std::size_t at(OpKind kind) { return static_cast<std::size_t>(kind); }
}  // namespace

TEST_CASE("op profile: each op's time goes to its kind, nested ops count once, only between begin and end") {
  ops::OpProfile::prepare(Device::cpu);
  std::vector<float> a(64 * 64, 0.5f), w(64 * 64, 0.25f), y(64 * 64, 0.0f);
  const Tensor inp = make_tensor(a.data(), Shape{64, 64}), weight = make_tensor(w.data(), Shape{64, 64}),
               out = make_tensor(y.data(), Shape{64, 64});

  ops::matmul_forward(out, inp, weight, Tensor{});  // before begin(): not counted
  ops::OpProfile::begin();
  ops::matmul_forward(out, inp, weight, Tensor{});
  ops::matmul_forward(out, inp, weight, Tensor{});
  ops::add(out, inp);
  {
    const ops::OpTimer optimizer(OpKind::optimizer, "update");  // as Optimizer::update around its own ops
    ops::copy(out, inp);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::thread([&] { ops::add(out, inp); }).join();  // another thread's op: not the step's
  const ops::OpTimes t = ops::OpProfile::end();
  ops::add(out, inp);  // after end(): not counted

  CHECK(t.calls[at(OpKind::gemm)] == 2);
  CHECK(t.calls[at(OpKind::elementwise)] == 1);
  CHECK(t.calls[at(OpKind::optimizer)] == 1);
  CHECK(t.calls[at(OpKind::copy)] == 0);  // inside the optimizer's timer
  CHECK(t.calls[at(OpKind::attention)] == 0);
  CHECK(t.seconds[at(OpKind::gemm)] > 0.0);
  CHECK(t.seconds[at(OpKind::elementwise)] > 0.0);
  CHECK(t.seconds[at(OpKind::optimizer)] >= 0.020);  // the sleep inside it
  CHECK(t.seconds[at(OpKind::copy)] == 0.0);
  CHECK(t.total() == doctest::Approx(t.seconds[at(OpKind::gemm)] + t.seconds[at(OpKind::elementwise)] +
                                     t.seconds[at(OpKind::optimizer)]));
  CHECK(t.untimed == 0);
  // By name: the function's, one entry each, the most time first (the sleeping update).
  const std::vector<ops::NamedTime> top = t.top(10);
  REQUIRE(top.size() == 3);
  CHECK(std::string(top[0].name) == "update");
  CHECK(top[0].calls == 1);
  for (const ops::NamedTime& n : top) {
    if (std::string(n.name) == "matmul_forward") CHECK(n.calls == 2);
    if (std::string(n.name) == "add") CHECK(n.calls == 1);
  }
  double named = 0;
  for (const ops::NamedTime& n : top) named += n.seconds;
  CHECK(named == doctest::Approx(t.total()));
  CHECK(t.top(1).size() == 1);

  // A second profile starts from nothing.
  ops::OpProfile::begin();
  const ops::OpTimes empty = ops::OpProfile::end();
  CHECK(empty.total() == 0.0);
  CHECK(empty.calls[at(OpKind::gemm)] == 0);
  CHECK(std::string(ops::name(OpKind::gemm)) == "GEMM");
  CHECK(std::string(ops::name(OpKind::copy)) == "copies");
}
