// --save-outputs: an HDF5 file with what `kvaudit check` computed per (step, layer), so a user can
// look at the outputs themselves (numpy/h5py) or diff two runs.
//
// Layout, one group per reported (step, layer), named as in the dump:
//   /steps/S###/L###/reference_out         float64 [Nq, H, Dc]  R8 (reference on the FP8 pool)
//   /steps/S###/L###/reference_lse         float64 [Nq, H]      natural log
//   /steps/S###/L###/reference_source_out  float64 [Nq, H, Dc]  Rs, only when the source is known
//   /steps/S###/L###/reference_source_lse  float64 [Nq, H]
//   /steps/S###/L###/backend_out           u16 [Nq, H, Dc], bf16 bits, attribute dtype="bfloat16"
//   /steps/S###/L###/backend_lse           float32 [Nq, H]
// Root attributes: format = "kvaudit-outputs", dump (path of the replayed dump), backend.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "src/core/result.hpp"
#include "src/replay/replay.hpp"

namespace kvaudit {

class OutputsWriter {
 public:
  // Creates (overwrites) the file.
  static Result<OutputsWriter> create(const std::filesystem::path& path,
                                      const std::string& dump_path, const std::string& backend);
  OutputsWriter(OutputsWriter&&) noexcept;
  OutputsWriter& operator=(OutputsWriter&&) noexcept;
  ~OutputsWriter();

  Status write(const StepLayerOutputs& outputs);
  Status close();

 private:
  struct Impl;
  explicit OutputsWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvaudit
