// The Plan over a grid of (K, D, M, schedule) without MPI: its grid and batch split,
// partition and placement, schedule, memory and bubbles agree with one another and with
// the functions they come from; and the problems make_plan finds are user errors.
#include <doctest/doctest.h>

#include <numeric>

#include "mpipe/app/config.hpp"
#include "mpipe/pipeline/comm/hosts.hpp"
#include "mpipe/nn/dense_layers.hpp"
#include "mpipe/pipeline/plan/plan.hpp"
#include "tiny_gpt.hpp"

using namespace mpipe;

namespace {

RunOptions options_of(TrainConfig c) {
  validate(c);
  return run_options(c);
}

}  // namespace

TEST_CASE("a plan over a grid of (K, D, M, schedule): its facts agree") {
  TrainConfig c = test::tiny_gpt({.layers = 6, .batch_size = 32});  // 10 layers
  const Model model(options_of(c).model);
  for (const ScheduleKind& kind : schedule_kinds())
    for (const int K : {1, 2, 4})
      for (const int D : {1, 2})
        for (const int M : {1, 2, 4, 8}) {
          const int v = kind.virtual_stages == 0 ? 2 : kind.virtual_stages;
          if (K * v > model.size() || (kind.name == "interleaved" && M % K != 0)) continue;
          c.micro_batches = M;
          c.pipeline.schedule = kind.name;
          c.pipeline.virtual_stages = v;
          c.pipeline.grid = GridShape{.stages = K, .replicas = D};
          CAPTURE(kind.name);
          CAPTURE(K);
          CAPTURE(D);
          CAPTURE(M);
          const Plan plan = make_plan(options_of(c), K * D, model);
          CHECK(plan.grid.stages == K);
          CHECK(plan.grid.replicas == D);
          CHECK(plan.micro_batch_size * M * D == c.batch_size);
          CHECK(plan.replica_batch() * D == c.batch_size);
          // The partition: K·v contiguous model stages covering the layers, each on the
          // pipeline stage the schedule places it on.
          REQUIRE(plan.partition.stages() == K * v);
          CHECK(plan.partition.begin(0) == 0);
          CHECK(plan.partition.end(K * v - 1) == model.size());
          CHECK(plan.schedule.placement_table() == kind.placement(K, v));
          for (int m = 0; m < K * v; ++m) {
            CHECK(plan.partition.pipeline_stage(m) == plan.schedule.list_of(m));
            CHECK(plan.partition.begin(m) < plan.partition.end(m));
          }
          // The schedule: lowered (it has sends where there are neighbours) and valid.
          CHECK(!validate(plan.schedule).has_value());
          CHECK(plan.schedule.micro_batches == M);
          // Memory: every parameter counted once per model stage that holds it; the
          // weight bytes of the ranks add up to all of them with their state.
          REQUIRE(plan.memory.size() == static_cast<std::size_t>(K * v));
          double params = 0, weights = 0;
          for (const StageMemory& m : plan.memory) params += m.params;
          for (int s = 0; s < K; ++s) weights += plan.weight_bytes(s);
          // AdamW: values, gradients and two moments, four floats per parameter, and with
          // replicas the sums' buffers, (D-1)/D of the gradients.
          CHECK(weights == doctest::Approx(4.0 * params * (4.0 + (D - 1.0) / D)));
          CHECK(params >= static_cast<double>(model.parameter_count()));  // the tied table is on two stages
          for (int s = 0; s < K; ++s) CHECK(plan.activation_bytes(s) > 0);
          // Bubbles: fractions, none for one stage, and the formula's where the table has one.
          for (const double b : {plan.equal_bubble, plan.predicted_bubble, plan.equal_overlap_bubble,
                                 plan.predicted_overlap_bubble, plan.unit_cost_bubble}) {
            CHECK(b >= 0.0);
            CHECK(b < 1.0);
          }
          if (K == 1) CHECK(plan.equal_bubble == doctest::Approx(0.0));
          const std::string formula = kind.bubble_formula(0);
          CHECK(plan.bubble_formula == (M < K || formula.empty() ? "simulated" : formula));
          CHECK(plan.unit_cost_bubble == doctest::Approx(simulate(plan.schedule, StageCosts::unit(plan.schedule)).bubble_fraction));
        }
}

TEST_CASE("a plan follows its options: remat, --balance, the zero-bubble order for the costs") {
  TrainConfig c = test::tiny_gpt({.layers = 4, .batch_size = 16, .micro_batches = 4});  // 8 layers
  const Model model(options_of(c).model);
  c.pipeline.grid.stages = 2;
  c.pipeline.remat = "except-last";
  Plan plan = make_plan(options_of(c), 2, model);
  CHECK(plan.rematerialize(0, 0));
  CHECK(!plan.rematerialize(0, 3));  // the last micro-batch's backward comes at once
  CHECK(plan.remat_stage(0, 0));
  CHECK(!plan.remat_stage(1, 1));
  // Remat keeps only the inputs: a rank holds less than without it.
  c.pipeline.remat = "never";
  const Plan whole = make_plan(options_of(c), 2, model);
  CHECK(plan.activation_bytes(0) < whole.activation_bytes(0));
  // The last stage keeps its micro-batches whole, one at a time: each forward runs just
  // before its backward.
  CHECK(plan.activation_bytes(1) < whole.activation_bytes(1));
  CHECK(plan.activation_bytes(1) == doctest::Approx(plan.memory[1].held(1, false)));
  c.pipeline.balance = "3,5";
  plan = make_plan(options_of(c), 2, model);
  CHECK(plan.partition.to_text() == "0-2 | 3-7");
  // zb-h1 ordered for the partition's FLOPs is as valid, and predicts no worse than the
  // order built for unit costs.
  c.pipeline.balance.clear();
  c.pipeline.schedule = "zb-h1";
  plan = make_plan(options_of(c), 2, model);
  CHECK(plan.schedule.splits(0));
  CHECK(plan.bubble_formula == "(K-1)/(3M+K-1)");
  const Schedule unit = lower(make_schedule("zb-h1", 2, 4));
  CHECK(plan.predicted_bubble <= simulate(unit, plan.flops).bubble_fraction + 1e-12);
}

TEST_CASE("the model's last stage runs its rematerialized forwards just before their backwards, recomputing nothing") {
  TrainConfig c = test::tiny_gpt({.layers = 4, .batch_size = 16, .micro_batches = 4});  // 8 layers
  const Model model(options_of(c).model);
  c.pipeline.grid.stages = 2;
  const auto plan_of = [&](const char* remat, const char* schedule) {
    c.pipeline.remat = remat;
    c.pipeline.schedule = schedule;
    return make_plan(options_of(c), 2, model);
  };
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1"}) {
    CAPTURE(schedule);
    const Plan always = plan_of("always", schedule), never = plan_of("never", schedule);
    CHECK(always.deferred_from(1) == 0);
    CHECK(always.deferred_from(0) == 4);  // its output goes on: not the first stage
    CHECK(always.remat_free(1));
    CHECK(!always.remat_free(0));
    CHECK(always.schedule.to_text() == defer_forwards(never.schedule, 1, 0).to_text());
    CHECK(always.named_in_flight == never.named_in_flight);
    // The forwards' order is the named one: only where each F runs moved.
    CHECK(compute_only(always.schedule).actions[0] == compute_only(never.schedule).actions[0]);
  }
  // except-last keeps its last micro-batch whole: it is deferred with the others (its
  // forward then runs after theirs, in order), into a slot that lives until its B.
  const Plan except_last = plan_of("except-last", "gpipe");
  CHECK(except_last.deferred_from(1) == 0);
  CHECK(except_last.remat_free(1));
  CHECK(except_last.deferred_from(0) == 4);
  CHECK(except_last.schedule.to_text() == defer_forwards(plan_of("never", "gpipe").schedule, 1, 0).to_text());
  // auto's mixed stages rematerialize the last micro-batches of each window: on the last
  // stage those are deferred, the others run where the schedule has them.
  Plan mixed = plan_of("never", "gpipe");
  mixed.stage_remat = {Remat::selective, Remat::selective};
  mixed.remat_whole = {1, 3};
  mixed.remat_window = {4, 4};
  CHECK(!mixed.rematerialize(1, 0));
  CHECK(mixed.rematerialize(1, 1));
  CHECK(mixed.rematerialize(0, 3));
  CHECK(!mixed.rematerialize(0, 2));
  CHECK(mixed.deferred_from(1) == 1);
  CHECK(mixed.remat_free(1));
  CHECK(!mixed.remat_free(0));
}

TEST_CASE("a plan's weights per rank: --shard-optimizer keeps 1/D of the state, --overlap-steps a copy, bf16 a compute copy") {
  TrainConfig c = test::tiny_gpt({.layers = 4, .batch_size = 16});
  c.pipeline.grid.replicas = 4;
  const Model model(options_of(c).model);
  auto weights = [&](const TrainConfig& config) { return make_plan(options_of(config), 8, model).weight_memory(1, config.pipeline.shard_optimizer); };
  const Plan plan = make_plan(options_of(c), 8, model);
  const double params = plan.memory[1].params;  // stage 1 of K = 2: blocks only
  const Plan::WeightMemory plain = weights(c);
  CHECK(plain.values == doctest::Approx(4.0 * params));
  CHECK(plain.gradients == doctest::Approx(4.0 * params));
  CHECK(plain.state == doctest::Approx(8.0 * params));  // AdamW's two moments
  CHECK(plain.sums == doctest::Approx(4.0 * params * 3 / 4));  // each replica sum receives 3 chunks of 4
  CHECK(plan.weight_bytes(1) == doctest::Approx(plain.total()));
  c.pipeline.shard_optimizer = true;
  const Plan::WeightMemory sharded = weights(c);
  CHECK(sharded.state == doctest::Approx(plain.state / 4));
  CHECK(sharded.values == doctest::Approx(plain.values));
  CHECK(make_plan(options_of(c), 8, model).weight_bytes(1) == doctest::Approx(sharded.total()));
  CHECK(make_plan(options_of(c), 8, model).rank_bytes(1) > sharded.total());  // and activations
  c.optimizer.kind = "sgd";
  CHECK(weights(c).state == doctest::Approx(plain.state / 8));  // one state, 1/4 of it
  c.optimizer.kind = "adamw";
  c.pipeline.overlap_steps = true;
  CHECK(weights(c).total() == doctest::Approx(2 * (sharded.total() - sharded.sums) + sharded.sums));  // one set of sum buffers
}

TEST_CASE("a plan counts --checkpoint-async's copy (values and the state's share) where checkpoints are written in the background") {
  TrainConfig c = test::tiny_gpt({.layers = 4, .batch_size = 16});
  c.pipeline.grid.replicas = 2;
  const Model model(options_of(c).model);
  auto weights = [&](const TrainConfig& config) { return make_plan(options_of(config), 4, model).weight_memory(1, config.pipeline.shard_optimizer); };
  const double params = make_plan(options_of(c), 4, model).memory[1].params;
  CHECK(c.checkpoint_async == "auto");  // the default
  CHECK(weights(c).checkpoint_copy == 0.0);  // no --checkpoint-dir
  c.checkpoint_dir = "ckpt";
  CHECK(weights(c).checkpoint_copy == 0.0);  // only the final checkpoint: written at once
  c.checkpoint_every = 10;
  const Plan::WeightMemory copy = weights(c);
  CHECK(copy.checkpoint_copy == doctest::Approx(4.0 * params * 3));  // values and AdamW's two moments
  CHECK(make_plan(options_of(c), 4, model).weight_bytes(1) == doctest::Approx(copy.total()));
  CHECK(copy.total() == doctest::Approx(copy.values + copy.gradients + copy.state + copy.sums + copy.checkpoint_copy));
  c.pipeline.shard_optimizer = true;
  CHECK(weights(c).checkpoint_copy == doctest::Approx(4.0 * params * (1 + 2.0 / 2)));  // this replica's half of the state
  c.checkpoint_async = "off";
  CHECK(weights(c).checkpoint_copy == 0.0);
}

TEST_CASE("make_plan's problems are user errors that name the option") {
  TrainConfig c = test::tiny_gpt({.layers = 2, .batch_size = 8, .micro_batches = 2});  // 6 layers
  const Model model(options_of(c).model);
  CHECK_THROWS_WITH_AS(make_plan(options_of(c), 0, model), doctest::Contains("--ranks must be positive"), UserError);
  CHECK_THROWS_WITH_AS(make_plan(options_of(c), 7, model), doctest::Contains("more stages (7) than layers (6)"), UserError);
  TrainConfig balance = c;
  balance.pipeline.balance = "2,4";
  CHECK_THROWS_WITH_AS(make_plan(options_of(balance), 3, model), doctest::Contains("--balance has 2 stages, the grid has 3"),
                       UserError);
  TrainConfig in_flight = c;
  in_flight.pipeline.in_flight = 3;
  CHECK_THROWS_WITH_AS(make_plan(options_of(in_flight), 2, model), doctest::Contains("--in-flight sets the zero-bubble"),
                       UserError);
  TrainConfig unknown = c;
  unknown.pipeline.schedule = "zb";
  CHECK_THROWS_WITH_AS(make_plan(options_of(unknown), 2, model), doctest::Contains("unknown schedule 'zb'"), UserError);
}

TEST_CASE("options as enums: each word of an option parses to its value and prints back") {
  TrainConfig c;
  c.pipeline.memory_per_rank = "1GiB";  // what auto needs
  for (std::size_t i = 0; i < remat_names.size(); ++i) {
    c.pipeline.remat = remat_names[i];
    CHECK(to_string(options_of(c).remat) == std::string(remat_names[i]));
  }
  for (const char* word : batchnorm_names) {
    c.pipeline.batchnorm = word;
    CHECK(to_string(options_of(c).batchnorm) == std::string(word));
  }
  for (const char* word : partition_names) {
    c.pipeline.partition = word;
    CHECK(to_string(options_of(c).partition) == std::string(word));
  }
  for (const char* word : comm_wait_names) {
    c.pipeline.comm_wait = word;
    CHECK(to_string(options_of(c).comm_wait) == std::string(word));
  }
  c.pipeline.remat = "sometimes";
  CHECK_THROWS_WITH_AS(validate(c), doctest::Contains("unknown --remat 'sometimes'"), UserError);
  c.pipeline.remat = "never";
  c.trace = "t.json";
  c.trace_steps = 3;
  CHECK(options_of(c).trace_steps == 3);
  c.trace.clear();
  CHECK(options_of(c).trace_steps == 0);
  c.pipeline.comm_poll_us = 250;
  CHECK(options_of(c).comm_poll_s == doctest::Approx(250e-6));
}

TEST_CASE("traffic between hosts: each rank order's bytes out of the busiest host, and --rank-order auto's choice") {
  // D = 2 x K = 2 on two hosts of two ranks each: pipeline order keeps each replica's
  // stages on one host (its sums cross), data order each stage's replicas (its cuts cross).
  TrainConfig c = test::tiny_gpt({.layers = 4, .batch_size = 16});
  c.micro_batches = 4;
  c.pipeline.grid = GridShape{.stages = 2, .replicas = 2, .rank_order = "auto"};
  const Model model(options_of(c).model);
  const Plan plan = make_plan(options_of(c), 4, model);
  CHECK(plan.grid.rank_order == "pipeline");  // auto without hosts
  const std::vector<std::string> two{"a", "a", "b", "b"};
  const HostTraffic pipe = host_traffic(plan, model, two);
  CHECK(pipe.boundary == 0);
  // A ring of two: each rank sends 2 (D - 1) / D = 1 of its stage's gradients; the
  // busiest host holds stage 0 of one replica and stage 1 of it: both stages' sums.
  CHECK(pipe.sums == doctest::Approx(plan.weight_memory(0, false).gradients + plan.weight_memory(1, false).gradients));
  // --overlap-steps keeps a second copy of the weights, but sums one gradient buffer.
  Plan overlap = plan;
  overlap.options.overlap_steps = true;
  REQUIRE(overlap.weight_memory(0, false).gradients > plan.weight_memory(0, false).gradients);
  CHECK(host_traffic(overlap, model, two).sums == doctest::Approx(pipe.sums));
  Plan data = plan;
  data.grid.rank_order = "data";
  const HostTraffic cut = host_traffic(data, model, two);
  CHECK(cut.sums == 0);
  const std::vector<double> bytes = boundary_bytes(model, plan.micro_batch_size);
  // Both replicas' cuts leave host a (stage 0): activations on, half of each cut's bytes.
  CHECK(cut.boundary == doctest::Approx(2 * 4 * bytes[static_cast<std::size_t>(plan.partition.end(0))] / 2));
  // This model's weights outweigh its activations: stages across hosts (data order).
  REQUIRE(cut.total() < pipe.total());
  std::string why;
  CHECK(choose_rank_order(plan, model, two, &why) == "data");
  CHECK(why.find("pipeline order") != std::string::npos);
  // One host: nothing crosses, nothing to choose.
  CHECK(host_traffic(plan, model, {"a", "a", "a", "a"}).total() == 0);
  CHECK(choose_rank_order(plan, model, {"a", "a", "a", "a"}) == "pipeline");
  // Long sequences of a narrow model: activations outweigh weights, the pipeline order.
  c = test::tiny_gpt({.layers = 4, .batch_size = 64});
  c.model.seq_len = 256;
  c.micro_batches = 4;
  c.pipeline.grid = GridShape{.stages = 2, .replicas = 2, .rank_order = "auto"};
  const Model narrow(options_of(c).model);
  CHECK(choose_rank_order(make_plan(options_of(c), 4, narrow), narrow, two) == "pipeline");
}

TEST_CASE("a split backward computes the last stage's cheap top weight gradients in B and gives their memory back there") {
  // The quickstart's GPT at K = 2: the loss, the 256-word head (its W 3% of the stage's
  // backward) and the final LayerNorm are B's whole; the blocks keep their W.
  TrainConfig c = test::tiny_gpt({.layers = 4, .d_model = 128, .heads = 4, .seq_len = 64, .vocab = 256, .dropout = 0.0f,
                                  .batch_size = 16, .micro_batches = 4});
  c.pipeline.schedule = "zb-h1";
  c.pipeline.grid = GridShape{.stages = 2, .replicas = 1};
  const Model model(options_of(c).model);  // embedding 0, blocks 1-4, layernorm 5, head 6, loss 7
  CHECK(weights_in_backward_from(model, 3, 8) == 5);
  CHECK(weights_in_backward_from(model, 0, 3) == 3);  // not the last stage: its output is sent from that memory
  const Plan plan = make_plan(options_of(c), 2, model);
  REQUIRE(plan.partition.begin(1) == 3);
  const StageMemory& last = plan.memory[1];
  // The layernorm's output and statistics, the logits, the loss's: (N, C) + 2 N + (N, V) + N + 1 floats.
  const double N = 4 * 64;
  const auto rounded = [](double floats) { return static_cast<double>(Arena::rounded(static_cast<std::size_t>(floats * 4))); };
  CHECK(last.released == doctest::Approx(rounded(N * 128) + 2 * rounded(N) + rounded(N * 256) + rounded(N) + rounded(1)).epsilon(0.01));
  CHECK(last.one_before_backward);         // zb-h1's last stage: each F's B comes next
  CHECK_FALSE(plan.memory[0].one_before_backward);
  CHECK(plan.memory[0].released == 0);
  // Its W-pending micro-batch holds less by that much, and the one in B too.
  StageMemory kept = last;
  kept.released = 0;
  CHECK(last.held(2, false, true) <= kept.held(2, false, true) - 2 * last.released + last.whole_scratch);
  // The simulator's W on that stage has the blocks' alone.
  double blocks = 0;
  const auto shapes = model.shapes(plan.micro_batch_size);
  for (int i = 3; i < 5; ++i) blocks += model.layer(i).cost(shapes[static_cast<std::size_t>(i)]).weight_flops;
  CHECK(plan.flops.weight[1] == doctest::Approx(blocks));

  // A head whose W is dear (vocabulary 4096 on 64 channels: more than 1/8 of the stage's
  // backward) keeps its W, and so the memory; only the loss's goes.
  TrainConfig big = c;
  big.model.vocab = 4096;
  big.model.d_model = 64;
  const Model wide(options_of(big).model);
  CHECK(weights_in_backward_from(wide, 3, 8) == 7);
}

TEST_CASE("a bf16 plan counts activations, their gradients and messages at 2 bytes, statistics and indices at 4") {
  // The GPT (LayerNorm's statistics, the log-sum-exp) and a ResNet (BatchNorm's
  // statistics, the stem's max-pool indices) at K = 2: every activation figure of bf16 on a
  // GPU is fp32's with the 4-byte-element part halved, slightly above half.
  TrainConfig gpt = test::tiny_gpt({.layers = 4, .d_model = 64, .heads = 4, .seq_len = 32, .vocab = 64, .batch_size = 16,
                                    .micro_batches = 4});
  TrainConfig resnet = gpt;
  resnet.model.kind = "resnet";
  resnet.model.layers = 18;
  resnet.model.image = 32;
  resnet.model.width = 16;
  resnet.model.classes = 10;
  for (TrainConfig c : {gpt, resnet}) {
    CAPTURE(c.model.kind);
    c.pipeline.grid = GridShape{.stages = 2, .replicas = 1};
    c.device = "cuda";
    const Model model(options_of(c).model);
    const Plan fp32 = make_plan(options_of(c), 2, model);
    c.precision = "bf16";
    const Plan bf16 = make_plan(options_of(c), 2, model);
    for (int s = 0; s < 2; ++s) {
      CAPTURE(s);
      const StageMemory &a = fp32.memory[static_cast<std::size_t>(s)], &b = bf16.memory[static_cast<std::size_t>(s)];
      CHECK(b.activation > 0.5 * a.activation);
      CHECK(b.activation < 0.56 * a.activation);
      CHECK(b.boundary == doctest::Approx(0.5 * a.boundary));
      CHECK(b.output == doctest::Approx(0.5 * a.output));
      CHECK(b.scratch == doctest::Approx(0.5 * a.scratch));
      CHECK(bf16.activation_bytes(s) < 0.56 * fp32.activation_bytes(s));
    }
  }
}

TEST_CASE("a loss writes its logits' gradient over the logits: the plan holds no (rows, vocabulary) scratch for it") {
  // GPT: embedding 0, blocks 1-2, layernorm 3, head 4, loss 5; a 4096-word vocabulary on
  // 64 channels, so that the logits dwarf everything else a backward holds.
  TrainConfig c = test::tiny_gpt({.layers = 2, .d_model = 64, .heads = 4, .seq_len = 32, .vocab = 4096, .dropout = 0.0f,
                                  .batch_size = 16, .micro_batches = 4});
  const Model model(options_of(c).model);
  const auto shapes = model.shapes(4);
  CHECK(gradient_in_place(model, 5, 0, shapes[5]));
  CHECK_FALSE(gradient_in_place(model, 5, 5, shapes[5]));  // the stage's first: its gradient is the message back
  CHECK_FALSE(gradient_in_place(model, 4, 0, shapes[4]));  // the head writes its own
  CHECK_FALSE(gradient_in_place(model, 3, 0, shapes[3]));
  const double logits = 4.0 * static_cast<double>(shapes[5].numel());
  for (const char* schedule : {"gpipe", "zb-h1"}) {
    CAPTURE(schedule);
    c.pipeline.schedule = schedule;
    c.pipeline.grid = GridShape{.stages = 2, .replicas = 1};
    const Plan plan = make_plan(options_of(c), 2, model);
    REQUIRE(plan.partition.end(1) == 6);
    REQUIRE(plan.partition.begin(1) < 5);
    const StageMemory& last = plan.memory[1];
    // Without it the loss's gradient took a (rows, vocabulary) buffer of the backward's.
    CHECK(last.scratch < 0.25 * logits);
    CHECK(last.split_scratch < 0.25 * logits);
    CHECK(last.whole_scratch < 0.25 * logits);
    CHECK(last.activation > logits);  // the logits themselves stay counted
  }
  // Per pixel too: the rows are read where they lie, each gradient element from its logit.
  CHECK(CrossEntropyLoss().gradient_over_input(Shape{2, 3, 8, 8}));
  CHECK(CrossEntropyLoss().gradient_over_input(Shape{2, 8, 3}));
}
