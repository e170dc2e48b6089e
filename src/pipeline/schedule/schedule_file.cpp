// Schedule files (--schedule file:PATH): their text, read into a Schedule, placed and
// checked against the run.
#include "mpipe/pipeline/schedule/schedule.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "mpipe/core/error.hpp"
#include "mpipe/pipeline/comm/comm.hpp"

namespace mpipe {

Schedule parse_schedule(const std::string& text, const std::string& source) {
  const std::string hint = "write one line per stage, e.g. 'stage 0: F0 F1 B0 B1' (mpipe plan --write-schedule)";
  std::map<int, std::vector<Action>> lists;
  std::istringstream in(text);
  std::string line;
  int number = 0, micro_batches = 0;
  while (std::getline(in, line)) {
    ++number;
    if (const auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    std::istringstream words(line);
    std::string word;
    if (!(words >> word)) continue;  // blank
    const std::string at = cat(source, " line ", number);
    std::string label;
    words >> label;
    MPIPE_REQUIRE(word == "stage" && label.size() > 1 && label.back() == ':' &&
                      std::all_of(label.begin(), label.end() - 1, [](char c) { return c >= '0' && c <= '9'; }) &&
                      label.size() <= 6,
                  hint, at, ": expected 'stage N:', got '", word, " ", label, "'");
    const int stage = std::stoi(label.substr(0, label.size() - 1));
    MPIPE_REQUIRE(!lists.count(stage), "give each stage one line", at, ": stage ", stage, " again");
    auto& list = lists[stage];
    while (words >> word) {
      Action a;
      try {
        a = parse_action(word);
      } catch (const Error&) {
        throw UserError(cat(at, ": '", word, "' is not an action"), "write F<micro-batch>, B<micro-batch> or W<micro-batch>, e.g. F3");
      }
      MPIPE_REQUIRE(a.is_compute(), "give only F, B and W actions: the sends and receives are inserted", at, ": ", word,
                    " is a communication action");
      MPIPE_REQUIRE(a.micro_batch <= max_tagged_messages, cat("use at most ", max_tagged_messages, " micro-batches"), at, ": ", word, " is beyond them");
      micro_batches = std::max(micro_batches, a.micro_batch + 1);
      list.push_back(a);
    }
  }
  MPIPE_REQUIRE(!lists.empty(), hint, source, " has no stage lines");
  const int stages = static_cast<int>(lists.size());
  MPIPE_REQUIRE(lists.rbegin()->first == stages - 1, "number the stages 0 to K-1", source, " has ", stages,
                " stage lines but a stage ", lists.rbegin()->first);
  Schedule s = empty_schedule(source, stages, std::max(micro_batches, 1));
  for (auto& [stage, list] : lists) s.actions[static_cast<std::size_t>(stage)] = std::move(list);
  return s;
}

namespace {

// A schedule file with virtual stages places each model stage on the line whose actions
// name it (a model stage no line names stays on its round-robin line, where validate()
// finds it missing); every line must then hold --virtual-stages of them.
void place_from_actions(Schedule& s, const std::string& source) {
  const int stages = s.model_stages();
  s.placement = round_robin_placement(s.stages, s.virtual_stages);
  std::vector<int> named(static_cast<std::size_t>(stages), -1);
  for (int list = 0; list < s.stages; ++list)
    for (const Action& a : s.actions[static_cast<std::size_t>(list)]) {
      const int m = s.stage_of(list, a);
      if (m >= stages) continue;  // validate() names it
      int& on = named[static_cast<std::size_t>(m)];
      MPIPE_REQUIRE(on < 0 || on == list, "run each model stage's actions on one stage (rank)", source, ": model stage ", m,
                    " is on stage ", on, " and on stage ", list, " (", to_string(a), ")");
      on = list;
    }
  for (int m = 0; m < stages; ++m)
    if (named[static_cast<std::size_t>(m)] >= 0) s.placement[static_cast<std::size_t>(m)] = named[static_cast<std::size_t>(m)];
  for (int list = 0; list < s.stages; ++list) {
    const std::vector<int> mine = s.stages_of(list);
    const std::string names = listed(mine);
    MPIPE_REQUIRE(static_cast<int>(mine.size()) == s.virtual_stages,
                  cat("give each stage ", s.virtual_stages, " model stages (--virtual-stages)"), source, ": stage ", list,
                  " runs model stage", mine.size() == 1 ? " " : "s ", names.empty() ? "none" : names, ", not ",
                  s.virtual_stages);
  }
}

// A zero-bubble generator by name; an --in-flight too small for any order is a UserError

}  // namespace

Schedule load_schedule_file(const std::string& path, const std::string& name, int stages, int micro_batches,
                            int virtual_stages) {
  const std::string source = cat("schedule file '", path, "'");
  std::error_code ec;
  MPIPE_REQUIRE(std::filesystem::is_regular_file(path, ec), "give the path of a schedule file (mpipe plan --write-schedule)",
                source, " is not a regular file");
  std::ifstream file(path);
  std::ostringstream text;
  text << file.rdbuf();
  MPIPE_REQUIRE(file.good() || file.eof(), "check the file's permissions", source, " cannot be read");
  Schedule s = parse_schedule(text.str(), source);
  s.name = name;
  MPIPE_REQUIRE(s.stages == stages, cat("write one line for each of the ", stages, " stages"), source, " has ",
                s.stages, " stages, the run ", stages);
  s.micro_batches = micro_batches;  // validate() names an action beyond them, or one missing
  s.virtual_stages = virtual_stages;  // and an action on a stage beyond them
  if (virtual_stages > 1) place_from_actions(s, source);
  if (auto problem = validate(lower(s))) {
    const std::string first_line = problem->substr(0, problem->find('\n'));
    throw UserError(cat(source, ": ", first_line), "each stage runs F0, F1, ..., B0, B1, ... (and W0, W1, ... or none) in ascending order, each B after its F and each W after its B, with no cycle of waits (docs/schedules.md)");
  }
  return s;
}

}  // namespace mpipe
