// Index checks on an in-memory step (kvdump-v1 "Semantics" and "Errors"), for the code that
// indexes a pool with a StepMeta it did not read from a file itself (the reference, the cpu-fp8
// backend): a bad index is an Error value, never an out-of-bounds read.
#pragma once

#include <cstdint>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

// Checks the index arrays of an in-memory step (kvdump-v1 rules the reader enforces on files):
// sizes B+1/B/Nq, monotone indptrs, page ids and slots in range, every row at a position >= 0.
// where = "step <group>". Used by the reference and by the cpu-fp8 backend before they index.
Status check_step_indices(const StepMeta& step, int page_size, std::int64_t num_slots);

}  // namespace kvaudit
