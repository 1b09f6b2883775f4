#!/usr/bin/env bash
# The main job: build kvaudit (scripts/setup.sh), then check the shipped GLM-5-shaped dump with the
# cpu-fp8 backend (the CPU model of the FP8 kernel) against the high-precision reference, and write
# a report directory (report.json, report.md, report.html).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
build_dir=${KVAUDIT_BUILD_DIR:-build}
kvaudit="$build_dir/kvaudit"
report_dir="$build_dir/main-job/report"

echo "== kvaudit info datasets/glm5_page1.h5"
"$kvaudit" info datasets/glm5_page1.h5

echo "== kvaudit check datasets/glm5_page1.h5 --report $report_dir"
"$kvaudit" check datasets/glm5_page1.h5 --backend cpu-fp8 --report "$report_dir" --verbose
echo "report: $report_dir/report.html, $report_dir/report.md and $report_dir/report.json"
