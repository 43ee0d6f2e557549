# Compile options shared by every kvsparse target (never by third-party code).
# kvsparse_target_defaults(<target>) applies warnings-as-errors, sanitizers and the repo-root
# include directory (includes are written by full path from the repo root: "kvstore/store.h").

if(KVSPARSE_SANITIZE AND KVSPARSE_TSAN)
  message(FATAL_ERROR "KVSPARSE_SANITIZE and KVSPARSE_TSAN are exclusive")
endif()

set(KVSPARSE_SANITIZER_FLAGS "")
if(KVSPARSE_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "KVSPARSE_FUZZ needs clang (CXX=clang++)")
  endif()
  set(KVSPARSE_SANITIZER_FLAGS -fsanitize=fuzzer-no-link,address,undefined
                               -fno-sanitize-recover=all -fno-omit-frame-pointer)
elseif(KVSPARSE_SANITIZE)
  set(KVSPARSE_SANITIZER_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all
                               -fno-omit-frame-pointer)
elseif(KVSPARSE_TSAN)
  set(KVSPARSE_SANITIZER_FLAGS -fsanitize=thread -fno-omit-frame-pointer)
endif()
if(KVSPARSE_SANITIZER_FLAGS)
  # -O1 and line tables only (after the build type's -O2 -g, so they win): what the sanitizers'
  # reports need (file:line stacks), at 0.4x the compile time of -O2 -g under ASan (store_test.cc:
  # 28 s against 67 s on the 2-core build machine).
  list(APPEND KVSPARSE_SANITIZER_FLAGS -O1 -g1)
  # Applied globally so that gtest and the objects we link agree on the runtime.
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${KVSPARSE_SANITIZER_FLAGS}>")
  add_link_options(${KVSPARSE_SANITIZER_FLAGS})
endif()

function(kvsparse_target_defaults target)
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
                                              $<INSTALL_INTERFACE:include>)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wnon-virtual-dtor>
    # __FILE__ relative to the repository (flags' --help, log lines): no build machine's paths.
    $<$<COMPILE_LANGUAGE:CXX>:-fmacro-prefix-map=${PROJECT_SOURCE_DIR}/=>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${KVSPARSE_WERROR}>>:-Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${KVSPARSE_WERROR}>>:-Werror=all-warnings>)
endfunction()

# kvsparse_test(<name> SOURCES ... LIBS ... [LABELS ...] [TIMEOUT s] [SLOW_FILTER pattern])
# A GoogleTest binary registered with ctest, one ctest entry per binary (fast to list and run).
# SLOW_FILTER: the binary's tests matching this gtest pattern run as a second entry,
# <name>_slow, labelled slow (the sanitizer builds skip that label), and not in the first.
# A binary labelled slow is not built at all in the sanitizer builds.
function(kvsparse_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT;SLOW_FILTER" "SOURCES;LIBS;LABELS" ${ARGN})
  # The sanitizer builds run ctest -LE slow: tests labelled slow are not built there.
  if("slow" IN_LIST ARG_LABELS AND KVSPARSE_SANITIZER_FLAGS)
    return()
  endif()
  add_executable(${name} ${ARG_SOURCES})
  kvsparse_target_defaults(${name})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main)
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  if(ARG_SLOW_FILTER)
    add_test(NAME ${name} COMMAND ${name} --gtest_filter=-${ARG_SLOW_FILTER})
    add_test(NAME ${name}_slow COMMAND ${name} --gtest_filter=${ARG_SLOW_FILTER})
    set_tests_properties(${name}_slow PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "slow;${ARG_LABELS}")
  else()
    add_test(NAME ${name} COMMAND ${name})
  endif()
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT})
  if(ARG_LABELS)
    set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}")
  endif()
endfunction()

# kvsparse_check_layer(<target> FORBID <regex>...)
# Fails the configure step if the target links a library matching one of the regexes: each
# module's library may link only the modules before it (kernels -> kvstore -> engine -> server
# -> client), as scripts/check_layering.sh checks for includes.
function(kvsparse_check_layer target)
  cmake_parse_arguments(ARG "" "" "FORBID" ${ARGN})
  if(NOT TARGET ${target})
    return()
  endif()
  get_target_property(libs ${target} LINK_LIBRARIES)
  foreach(lib IN LISTS libs)
    foreach(bad IN LISTS ARG_FORBID)
      if(lib MATCHES "${bad}")
        message(FATAL_ERROR "layering: ${target} must not link ${lib}")
      endif()
    endforeach()
  endforeach()
endfunction()
