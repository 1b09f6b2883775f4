// The DSA indexer under FP8 (docs/indexer-fp8.md): the Python suite
// python/tests/test_indexer_fp8.py run under the venv's interpreter with KVAUDIT_REQUIRE_HF=1 (so a
// missing transformers fails instead of skipping) against this build's kvaudit and this checkout's
// kvdump package: the deployed quantizer against hand-worked values, planted defects (rotation
// skipped, scale not a power of two, a tie counted as a miss, damaged cache writes) caught, the
// command's refusals, and a tiny GLM-5 capture with its indexer cache (kvdump v1.2) that `kvaudit
// info` lists and whose stored cache and top-k are the deployed rule's. (Debian's python3 runs the
// same suite, without the capture, in "python kvdump writer: its unittest suite passes".)
//
// The interpreter: $KVAUDIT_PYTHON, else build/python-venv/bin/python. [torch]: skipped, by name,
// where that interpreter has no torch (tests/prerequisites.hpp).
#include <catch2/catch.hpp>

#include "tests/python/python_suite.hpp"

TEST_CASE("indexer fp8: the deployed quantization, recall with ties, cache integrity, capture",
          "[python][torch][hf]") {
  kvaudit_test::check_python_suite("test_indexer_fp8", "indexer_fp8", 23);
}
