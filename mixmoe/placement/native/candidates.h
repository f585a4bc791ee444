// plan_mix's other starts: FasterMoE's shadowed experts (mixmoe.placement.shadow.shadow_hot) and
// the spread start (mixmoe.placement.spread.spread_start), compiled.
#pragma once

#include "common.h"

namespace mixmoe_native {

// shadow.shadow_hot(C, shape, profile, colsum, own): the shadowed experts, ascending (empty when
// W == 1). t_row_feat, t_model: shadow_hot's two floats, computed by the caller as it does.
std::vector<int64_t> shadow_hot(const Counts& counts, const std::vector<int64_t>& colsum,
                                const std::vector<int64_t>& own, double t_row_feat,
                                double t_model);

// spread.spread_start(C, colsum, E, slots): {g: holders} as Replicas (ascending g).
Replicas spread_start(const Counts& counts, const std::vector<int64_t>& colsum, int64_t slots);

}  // namespace mixmoe_native
