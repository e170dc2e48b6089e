// make_plan: the grid, batch split, partition, schedule, memory and bubbles of a run,
// from its options, the rank count and measured costs.
#include "mpipe/pipeline/plan/plan.hpp"

#include <algorithm>

#include "mpipe/core/error.hpp"

namespace mpipe {

namespace {

// An unsplit backward's scratch on layers [begin, end) (Stage::run_backward): each
// layer's input gradient first-fit in what the forwards of the layers after it allocated
// (their contexts and activations, in order), beside the gradient it reads; those that do
// not fit take two buffers in turns, held through the backward. Beside them, one layer's
// temporaries at a time, less what the spent memory left beside the layer's own two holds
// of them (a convolution's columns, a composite's parts' gradients and columns).
double unsplit_scratch(const Model& model, const std::vector<Shape>& shapes, int begin, int end) {
  const int n = end - begin;
  std::vector<double> start(static_cast<std::size_t>(n) + 1, 0.0);
  std::vector<Cost> costs;
  for (int i = 0; i < n; ++i) {
    costs.push_back(model.layer(begin + i).cost(shapes[static_cast<std::size_t>(begin + i)]));
    start[static_cast<std::size_t>(i) + 1] =
        start[static_cast<std::size_t>(i)] + costs.back().activation_bytes + costs.back().contexts * sizeof(Context);
  }
  const double top = start.back();
  std::vector<double> dx(static_cast<std::size_t>(n), 0.0);
  for (int i = 1; i < n; ++i) {
    const Shape& in = shapes[static_cast<std::size_t>(begin + i)];
    // A gradient written over its input takes no memory of its own (gradient_in_place).
    if (!gradient_in_place(model, begin + i, begin, in)) dx[static_cast<std::size_t>(i)] = f32_bytes(static_cast<double>(in.numel()));
  }
  double turns[2], beside = 0;
  const std::vector<double> at = first_fit(start, dx, 0.0, turns);
  for (int i = n - 1; i >= 0; --i) {
    const auto k = static_cast<std::size_t>(i);
    const Cost& c = costs[k];
    // The spent memory left beside the layer's dx and the dy it reads.
    double free = top - start[k + 1];
    if (at[k] >= 0) free -= dx[k];
    if (k + 1 < at.size() && at[k + 1] >= 0) free -= dx[k + 1];
    // Its temporaries: what it can put in the spent memory left goes there where that has
    // room (Cost::backward_spent_bytes), the rest in scratch.
    const double fixed = c.backward_scratch_bytes - c.backward_spent_bytes;
    beside = std::max(beside, fixed + std::max(0.0, c.backward_spent_bytes - std::max(0.0, free)));
  }
  return turns[0] + turns[1] + beside;
}

// Whether model stage `model_stage` has one micro-batch at most between its F and its B
// at a time (a B right after each F: zb-h1's last stage), so that the others it holds
// wait for their W.
bool one_before_backward(const Schedule& schedule, int model_stage) {
  const int list = schedule.list_of(model_stage);
  int open = 0;
  for (const Action& a : schedule.actions[static_cast<std::size_t>(list)]) {
    if (schedule.stage_of(list, a) != model_stage) continue;
    if (a.kind == ActionKind::forward && open++ > 0) return false;
    if (a.kind == ActionKind::backward) --open;
  }
  return true;
}

// `element`: the bytes of an activation's element (4, or 2 in bf16 training); the costs
// count 4, and their fixed_bytes stay as they are.
std::vector<StageMemory> stage_memory(const Model& model, const Partition& part, int micro, double element) {
  const double e = element / 4.0;
  const auto held = [e](double bytes, double fixed) { return e == 1.0 ? bytes : fixed + e * (bytes - fixed); };
  const auto shapes = model.shapes(micro);
  // An activation, gradient or message: layer `at`'s input (shapes[size()]: the output).
  const auto tensor_bytes = [&](int at) { return element * static_cast<double>(shapes[static_cast<std::size_t>(at)].numel()); };
  std::vector<StageMemory> out(static_cast<std::size_t>(part.stages()));
  for (int s = 0; s < part.stages(); ++s) {
    StageMemory& m = out[static_cast<std::size_t>(s)];
    double peak = 0;  // the forward's: a micro-batch's arena grows to it (temporaries given back)
    // Split, the top layers' weight gradients are B's, and their forward memory dies there.
    const int whole_from = weights_in_backward_from(model, part.begin(s), part.end(s));
    for (int i = part.begin(s); i < part.end(s); ++i) {
      const Cost c = model.layer(i).cost(shapes[static_cast<std::size_t>(i)]);
      const double before = m.activation;
      m.params += static_cast<double>(c.param_bytes) / word_bytes;
      m.activation += c.contexts * static_cast<double>(sizeof(Context));
      peak = std::max(peak, m.activation + held(c.forward_peak(), c.fixed_bytes));
      m.activation += held(c.activation_bytes, c.fixed_bytes);
      // A layer that writes over its input does not over the stage's input (Pass::stage_input).
      if (i == part.begin(s) && model.layer(i).writes_over_input())
        m.activation += tensor_bytes(i + 1);
      // Its own context is in the stage's array, below every layer's memory.
      if (i >= whole_from) m.released += m.activation - before - sizeof(Context);
      m.recomputable += e * c.recomputable_bytes;
      m.recompute_flops += c.recompute_flops;
      // A Linear whose next layer on the stage has no W keeps its dy in its own output's
      // buffer (Stage::backward, keeps_dy_in_output): no stash of its own.
      if (!keeps_dy_in_output(model, i, part.end(s)) && i < whole_from) m.stash += e * c.weight_stash_bytes;
      // A gradient written over its input (gradient_in_place) is held as that input, not
      // as scratch: as the layer's dx, and as the dy of the layer before.
      const auto over_input = [&](int at) {
        return at < part.end(s) && gradient_in_place(model, at, part.begin(s), shapes[static_cast<std::size_t>(at)]);
      };
      const double dx = over_input(i) ? 0.0 : tensor_bytes(i), dy = over_input(i + 1) ? 0.0 : tensor_bytes(i + 1);
      (i >= whole_from ? m.whole_scratch : m.split_scratch) =
          std::max(i >= whole_from ? m.whole_scratch : m.split_scratch, dx + dy + e * c.backward_scratch_bytes);
      m.selective_scratch =
          std::max(m.selective_scratch, dx + dy + e * (c.backward_scratch_bytes + c.recomputable_bytes));
    }
    m.scratch = e * unsplit_scratch(model, shapes, part.begin(s), part.end(s));
    // Skips: one crossing this stage's edge holds its message and its gradient's here; one
    // within it, its gradient in the backward's scratch from its join to its producer.
    for (const Model::Skip& skip : model.skips()) {
      const double bytes = tensor_bytes(skip.producer + 1);
      const bool makes = part.stage_of(skip.producer) == s, takes = part.stage_of(skip.consumer) == s;
      if (makes != takes) m.skips += 2 * bytes;
      if (makes && takes)
        for (double* scratch : {&m.scratch, &m.split_scratch, &m.whole_scratch, &m.selective_scratch}) *scratch += bytes;
    }
    m.forward_peak = std::max(m.activation, peak);
    m.boundary = tensor_bytes(part.begin(s));
    if (s + 1 < part.stages()) m.output = tensor_bytes(part.end(s));
  }
  return out;
}

}  // namespace

int micro_batch_size(const RunOptions& options, int replicas) {
  return options.batch_size / (options.micro_batches * replicas);
}

bool needs_measurement(const RunOptions& options) {
  return options.balance.empty() && options.partition == PartitionBy::time;
}

Plan::WeightMemory Plan::weight_memory(int stage, bool sharded) const {
  double params = 0;
  for (const int m : schedule.stages_of(stage)) params += memory[static_cast<std::size_t>(m)].params;
  const double copies = options.overlap_steps ? 2.0 : 1.0;  // --overlap-steps goes back to a saved copy
  const double states = static_cast<double>(Optimizer::state_names(options.optimizer).size());
  const int shards = sharded ? grid.replicas : 1;
  const bool bf16 = options.device == Device::cuda && options.precision == DType::bf16;
  WeightMemory w;
  w.values = f32_bytes(params) * copies + (bf16 ? 2.0 * params : 0.0);
  w.gradients = f32_bytes(params) * copies;
  w.state = f32_bytes(params) * states / shards * copies;
  const int D = grid.replicas;
  if (D > 1) w.sums = f32_bytes(params) * (D - 1) / D;
  if (options.checkpoint_copy) w.checkpoint_copy = f32_bytes(params) * (1.0 + states / shards);
  return w;
}

double Plan::inputs_bytes(int stage) const {
  double bytes = 0;
  for (const int m : schedule.stages_of(stage)) bytes += input_bytes(stage, m, remat_of(m));
  return bytes;
}

double Plan::activation_bytes(int stage, int model_stage, Remat mode) const {
  const StageMemory& memory_of = memory[static_cast<std::size_t>(model_stage)];
  const int whole = mode == Remat::selective ? whole_of(model_stage) : 0;
  if (whole > 0) {
    const int window = remat_window[static_cast<std::size_t>(model_stage)];
    return memory_of.held_mixed(window, whole, window == options.micro_batches);
  }
  const bool remat = inputs_only(stage, mode);
  const int live = remat ? remat_in_flight(model_stage) : in_flight(schedule, stage, schedule.virtual_stages > 1 ? model_stage : -1);
  return memory_of.held(remat ? send_ring(live) : live, remat, schedule.splits(stage), mode == Remat::selective);
}

int Plan::remat_in_flight(int model_stage) const {
  const Schedule& runs = model_stage + 1 == partition.stages() ? defer_forwards(schedule, model_stage, 0) : schedule;
  return in_flight(runs, schedule.list_of(model_stage), schedule.virtual_stages > 1 ? model_stage : -1);
}

double Plan::input_bytes(int stage, int model_stage, Remat mode) const {
  const double boundary = memory[static_cast<std::size_t>(model_stage)].boundary;
  const double batch = model_stage == 0 ? options.micro_batches * boundary : 0.0;
  // Mixed (auto): the rematerialized ones' inputs are in their activations already.
  if (const int whole = mode == Remat::selective ? whole_of(model_stage) : 0; whole > 0)
    return (remat_window[static_cast<std::size_t>(model_stage)] - whole) * boundary + batch +
           options.micro_batches * memory[static_cast<std::size_t>(model_stage)].skips;
  const double skips = options.micro_batches * memory[static_cast<std::size_t>(model_stage)].skips;
  return (inputs_only(stage, mode) ? 0.0 : in_flight(schedule, stage) * boundary) + batch + skips;
}

double Plan::activation_bytes(int stage) const {
  double bytes = 0;
  for (const int m : schedule.stages_of(stage)) bytes += activation_bytes(stage, m, remat_of(m));
  return bytes;
}

namespace {

// --remat auto: for each pipeline stage, the first of never, selective and always whose
// activations and inputs fit --memory-per-rank beside its weights and state (all of its
// model stages alike; what run_train's memory check counts); always where none does (the
// memory check then says by how much). Always comes second where it recomputes nothing
// (the model's last stage).
// Between selective and always (schedules that do not split B and W, one model stage per
// rank): selective with the fewest micro-batches of every window rematerialized wholly.
void choose_remat(Plan& plan) {
  const double limit = plan.options.memory_per_rank;
  MPIPE_REQUIRE(limit > 0, "e.g. --remat auto --memory-per-rank 8GiB", "--remat auto needs --memory-per-rank");
  const std::size_t n = plan.memory.size();
  plan.stage_remat.assign(n, Remat::always);
  plan.remat_whole.assign(n, 0);
  plan.remat_window.assign(n, 1);
  for (int stage = 0; stage < plan.grid.stages; ++stage) {
    const double room = limit - plan.weight_bytes(stage);
    const std::vector<int> model_stages = plan.schedule.stages_of(stage);
    const auto fits = [&](Remat mode) {
      double bytes = 0;
      for (const int m : model_stages) bytes += plan.activation_bytes(stage, m, mode) + plan.input_bytes(stage, m, mode);
      return bytes <= room;
    };
    const auto set = [&](Remat mode) {
      for (const int m : model_stages) plan.stage_remat[static_cast<std::size_t>(m)] = mode;
    };
    if (fits(Remat::never)) { set(Remat::never); continue; }
    // The model's last stage alone on its rank: always defers its forwards to their
    // backwards, recomputing nothing (Plan::deferred_from), and keeps the least.
    set(Remat::always);
    const auto costs_nothing = [&](int m) { return plan.remat_free(m); };
    if (fits(Remat::always) && std::all_of(model_stages.begin(), model_stages.end(), costs_nothing)) continue;
    set(Remat::selective);
    if (fits(Remat::selective)) continue;
    if (model_stages.size() == 1 && !plan.schedule.splits(stage)) {
      const auto m = static_cast<std::size_t>(model_stages[0]);
      const int live = in_flight(plan.schedule, stage);
      plan.remat_window[m] = live;
      for (int whole = 1; whole < live; ++whole) {
        plan.remat_whole[m] = whole;
        if (fits(Remat::selective)) break;
        plan.remat_whole[m] = 0;
      }
      if (plan.remat_whole[m] > 0) continue;
    }
    set(Remat::always);
  }
}

}  // namespace

Plan make_plan(const RunOptions& o, int ranks, const Model& model, const MeasuredCosts& measured) {
  MPIPE_REQUIRE(ranks > 0, "e.g. --ranks 4", "--ranks must be positive, got ", ranks);
  Plan plan;
  plan.options = o;
  plan.grid = resolve_grid(o.grid, ranks);
  const int K = plan.grid.stages, D = plan.grid.replicas, M = o.micro_batches, v = o.virtual_stages;
  MPIPE_CHECK(M > 0 && o.batch_size % (M * D) == 0, "batch ", o.batch_size, " on ", M, " micro-batches x ", D,
              " replicas (the options' checks let it through)");
  plan.micro_batch_size = micro_batch_size(o, D);
  // The schedule at unit costs: its name, --in-flight and a schedule file are checked
  // here, and its placement (which depends on the name alone) is the partition's.
  const ScheduleKind* kind = find_schedule_kind(o.schedule);
  const Schedule unit = make_schedule(o.schedule, K, M, v, {nullptr, false, o.in_flight});
  const int layers = model.size();
  if (!o.balance.empty()) {
    const Partition given = partition_from_balance(o.balance, layers);
    MPIPE_REQUIRE(given.stages() == K * v,
                  v > 1 ? "give one count per model stage (stages x --virtual-stages)" : "give one count per stage",
                  "--balance has ", given.stages(), " stages, the grid has ", K * v);
  }
  MPIPE_REQUIRE(K * v <= layers, v > 1 ? "use fewer stages or virtual stages, or a deeper model" : "use fewer stages or a deeper model",
                "more stages (", K * v, ") than layers (", layers, "); see 'mpipe plan' for the layer list");

  // --partition time counts links where measured, or configured; without layer times it
  // falls back to the FLOPs.
  const bool timed = needs_measurement(o) && !measured.layer_seconds.empty();
  std::vector<double> links;
  if (timed && K > 1) {
    if (!measured.link_seconds_per_byte.empty()) links = measured.link_seconds_per_byte;
    else if (o.link_seconds_per_byte > 0) links.assign(static_cast<std::size_t>(K), o.link_seconds_per_byte);
  }
  plan.links_measured = !links.empty() && !measured.link_seconds_per_byte.empty();
  plan.partition = choose_partition(o.balance, timed ? "time" : needs_measurement(o) ? "flops" : to_string(o.partition),
                                    model, K, plan.micro_batch_size, measured.layer_seconds, unit.placement_table(), links);
  plan.flops = flop_costs(model, plan.partition, plan.micro_batch_size);
  // Activations, their gradients and messages in the run's precision (bf16 on a GPU).
  plan.memory = stage_memory(model, plan.partition, plan.micro_batch_size,
                             o.device == Device::cuda && o.precision == DType::bf16 ? 2.0 : 4.0);
  // Skips' messages take tags after every model stage's (Transport::skip_tag_base).
  const std::int64_t tags = static_cast<std::int64_t>(plan.partition.stages() + static_cast<int>(model.skips().size())) * M;
  MPIPE_REQUIRE(model.skips().empty() || tags <= max_tagged_messages, "use fewer micro-batches", "--micro-batches ", M, " x (",
                plan.partition.stages(), " model stages + ", model.skips().size(), " skips) is more than the ",
                max_tagged_messages, " messages tags can tell apart");

  // The schedule that runs: the zero-bubble ones ordered for this partition's FLOPs (and
  // for steps back to back), the others as built.
  const bool ordered = kind && kind->ordered_for_costs;
  plan.schedule = lower(ordered ? make_schedule(o.schedule, K, M, v, {&plan.flops, o.overlap_steps, o.in_flight}) : unit);
  if (auto problem = validate(plan.schedule))
    throw Error(cat("schedule ", plan.schedule.name, " is invalid: ", *problem));

  const Schedule unit_lowered = lower(unit);
  const Schedule unit_overlapped = ordered ? lower(make_schedule(o.schedule, K, M, v, {nullptr, true, o.in_flight})) : unit_lowered;
  plan.equal_bubble = simulate(unit_lowered, StageCosts::unit(unit_lowered)).bubble_fraction;
  plan.predicted_bubble = simulate(plan.schedule, plan.flops).bubble_fraction;
  plan.equal_overlap_bubble = steady_state(unit_overlapped, StageCosts::unit(unit_overlapped)).bubble_fraction;
  plan.predicted_overlap_bubble = steady_state(plan.schedule, plan.flops).bubble_fraction;
  plan.unit_cost_bubble = bubble_fraction(plan.schedule, StageCosts::unit(plan.schedule), o.overlap_steps);
  for (int m = 0; m < plan.partition.stages(); ++m)
    plan.named_in_flight.push_back(in_flight(plan.schedule, plan.schedule.list_of(m), v > 1 ? m : -1));
  if (o.remat == Remat::automatic) choose_remat(plan);
  // The model's last stage runs its rematerialized forwards just before their backwards:
  // the schedule says so, for the executor, the simulator and the memory it holds.
  const int last = plan.partition.stages() - 1;
  if (const int from = plan.deferred_from(last); from < M) {
    plan.schedule = defer_forwards(plan.schedule, last, from);
    if (auto problem = validate(plan.schedule))
      throw Error(cat("schedule ", plan.schedule.name, " with deferred forwards is invalid: ", *problem));
    plan.predicted_bubble = simulate(plan.schedule, plan.flops).bubble_fraction;
    plan.predicted_overlap_bubble = steady_state(plan.schedule, plan.flops).bubble_fraction;
    plan.unit_cost_bubble = bubble_fraction(plan.schedule, StageCosts::unit(plan.schedule), o.overlap_steps);
  }
  for (int m = 0; m < plan.partition.stages(); ++m)
    plan.memory[static_cast<std::size_t>(m)].one_before_backward = one_before_backward(plan.schedule, m);
  plan.bubble_formula = M < K || !kind ? "" : kind->bubble_formula(o.in_flight);
  if (plan.bubble_formula.empty()) plan.bubble_formula = "simulated";
  return plan;
}

}  // namespace mpipe
