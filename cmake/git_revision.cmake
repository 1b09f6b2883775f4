# Writes OUTPUT, a header defining KVAUDIT_GIT_REVISION: the commit SOURCE_DIR is checked out at
# (12 hex digits, "-dirty" when tracked files differ from it), or "unknown" outside a git checkout
# or without git. Run by the kvaudit_git_revision target on every build; the header is rewritten
# only when the revision changes, so only src/core/build_info.cpp recompiles, and only then.
#   cmake -DSOURCE_DIR=... -DOUTPUT=... -P git_revision.cmake
set(revision "unknown")
find_program(git_program git)
if(git_program)
  # Only a source tree that is itself the top of a checkout has a revision: a tarball unpacked
  # inside some other repository must not take that repository's revision.
  execute_process(COMMAND ${git_program} -C ${SOURCE_DIR} rev-parse --show-toplevel
                  OUTPUT_VARIABLE toplevel RESULT_VARIABLE toplevel_status
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(toplevel_status EQUAL 0)
    file(REAL_PATH "${toplevel}" toplevel)
    file(REAL_PATH "${SOURCE_DIR}" source_real)
  endif()
endif()
if(git_program AND toplevel_status EQUAL 0 AND toplevel STREQUAL source_real)
  execute_process(COMMAND ${git_program} -C ${SOURCE_DIR} rev-parse --short=12 HEAD
                  OUTPUT_VARIABLE head RESULT_VARIABLE head_status
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(head_status EQUAL 0 AND NOT head STREQUAL "")
    set(revision "${head}")
    execute_process(COMMAND ${git_program} -C ${SOURCE_DIR} diff --quiet HEAD --
                    RESULT_VARIABLE dirty_status OUTPUT_QUIET ERROR_QUIET)
    if(NOT dirty_status EQUAL 0)
      set(revision "${head}-dirty")
    endif()
  endif()
endif()
file(WRITE ${OUTPUT}.tmp "#pragma once\n#define KVAUDIT_GIT_REVISION \"${revision}\"\n")
configure_file(${OUTPUT}.tmp ${OUTPUT} COPYONLY)
file(REMOVE ${OUTPUT}.tmp)
