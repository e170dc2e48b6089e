# Run at every build (cmake -P): writes version.cpp with the current git hash, touching
# the file only when the hash changed so nothing rebuilds needlessly.
set(hash "unknown")
find_package(Git QUIET)
if(GIT_FOUND)
  execute_process(COMMAND ${GIT_EXECUTABLE} rev-parse --short=12 HEAD
    WORKING_DIRECTORY ${SRC} OUTPUT_VARIABLE out OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_QUIET RESULT_VARIABLE rc)
  if(rc EQUAL 0 AND out)
    set(hash ${out})
    execute_process(COMMAND ${GIT_EXECUTABLE} status --porcelain --untracked-files=no
      WORKING_DIRECTORY ${SRC} OUTPUT_VARIABLE dirty ERROR_QUIET)
    if(dirty)
      string(APPEND hash "-dirty")
    endif()
  endif()
endif()
set(MPIPE_GIT_HASH ${hash})
configure_file(${SRC}/src/core/version.cpp.in ${DST}.tmp @ONLY)
file(COPY_FILE ${DST}.tmp ${DST} ONLY_IF_DIFFERENT)
