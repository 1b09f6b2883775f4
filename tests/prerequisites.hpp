// What a test case needs of the machine, named by a tag. A case that needs a CUDA device carries
// [gpu]; one that needs PyTorch in the Python venv carries [torch]. The runner
// (tests/test_main.cpp) asks each prerequisite whose tag a selected case carries, once, before
// anything runs, and takes the cases whose prerequisite is missing out of the run: it lists each
// one as skipped, with the reason, counts them, and exits 77 when nothing else was selected
// (CTest's SKIP_RETURN_CODE). A skipped case is therefore never counted as passed.
//
// A prerequisite is registered where its cases are defined:
//   const kvaudit_test::PrerequisiteRegistration torch_needed("torch", [] { ... });
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace kvaudit_test {

struct PrerequisiteState {
  bool present = false;
  // Missing: why, in one line ("no CUDA device: ..."). Present: what was found, printed once
  // before the run, or empty.
  std::string note;
};

struct Prerequisite {
  std::string tag;  // lower case, without brackets: "gpu"
  std::function<PrerequisiteState()> probe;
};

// Every registered prerequisite (registration happens during static initialisation).
std::vector<Prerequisite>& prerequisites();

struct PrerequisiteRegistration {
  PrerequisiteRegistration(std::string tag, std::function<PrerequisiteState()> probe);
};

}  // namespace kvaudit_test
