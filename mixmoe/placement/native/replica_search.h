// The source-replica search of mixmoe.placement.replica_search (plan_replicas), compiled.
#pragma once

#include "common.h"

namespace mixmoe_native {

// plan_replicas' search, the decisions every one of its Python paths makes (_ListMixSearch's
// rules: bottleneck first, its shortlist by remote rows descending then expert id, the first
// `width` unblocked candidates evaluated, the first whose step strictly drops accepted).
// `colsum`: C's column sums. `loads`: in, the baseline's (nothing replicated, replica 0); out, the
// accepted plan's (unchanged when nothing is accepted). Returns the accepted experts' holders,
// ascending by g (empty: nothing accepted). `max_replicas` >= 1, `width` >= 1, W >= 2.
Replicas replica_search(const Counts& counts, const Model& model,
                        const std::vector<int64_t>& colsum, Loads& loads, int64_t max_replicas,
                        int64_t width);

}  // namespace mixmoe_native
