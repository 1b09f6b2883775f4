// `kvaudit check --backend exec:NAME` against programs that break the protocol or the pool
// (tests/backend/fakes/: fake_backend.py, a proxy in front of `kvaudit backend-serve cpu-fp8`
// that misbehaves at step 1 of the first layer, and refuse_hello.sh): each failure of the program
// is exit 2 with one line naming the backend, the request, the step and the layer; a pool that
// the program damages is judged like a built-in backend's (storage, written_slots /
// unwritten_slots findings); a program that does not answer is ended after
// KVAUDIT_BACKEND_TIMEOUT; the session directory goes away after clean runs, errors and signals;
// the command line refuses what does not fit an exec backend.
#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <thread>

#include "tests/backend/exec_test_support.hpp"

namespace kvaudit {
namespace {

using exec_test::case_dir;
using exec_test::CommandRun;
using exec_test::fake_command;
using exec_test::kvaudit;
using exec_test::quoted;
using exec_test::run_shell;
using exec_test::shell_word;
using exec_test::shipped_dump;

// `KVAUDIT_EXCHANGE_DIR=DIR/exchange [env] kvaudit check glm5_page1 --backend exec:fake
// --backend-command COMMAND --json DIR/report.json [options]`.
CommandRun check_fake(const std::filesystem::path& dir, const std::string& command,
                      const std::string& environment = "", const std::string& options = "") {
  std::filesystem::create_directories(dir / "exchange");
  return run_shell("KVAUDIT_EXCHANGE_DIR=" + quoted(dir / "exchange") + " " + environment + " " +
                       kvaudit() + " check " + quoted(shipped_dump("glm5_page1")) +
                       " --threads 2 --backend exec:fake --backend-command " + shell_word(command) +
                       " --json " + quoted(dir / "report.json") + " " + options,
                   dir);
}

bool exchange_empty(const std::filesystem::path& dir) {
  return std::filesystem::is_empty(dir / "exchange");
}

bool has_failing(const nlohmann::json& report, int step, const std::string& check,
                 const std::string& classification) {
  for (const auto& finding : report.value("integrity", nlohmann::json::array())) {
    if (!finding.value("pass", true) && finding.value("step", -1) == step &&
        finding.value("check", "") == check &&
        finding.value("classification", "") == classification) {
      return true;
    }
  }
  return false;
}

// The one-line error of a program that failed at step 1 of layer 0.
void check_step1_error(const CommandRun& run, const std::string& what) {
  INFO(run.command << "\n" << run.output);
  CHECK(run.status == 2);
  CHECK_THAT(run.output,
             Catch::Contains("kvaudit: exec:fake: step request for step 1 (S001), layer 0 (L000)"));
  CHECK_THAT(run.output, Catch::Contains(what));
}

}  // namespace

TEST_CASE("exec backend: the fake proxy itself changes nothing", "[exec][backend]") {
  const auto dir = case_dir("fake_clean");
  const CommandRun run = check_fake(dir, fake_command("clean"));
  INFO(run.command << "\n" << run.output);
  CHECK(run.status == 0);
  const nlohmann::json report = exec_test::load_json(dir / "report.json");
  CHECK(report.value("verdict", "") == "pass");
  CHECK(report.value("backend", "") == "exec:fake");
  CHECK(exchange_empty(dir));
}

TEST_CASE("exec backend: a program that exits at step 1 is exit 2 naming step, layer and status",
          "[exec][backend]") {
  const auto dir = case_dir("fake_crash");
  const CommandRun run = check_fake(dir, fake_command("crash"));
  check_step1_error(run, "closed its standard output without replying; it exited with status 3");
  CHECK(exchange_empty(dir));
}

TEST_CASE("exec backend: a line that is not a reply is exit 2 quoting it", "[exec][backend]") {
  const auto dir = case_dir("fake_garbage");
  check_step1_error(check_fake(dir, fake_command("garbage")),
                    "a line that is not a reply (a JSON object with a \"type\"; log to standard "
                    "error instead): 'this is not a reply'");
  CHECK(exchange_empty(dir));
}

TEST_CASE("exec backend: an out file of the wrong size or none at all is exit 2",
          "[exec][backend]") {
  const auto short_dir = case_dir("fake_wrong_out_size");
  check_step1_error(check_fake(short_dir, fake_command("wrong-out-size")),
                    "out (bfloat16 [3, 16, 512] in out.bin): the file holds 49150 bytes, not the "
                    "49152 its shape needs");
  const auto missing_dir = case_dir("fake_missing_out");
  check_step1_error(check_fake(missing_dir, fake_command("missing-out")),
                    "out (bfloat16 [3, 16, 512] in out.bin): the file does not exist");
}

TEST_CASE("exec backend: an internal error reply is exit 2 and says the program failed",
          "[exec][backend]") {
  const auto dir = case_dir("fake_error_internal");
  check_step1_error(check_fake(dir, fake_command("error-internal")),
                    "the backend failed (an internal error of the program under test, not of "
                    "kvaudit): CUDA error (fake)");
}

TEST_CASE("exec backend: the tiles a backend's describe declares are the ones p-e4m3-tile replays",
          "[exec][backend]") {
  const auto dir = case_dir("fake_diagnose_tiles");
  const CommandRun run = check_fake(dir, fake_command("diagnose-tiles"));
  INFO(run.command << "\n" << run.output);
  CHECK(run.status == 0);
  CHECK_THAT(run.output, Catch::Contains("p-e4m3-tile replays the backend's KV tiles: 48x3"));

  const auto flag_dir = case_dir("fake_diagnose_tiles_flag");
  const CommandRun flag =
      check_fake(flag_dir, fake_command("diagnose-tiles"), "", "--diagnose-tile 64x2");
  INFO(flag.command << "\n" << flag.output);
  CHECK(flag.status == 0);
  CHECK_THAT(flag.output, !Catch::Contains("replays the backend's KV tiles"));

  const auto bad_dir = case_dir("fake_diagnose_tiles_bad");
  const CommandRun bad = check_fake(bad_dir, fake_command("diagnose-tiles-bad"));
  INFO(bad.command << "\n" << bad.output);
  CHECK(bad.status == 2);
  CHECK_THAT(bad.output, Catch::Contains("backend exec:fake's describe \"diagnose_tiles\": '0x3' "
                                         "is not TILE or TILExSPLITS"));
}

TEST_CASE("exec backend: an unsupported hello is exit 2 with the program's reason",
          "[exec][backend]") {
  const auto dir = case_dir("fake_refuse_hello");
  const std::string script =
      (kvaudit_test::source_dir() / "tests" / "backend" / "fakes" / "refuse_hello.sh").string();
  const CommandRun run = check_fake(dir, "sh " + script);
  INFO(run.command << "\n" << run.output);
  CHECK(run.status == 2);
  CHECK_THAT(run.output, Catch::Contains("kvaudit: exec:fake: hello request: FP8 MLA needs an SM90 "
                                         "GPU (fake)"));
  CHECK_FALSE(std::filesystem::exists(dir / "report.json"));
  CHECK_THAT(run.output, !Catch::Contains("warning"));  // no bye to a program that has gone
  CHECK(exchange_empty(dir));
}

TEST_CASE("exec backend: a program that converts its pool to bf16 fails storage at that step",
          "[exec][backend]") {
  // The fake also requires pool_reloaded at the next step of that layer and only there (exit 4,
  // and so exit 2 here, otherwise).
  const auto dir = case_dir("fake_storage_bf16");
  const CommandRun run = check_fake(dir, fake_command("storage-bf16"));
  INFO(run.command << "\n" << run.output);
  CHECK(run.status == 1);
  const nlohmann::json report = exec_test::load_json(dir / "report.json");
  REQUIRE(report.is_object());
  CHECK(has_failing(report, 1, "storage", ""));
  CHECK_THAT(run.output, Catch::Contains("pool storage changed: float8_e4m3fn 203904 bytes before "
                                         "the step, bfloat16 407808 bytes after"));
  // The replay went on with the reference pool: no later step fails.
  for (const auto& finding : report["integrity"]) {
    if (!finding.value("pass", true)) CHECK(finding.value("step", -1) == 1);
  }
}

TEST_CASE("exec backend: a row written one slot off fails written_slots and unwritten_slots",
          "[exec][backend]") {
  const auto dir = case_dir("fake_wrong_slot");
  const CommandRun run =
      check_fake(dir, fake_command("wrong-slot"), "", "--emit-repro " + quoted(dir / "repro.h5"));
  INFO(run.command << "\n" << run.output);
  CHECK(run.status == 1);
  const nlohmann::json report = exec_test::load_json(dir / "report.json");
  REQUIRE(report.is_object());
  CHECK(has_failing(report, 1, "written_slots", "wrong_slot"));
  CHECK(has_failing(report, 1, "unwritten_slots", "wrong_slot"));
  // The damage stays in the program's pool: later steps read it (cache error), without new
  // write findings.
  CHECK_FALSE(has_failing(report, 2, "unwritten_slots", "other"));
  // --emit-repro names the exec backend and its command for checking the repro.
  CHECK(std::filesystem::exists(dir / "repro.h5"));
  CHECK_THAT(run.output, Catch::Contains("check it with --backend exec:fake --backend-command "));
}

TEST_CASE("exec backend: a program that does not reply is ended after KVAUDIT_BACKEND_TIMEOUT",
          "[exec][backend]") {
  const auto dir = case_dir("fake_sleep");
  const auto pidfile = dir / "fake.pid";
  const auto start = std::chrono::steady_clock::now();
  const CommandRun run = check_fake(dir, fake_command("sleep", "--pidfile " + pidfile.string()),
                                    "KVAUDIT_BACKEND_TIMEOUT=5");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // 5 s, not less: under a loaded parallel test run the fake's Python start-up alone can take
  // seconds, and the hello must not time out before step 1 does.
  check_step1_error(run, "no reply within 5 s (KVAUDIT_BACKEND_TIMEOUT); the program was ended");
  CHECK(seconds < 60);  // the fake sleeps for ten minutes
  const std::string pid = exec_test::read_text(pidfile);
  REQUIRE_FALSE(pid.empty());
  CHECK(exec_test::process_gone_soon(pid));
  CHECK(exchange_empty(dir));
}

TEST_CASE(
    "exec backend: SIGTERM to kvaudit ends the program and removes the session directory and "
    "the outputs' temporaries",
    "[exec][backend]") {
  const auto dir = case_dir("fake_signal");
  std::filesystem::create_directories(dir / "exchange");
  std::filesystem::create_directories(dir / "out");
  const auto pidfile = dir / "fake.pid";
  // kvaudit in the background, writing three outputs (each under a temporary name until the
  // check ends: src/core/output_file.hpp); once the fake sleeps at step 1, SIGTERM to kvaudit.
  const std::string outputs = " --json " + quoted(dir / "out" / "r.json") + " --report " +
                              quoted(dir / "out" / "report") + " --save-outputs " +
                              quoted(dir / "out" / "outputs.h5");
  const std::string script =
      "KVAUDIT_EXCHANGE_DIR=" + quoted(dir / "exchange") + " " + kvaudit() + " check " +
      quoted(shipped_dump("glm5_page1")) + outputs + " --backend exec:fake --backend-command " +
      shell_word(fake_command("sleep", "--pidfile " + pidfile.string())) + " > " +
      quoted(dir / "kvaudit.log") + " 2>&1 & k=$!; for i in $(seq 300); do [ -s " +
      quoted(pidfile) + " ] && break; sleep 0.1; done; kill -TERM $k; wait $k; echo status=$?";
  const CommandRun run = run_shell("sh -c " + shell_word(script), dir);
  INFO(script << "\n" << run.output << exec_test::read_text(dir / "kvaudit.log"));
  CHECK_THAT(run.output, Catch::Contains("status=143"));  // died of SIGTERM, as without kvaudit's
                                                          // handler
  const std::string pid = exec_test::read_text(pidfile);
  REQUIRE_FALSE(pid.empty());
  CHECK(exec_test::process_gone_soon(pid));
  CHECK(exchange_empty(dir));
  // No output appeared, and no temporary (file or staging directory) was left behind.
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator(dir / "out")) {
    left.push_back(entry.path().filename().string());
  }
  CHECK(left == std::vector<std::string>{});
}

TEST_CASE("exec backend: the command line refuses what does not fit an exec backend",
          "[exec][backend]") {
  const auto dir = case_dir("cli_refusals");
  const std::string dump = quoted(shipped_dump("glm5_page1"));
  struct Case {
    std::string arguments;
    std::string message;
  };
  const Case cases[] = {
      {"--backend exec:bad/name --backend-command true",
       "--backend: exec:bad/name: NAME must be letters, digits, '-', '_' or '.'"},
      {"--backend exec: --backend-command true", "NAME must be letters"},
      {"--backend exec:fake --backend-command true --inject bf16-writeback",
       "--inject: injections are for the built-in backends; exec:fake is a program of its own"},
      {"--backend cpu-fp8 --backend-command true",
       "--backend-command: starts an exec:NAME backend; --backend is cpu-fp8"},
  };
  for (const Case& c : cases) {
    const CommandRun run = run_shell(kvaudit() + " check " + dump + " " + c.arguments, dir);
    INFO(run.command << "\n" << run.output);
    CHECK(run.status == 2);
    CHECK_THAT(run.output, Catch::Contains(c.message));
  }
  const CommandRun timeout = run_shell("KVAUDIT_BACKEND_TIMEOUT=soon " + kvaudit() + " check " +
                                           dump + " --backend exec:fake --backend-command true",
                                       dir);
  CHECK(timeout.status == 2);
  CHECK_THAT(timeout.output, Catch::Contains("KVAUDIT_BACKEND_TIMEOUT: 'soon' is not a positive"));
  const CommandRun help = run_shell(kvaudit() + " check --help", dir);
  CHECK_THAT(help.output, Catch::Contains("--backend-command"));
  CHECK_THAT(help.output, Catch::Contains("exec:NAME"));
}

TEST_CASE("exec backend: a command that is not there is exit 2 with the shell's status",
          "[exec][backend]") {
  const auto dir = case_dir("missing_command");
  const CommandRun run = check_fake(dir, "/nonexistent/kvaudit-backend-program");
  INFO(run.output);
  CHECK(run.status == 2);
  CHECK_THAT(run.output, Catch::Contains("kvaudit: exec:fake: hello request:"));
  CHECK_THAT(run.output, Catch::Contains("exited with status 127"));
  CHECK(exchange_empty(dir));
}

}  // namespace kvaudit
