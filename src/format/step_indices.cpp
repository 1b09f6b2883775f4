// The index rules of one step (src/format/step_indices.hpp).
#include "src/format/step_indices.hpp"

#include <string>

namespace kvaudit {

Status validate_step_indices(const StepMeta& step, std::int64_t num_pages, int page_size,
                             const std::string& where) {
  auto at = [&](const char* name) { return where + "/" + name; };
  const auto& qo = step.qo_indptr;
  const auto& kv = step.kv_indptr;
  if (qo.empty()) return bad_input(at("qo_indptr"), "is empty; expected [B+1] entries");
  const std::size_t batch = qo.size() - 1;
  if (kv.size() != qo.size()) {
    return bad_input(at("kv_indptr"), "has " + std::to_string(kv.size()) +
                                          " entries; qo_indptr has " + std::to_string(qo.size()) +
                                          " (both are [B+1])");
  }
  if (step.kv_last_page_len.size() != batch) {
    return bad_input(at("kv_last_page_len"), "has " + std::to_string(step.kv_last_page_len.size()) +
                                                 " entries; expected B = " + std::to_string(batch));
  }
  for (const auto* indptr : {&qo, &kv}) {
    const char* name = indptr == &qo ? "qo_indptr" : "kv_indptr";
    if ((*indptr)[0] != 0) {
      return bad_input(at(name), "starts at " + std::to_string((*indptr)[0]) + ", not 0");
    }
    for (std::size_t b = 0; b < batch; ++b) {
      if ((*indptr)[b + 1] < (*indptr)[b]) {
        return bad_input(at(name), "is not monotone: [" + std::to_string(b + 1) +
                                       "] = " + std::to_string((*indptr)[b + 1]) + " < [" +
                                       std::to_string(b) + "] = " + std::to_string((*indptr)[b]));
      }
    }
  }
  if (static_cast<std::size_t>(kv.back()) != step.kv_indices.size()) {
    return bad_input(at("kv_indptr"), "ends at " + std::to_string(kv.back()) + "; kv_indices has " +
                                          std::to_string(step.kv_indices.size()) + " entries");
  }
  if (static_cast<std::size_t>(qo.back()) != step.new_kv_slots.size()) {
    return bad_input(at("qo_indptr"), "ends at Nq = " + std::to_string(qo.back()) +
                                          "; new_kv_slots has " +
                                          std::to_string(step.new_kv_slots.size()) + " entries");
  }
  for (std::size_t i = 0; i < step.kv_indices.size(); ++i) {
    if (step.kv_indices[i] < 0 || step.kv_indices[i] >= num_pages) {
      return bad_input(at("kv_indices"),
                       "[" + std::to_string(i) + "] = " + std::to_string(step.kv_indices[i]) +
                           " is out of range (num_pages = " + std::to_string(num_pages) + ")");
    }
  }
  for (std::size_t b = 0; b < batch; ++b) {
    const std::int32_t pages = kv[b + 1] - kv[b];
    const std::int32_t last = step.kv_last_page_len[b];
    if (pages == 0 ? last != 0 : (last < 1 || last > page_size)) {
      return bad_input(at("kv_last_page_len"),
                       "[" + std::to_string(b) + "] = " + std::to_string(last) +
                           " for a request with " + std::to_string(pages) + " page(s); expected " +
                           (pages == 0 ? std::string("0") : "1.." + std::to_string(page_size)));
    }
    const std::int64_t rows = qo[b + 1] - qo[b];
    const std::int64_t tokens = step.kv_len(static_cast<int>(b), page_size);
    if (rows > tokens) {
      return bad_input(where, "request " + std::to_string(b) + " has " + std::to_string(rows) +
                                  " query rows but " + std::to_string(tokens) +
                                  " tokens: a row would see zero tokens");
    }
    if (step.kind == StepKind::kDecode && rows > 1) {
      return bad_input(where, "decode step has " + std::to_string(rows) + " rows for request " +
                                  std::to_string(b) + "; at most one is allowed");
    }
  }
  for (std::size_t b = 0; b < batch; ++b) {
    for (std::int32_t row = qo[b]; row < qo[b + 1]; ++row) {
      const std::int64_t position = step.position_of_row(row, page_size);
      const std::int64_t slot = step.slot_of(static_cast<int>(b), position, page_size);
      if (step.new_kv_slots[row] != slot) {
        return bad_input(at("new_kv_slots"), "[" + std::to_string(row) +
                                                 "] = " + std::to_string(step.new_kv_slots[row]) +
                                                 " but row " + std::to_string(row) + " (request " +
                                                 std::to_string(b) + ", token position " +
                                                 std::to_string(position) + ") is slot " +
                                                 std::to_string(slot));
      }
    }
  }
  return ok_status();
}

Status check_step_indices(const StepMeta& step, int page_size, std::int64_t num_slots) {
  const std::string where = "step " + step.group;
  if (page_size < 1) return bad_input(where, "page_size must be >= 1");
  if (num_slots % page_size != 0) {
    return bad_input(where, "a pool of " + std::to_string(num_slots) +
                                " slots is not a whole number of pages of " +
                                std::to_string(page_size));
  }
  return validate_step_indices(step, num_slots / page_size, page_size, where);
}

}  // namespace kvaudit
