// kvaudit's model of GLM-5 and DeepSeek-V3.2 attention judged against the models' own code: the
// Python suite python/tests/test_hf_capture.py, run under the venv's interpreter with
// KVAUDIT_REQUIRE_HF=1 (so a missing transformers fails instead of skipping) against this build's
// kvaudit and this checkout's kvdump package. It captures tiny GLM-5 (index_topk 8 below a
// 24-token prefix: really sparse) and DeepSeek-V3.2 (YaRN, mscale_all_dim 1) modules with
// kvdump.hf_capture, and requires kvaudit's exact reference on the captured source rows, mapped
// through the module's W_UV, to equal the module's attention output within the float32-storage
// bound, and planted copies (GLM-5 scale as 1/sqrt(192)'s ratio, the query absorbed with the
// wrong head's W_UK, mscale^2 dropped) to miss it by more than 100 times the bound; and
// kvdump.hf_compare to show FP8's cost after W_UV and o_proj between 2^-8 and 2^-3 rel_l2; and
// kvdump.requantize --kv-scale amax to reproduce the capture's pool, and the pool requantized at
// 1.0 to cost the same as amax/448 where nothing saturates (outlier gain 16) and over 2^-2 and 4x
// amax/448's after o_proj where the outlier channels saturate (gain 512).
//
// The interpreter: $KVAUDIT_PYTHON, else build/python-venv/bin/python (scripts/setup-python.sh
// with KVAUDIT_WITH_TORCH=1 installs torch and transformers 5.25.0). [torch]: skipped, by name,
// where that interpreter has no torch (tests/prerequisites.hpp).
#include <catch2/catch.hpp>

#include "tests/python/python_suite.hpp"

TEST_CASE("hf capture: kvaudit's reference reproduces GLM-5's and DeepSeek-V3.2's own attention",
          "[python][torch][hf]") {
  kvaudit_test::check_python_suite("test_hf_capture", "hf_capture", 9);
}
