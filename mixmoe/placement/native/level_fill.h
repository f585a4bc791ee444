// The level fill (level_fill.cpp) as the compiled planner calls it (FillSettings.per_node: the
// relay's nodes; the search itself prices on one link, as planner._water_fill's).
#pragma once

#include "common.h"

namespace mixmoe_native {

struct FillSettings {  // plan_mix's _water_fill arguments
  int64_t slots, blk, passes;  // replica slots per rank, rows per block, LEVEL_PASSES
  double stop;                 // FILL_STOP
  bool kept;                   // level_fill(kept=True)
  // false: FillOut's ranges and kept left empty, fill_plan fills them later (plan_mix reads
  // them of the one fill it keeps; W = 1024 zipf: ~1.5 ms a fill, memory-bound reads of C)
  bool plan = true;
  int64_t per_node = 0;  // the profile's ranks per node (relay.nodes_of); 0: one link
  // a fill across nodes (StepModel.fill_link's bw_near, bw_far): the copies priced by the link
  // they cross (RangeState.split); 0.0: every copy on the fill's one link
  double bw_near = 0.0, bw_far = 0.0;
  double beat = INF;  // level_fill's beat: the step the fill must beat (FillOut.beaten)
};

// What plan_mix reads of a RangeState after its fill.
struct FillOut {
  int64_t moves = 0;  // the pieces moved (RangeState.moves); -2: the start is level (no pass ran)
  Loads loads;        // rows, local, remote, replica
  std::vector<double> totals;
  int64_t rounds = 0;
  std::vector<char> overshot;          // per rank: RangeState.overshot
  bool beaten = false;                 // RangeState.beaten: it cannot beat settings.beat
  Replicas replicas;                   // RangeState.plan_fields(): hot with their holders,
  ExpertEntries ranges, kept;          // the ranges and the kept entries (FillSettings.plan)
  ExpertEntries amounts, kept_local;   // RangeState.amounts and .kept (all entries): fill_plan's
};

// RangeState(model, C, E, start, slots, blk, distance, colsum, any_remote, start_loads) after
// level_fill.level_fill(state, passes, stop, kept), and its plan_fields(). `start`: the start
// holders; `start_loads`: plan_pricing of the start plan under relay (its first 4 rows);
// distance: relay.nodes_of(settings.per_node), None when it is 0.
// `own`: C[g / E][g] per expert (Baseline.own), or empty (read from C here).
FillOut level_fill(const Counts& counts, const std::vector<int64_t>& colsum,
                   const std::vector<int64_t>& own, const Model& model, const Replicas& start,
                   bool any_remote, const Loads& start_loads, const FillSettings& settings);

// out.ranges and out.kept (RangeState.plan_fields) from out.replicas, out.amounts and
// out.kept_local, for a level_fill run with settings.plan false: the same entries it would have
// filled. `counts`, `blk`: level_fill's.
void fill_plan(const Counts& counts, int64_t blk, FillOut& out);

}  // namespace mixmoe_native
