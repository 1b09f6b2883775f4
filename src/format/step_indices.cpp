// The index rules of one step (src/format/step_indices.hpp), checked in a fixed order so that a
// step breaking several rules always gives the same message: the sizes of the index datasets, the
// indptr values, the page ids, each request's last page and rows, then new_kv_slots (each row's
// slot, then no slot written twice).
#include "src/format/step_indices.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace kvaudit {
namespace {

// `where` is the step; errors about one dataset name it below the step.
struct StepSite {
  const std::string& where;

  std::string at(const char* name) const { return where + "/" + name; }
};

// [B+1] indptrs, kv_last_page_len [B].
Status check_index_sizes(const StepMeta& step, const StepSite& site) {
  const auto& qo = step.qo_indptr;
  const auto& kv = step.kv_indptr;
  if (qo.empty()) return bad_input(site.at("qo_indptr"), "is empty; expected [B+1] entries");
  const std::size_t batch = qo.size() - 1;
  if (kv.size() != qo.size()) {
    return bad_input(
        site.at("kv_indptr"),
        fmt::format("has {} entries; qo_indptr has {} (both are [B+1])", kv.size(), qo.size()));
  }
  if (step.kv_last_page_len.size() != batch) {
    return bad_input(site.at("kv_last_page_len"), fmt::format("has {} entries; expected B = {}",
                                                              step.kv_last_page_len.size(), batch));
  }
  return ok_status();
}

// Starts at 0 and never decreases.
Status check_indptr(const std::vector<std::int32_t>& indptr, const char* name,
                    const StepSite& site) {
  if (indptr[0] != 0) {
    return bad_input(site.at(name), fmt::format("starts at {}, not 0", indptr[0]));
  }
  for (std::size_t b = 0; b + 1 < indptr.size(); ++b) {
    if (indptr[b + 1] < indptr[b]) {
      return bad_input(site.at(name), fmt::format("is not monotone: [{}] = {} < [{}] = {}", b + 1,
                                                  indptr[b + 1], b, indptr[b]));
    }
  }
  return ok_status();
}

// kv_indptr ends at the size of kv_indices, qo_indptr at the size of new_kv_slots (Nq).
Status check_indptr_ends(const StepMeta& step, const StepSite& site) {
  const std::int32_t pages = step.kv_indptr.back();
  const std::int32_t rows = step.qo_indptr.back();
  if (static_cast<std::size_t>(pages) != step.kv_indices.size()) {
    return bad_input(site.at("kv_indptr"), fmt::format("ends at {}; kv_indices has {} entries",
                                                       pages, step.kv_indices.size()));
  }
  if (static_cast<std::size_t>(rows) != step.new_kv_slots.size()) {
    return bad_input(site.at("qo_indptr"),
                     fmt::format("ends at Nq = {}; new_kv_slots has {} entries", rows,
                                 step.new_kv_slots.size()));
  }
  return ok_status();
}

Status check_page_ids(const StepMeta& step, std::int64_t num_pages, const StepSite& site) {
  for (std::size_t i = 0; i < step.kv_indices.size(); ++i) {
    if (step.kv_indices[i] < 0 || step.kv_indices[i] >= num_pages) {
      return bad_input(site.at("kv_indices"),
                       fmt::format("[{}] = {} is out of range (num_pages = {})", i,
                                   step.kv_indices[i], num_pages));
    }
  }
  return ok_status();
}

// Per request b: kv_last_page_len[b] in 1..page_size (0 without pages), no more rows than tokens
// (a row would see zero tokens), at most one row in a decode step.
Status check_requests(const StepMeta& step, int page_size, const StepSite& site) {
  const auto& qo = step.qo_indptr;
  const auto& kv = step.kv_indptr;
  for (std::size_t b = 0; b + 1 < qo.size(); ++b) {
    const std::int32_t pages = kv[b + 1] - kv[b];
    const std::int32_t last = step.kv_last_page_len[b];
    if (pages == 0 ? last != 0 : (last < 1 || last > page_size)) {
      const std::string expected = pages == 0 ? "0" : fmt::format("1..{}", page_size);
      return bad_input(site.at("kv_last_page_len"),
                       fmt::format("[{}] = {} for a request with {} page(s); expected {}", b, last,
                                   pages, expected));
    }
    const std::int64_t rows = qo[b + 1] - qo[b];
    const std::int64_t tokens = step.kv_len(static_cast<int>(b), page_size);
    if (rows > tokens) {
      return bad_input(site.where,
                       fmt::format("request {} has {} query rows but {} tokens: a row would see "
                                   "zero tokens",
                                   b, rows, tokens));
    }
    if (step.kind == StepKind::kDecode && rows > 1) {
      return bad_input(
          site.where,
          fmt::format("decode step has {} rows for request {}; at most one is allowed", rows, b));
    }
  }
  return ok_status();
}

// new_kv_slots[row] is the slot of the row's token position.
Status check_new_kv_slots(const StepMeta& step, int page_size, const StepSite& site) {
  const auto& qo = step.qo_indptr;
  for (std::size_t b = 0; b + 1 < qo.size(); ++b) {
    for (std::int32_t row = qo[b]; row < qo[b + 1]; ++row) {
      const std::int64_t position = step.position_of_row(row, page_size);
      const std::int64_t slot = step.slot_of(static_cast<int>(b), position, page_size);
      if (step.new_kv_slots[row] != slot) {
        return bad_input(site.at("new_kv_slots"),
                         fmt::format("[{}] = {} but row {} (request {}, token position {}) is "
                                     "slot {}",
                                     row, step.new_kv_slots[row], row, b, position, slot));
      }
    }
  }
  return ok_status();
}

// No two rows write the same slot: the writes of one step are concurrent on a GPU (one thread
// block per row or token), so two of them to one slot race and the pool the step leaves is not
// defined. Requests that share pages (a common prefix) reach this only through a wrong page table.
Status check_distinct_slots(const StepMeta& step, const StepSite& site) {
  std::vector<std::pair<std::int32_t, std::int32_t>> slot_rows;  // (slot, row)
  slot_rows.reserve(step.new_kv_slots.size());
  for (std::size_t row = 0; row < step.new_kv_slots.size(); ++row) {
    slot_rows.emplace_back(step.new_kv_slots[row], static_cast<std::int32_t>(row));
  }
  std::sort(slot_rows.begin(), slot_rows.end());
  for (std::size_t i = 1; i < slot_rows.size(); ++i) {
    if (slot_rows[i].first == slot_rows[i - 1].first) {
      return bad_input(
          site.at("new_kv_slots"),
          fmt::format("rows {} and {} both write slot {}: two writes of one slot in "
                      "one step would race",
                      slot_rows[i - 1].second, slot_rows[i].second, slot_rows[i].first));
    }
  }
  return ok_status();
}

}  // namespace

Status validate_step_indices(const StepMeta& step, std::int64_t num_pages, int page_size,
                             const std::string& where) {
  const StepSite site{where};
  KVAUDIT_TRY(check_index_sizes(step, site));
  KVAUDIT_TRY(check_indptr(step.qo_indptr, "qo_indptr", site));
  KVAUDIT_TRY(check_indptr(step.kv_indptr, "kv_indptr", site));
  KVAUDIT_TRY(check_indptr_ends(step, site));
  KVAUDIT_TRY(check_page_ids(step, num_pages, site));
  KVAUDIT_TRY(check_requests(step, page_size, site));
  if (step.attention_only) return ok_status();  // its rows write nothing
  KVAUDIT_TRY(check_new_kv_slots(step, page_size, site));
  return check_distinct_slots(step, site);
}

std::vector<std::int64_t> visible_slots(const StepMeta& step, int page_size) {
  std::vector<std::int64_t> slots;
  for (int b = 0; b < step.batch_size(); ++b) {
    if (step.rows_of(b) == 0) continue;
    const std::int64_t len = step.kv_len(b, page_size);
    for (std::int64_t p = 0; p < len; ++p) slots.push_back(step.slot_of(b, p, page_size));
  }
  std::sort(slots.begin(), slots.end());
  slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
  return slots;
}

std::vector<std::int64_t> held_slots(const StepMeta& step, int page_size) {
  std::vector<std::int64_t> slots;
  for (int b = 0; b < step.batch_size(); ++b) {
    const std::int64_t len = step.kv_len(b, page_size);
    for (std::int64_t p = 0; p < len; ++p) slots.push_back(step.slot_of(b, p, page_size));
  }
  std::sort(slots.begin(), slots.end());
  slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
  return slots;
}

Status check_topk_indices(const StepMeta& step, int page_size, std::span<const std::int32_t> topk,
                          int k, const std::string& where) {
  const int rows = step.num_rows();
  if (k < 1 || topk.size() != static_cast<std::size_t>(rows) * k) {
    return bad_input(
        where, fmt::format("holds {} entries; expected [Nq = {}, K >= 1]", topk.size(), rows));
  }
  std::vector<std::int32_t> listed;
  for (int row = 0; row < rows; ++row) {
    const std::int64_t position = step.position_of_row(row, page_size);
    listed.clear();
    for (int j = 0; j < k; ++j) {
      const std::int32_t p = topk[static_cast<std::size_t>(row) * k + j];
      if (p == -1) continue;
      if (p < 0 || p > position) {
        return bad_input(where, fmt::format("[{}, {}] = {}: row {} sits at token position {} and "
                                            "sees positions 0..{} (-1 pads)",
                                            row, j, p, row, position, position));
      }
      listed.push_back(p);
    }
    if (listed.empty()) {
      return bad_input(where, fmt::format("row {} lists no token position (all -1)", row));
    }
    std::sort(listed.begin(), listed.end());
    const auto twice = std::adjacent_find(listed.begin(), listed.end());
    if (twice != listed.end()) {
      return bad_input(where, fmt::format("row {} lists token position {} twice", row, *twice));
    }
  }
  return ok_status();
}

AttentionView attention_view(const DumpAttributes& attrs, const StepMeta& step,
                             const StepLayerTensors& tensors) {
  if (!tensors.sparse()) return {attrs, step};
  AttentionView view{attrs, {}};
  view.attrs.page_size = 1;  // kv_indices below are slots
  StepMeta& sparse = view.step;
  sparse.group = step.group;
  sparse.kind = StepKind::kDecode;
  sparse.attention_only = true;
  const int rows = step.num_rows();
  const int k = tensors.topk;
  sparse.qo_indptr.push_back(0);
  sparse.kv_indptr.push_back(0);
  std::vector<std::int32_t> positions;
  for (int row = 0; row < rows; ++row) {
    const int request = step.request_of_row(row);
    positions.clear();
    for (int j = 0; j < k; ++j) {
      const std::int32_t p = tensors.topk_indices[static_cast<std::size_t>(row) * k + j];
      if (p >= 0) positions.push_back(p);
    }
    std::sort(positions.begin(), positions.end());
    for (const std::int32_t p : positions) {
      sparse.kv_indices.push_back(
          static_cast<std::int32_t>(step.slot_of(request, p, attrs.page_size)));
    }
    sparse.qo_indptr.push_back(row + 1);
    sparse.kv_indptr.push_back(static_cast<std::int32_t>(sparse.kv_indices.size()));
    sparse.kv_last_page_len.push_back(positions.empty() ? 0 : 1);
    sparse.new_kv_slots.push_back(positions.empty() ? -1 : sparse.kv_indices.back());
  }
  return view;
}

Status check_step_indices(const StepMeta& step, int page_size, std::int64_t num_slots) {
  const std::string where = "step " + step.group;
  if (page_size < 1) return bad_input(where, "page_size must be >= 1");
  if (num_slots % page_size != 0) {
    return bad_input(where, fmt::format("a pool of {} slots is not a whole number of pages of {}",
                                        num_slots, page_size));
  }
  return validate_step_indices(step, num_slots / page_size, page_size, where);
}

}  // namespace kvaudit
