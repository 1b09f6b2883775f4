// The kernels' operands per kvdump form (see mla_attention_operands.hpp).
#include "src/backend/mla_attention_operands.hpp"

#include <vector>

#include "src/format/group_scales.hpp"

namespace kvaudit {
namespace {

GroupWriteFault group_write_fault_of(Injection injection) {
  switch (injection) {
    case Injection::kScaleOneWrite:
      return GroupWriteFault::kScaleOne;
    case Injection::kZeroGroupScale:
      return GroupWriteFault::kZeroGroupScale;
    case Injection::kRopeOutsideCalibration:
      return GroupWriteFault::kRopeLatentScale;
    case Injection::kKvScaleSplit:
      return GroupWriteFault::kKvScaleSplit;
    default:
      return GroupWriteFault::kNone;
  }
}

GroupReadFault group_read_fault_of(Injection injection) {
  switch (injection) {
    case Injection::kScaleReadAsPowerOfTwo:
      return GroupReadFault::kScaleAsPowerOfTwo;
    case Injection::kScaleReadAsE8m0:
      return GroupReadFault::kScaleAsE8m0;
    default:
      return GroupReadFault::kNone;
  }
}

}  // namespace

Status write_grouped_step(const StepMeta& step, std::span<const float> new_kv, float kv_scale,
                          bool reciprocal_scale, KvPool& pool, Injection injection) {
  const std::size_t width = static_cast<std::size_t>(pool.row_width);
  if (!pool.grouped() || new_kv.size() != step.new_kv_slots.size() * width) {
    return internal_error("step " + step.group, "grouped write: pool or new_kv size mismatch");
  }
  const GroupWriteFault fault = group_write_fault_of(injection);
  for (std::size_t i = 0; i < step.new_kv_slots.size(); ++i) {
    write_grouped_row(pool, step.new_kv_slots[i], new_kv.data() + i * width, kv_scale,
                      reciprocal_scale, fault);
  }
  return ok_status();
}

AttentionOperands attention_operands(const StepLayerInput& input, const KvPool& pool,
                                     Injection injection) {
  AttentionOperands operands{attention_view(input.attrs, input.step, input.tensors),
                             input.layer.kv_scale, std::nullopt};
  if (!pool.grouped()) return operands;
  const std::vector<std::int64_t> slots =
      visible_slots(operands.view.step, operands.view.attrs.page_size);
  operands.dequantized = dequantize_grouped_pool_bf16(pool, input.layer.kv_scale,
                                                      group_read_fault_of(injection), slots);
  operands.view.attrs.kv_dtype = KvDtype::kBfloat16;
  operands.kv_scale = 1.0f;
  return operands;
}

}  // namespace kvaudit
