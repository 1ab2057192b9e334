# The libFuzzer targets, one per parser of files that kiln may be handed by someone else. Included
# by tests/CMakeLists.txt (the full build: with g++ they replay their seeds in the suite) and by
# tests/fuzz/CMakeLists.txt (the targets alone, built with clang against a kiln built before:
# tools/fuzz.sh, CI's fuzz step).
#
# kiln_add_fuzz(<name> LABEL <folder> SOURCES <harness> SEEDS <files or folders...>
#               [PARSER <sources...>] [DICT <file>] [SECONDS <n>] [LIBRARIES <targets...>])
# With clang (KILN_FUZZ), the parser's sources are compiled into the target so that libFuzzer's
# coverage and AddressSanitizer instrument them (the rest of kiln comes from the library), and
# the test fuzzes for SECONDS (default 15; KILN_FUZZ_SECONDS, when set, for every target) from
# the seeds, keeping what it finds in a corpus folder of the build tree, so that the fuzz label
# stays a few minutes in all. Otherwise the target is the harness with tests/fuzz_replay.cpp as
# its main, and the test replays the seeds once (the CI's g++ build). Seed folders hold a
# target's regression inputs too.
cmake_path(GET CMAKE_CURRENT_LIST_DIR PARENT_PATH KILN_FUZZ_TESTS_DIR)
cmake_path(GET KILN_FUZZ_TESTS_DIR PARENT_PATH KILN_FUZZ_SOURCE_DIR)

function(kiln_add_fuzz name)
  cmake_parse_arguments(F "" "LABEL;DICT;SECONDS" "SOURCES;PARSER;SEEDS;LIBRARIES" ${ARGN})
  if(NOT F_SECONDS)
    set(F_SECONDS 15)
  endif()
  if(KILN_FUZZ_SECONDS)
    set(F_SECONDS ${KILN_FUZZ_SECONDS})
  endif()
  set(libfuzzer OFF)
  if(KILN_FUZZ AND CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    set(libfuzzer ON)
  endif()
  list(TRANSFORM F_SOURCES PREPEND ${KILN_FUZZ_TESTS_DIR}/)
  if(libfuzzer)
    add_executable(${name} ${F_SOURCES} ${F_PARSER})
    target_compile_options(${name} PRIVATE -fsanitize=fuzzer,address -fno-omit-frame-pointer)
    target_link_options(${name} PRIVATE -fsanitize=fuzzer,address)
    target_link_libraries(${name} PRIVATE ${F_LIBRARIES})
  else()
    add_executable(${name} ${F_SOURCES} ${KILN_FUZZ_TESTS_DIR}/fuzz_replay.cpp)
  endif()
  target_link_libraries(${name} PRIVATE kiln::kiln kiln_warnings)
  # Seed files go in -seed_inputs; seed folders after the corpus folder, which libFuzzer reads
  # too but never writes.
  set(seed_files "")
  set(seed_dirs "")
  foreach(seed ${F_SEEDS})
    if(IS_DIRECTORY ${seed})
      list(APPEND seed_dirs ${seed})
    else()
      list(APPEND seed_files ${seed})
    endif()
  endforeach()
  set(args -max_total_time=${F_SECONDS})
  if(seed_files)
    list(JOIN seed_files "," seeds)
    list(APPEND args -seed_inputs=${seeds})
  endif()
  if(F_DICT)
    list(APPEND args -dict=${F_DICT})
  endif()
  set(corpus ${CMAKE_CURRENT_BINARY_DIR}/${name}_corpus)
  file(MAKE_DIRECTORY ${corpus})
  add_test(NAME ${name} COMMAND ${name} ${args} ${corpus} ${seed_dirs})
  math(EXPR timeout "${F_SECONDS} + 105")
  set_tests_properties(${name} PROPERTIES LABELS "cpu;${F_LABEL};fuzz" TIMEOUT ${timeout})
endfunction()

set(src ${KILN_FUZZ_SOURCE_DIR})
set(here ${KILN_FUZZ_TESTS_DIR})
kiln_add_fuzz(safetensors_fuzz LABEL nn SECONDS 20
  SOURCES nn/safetensors_fuzz.cpp PARSER ${src}/nn/safetensors.cpp
  SEEDS ${here}/nn/data/fixture.safetensors DICT ${here}/nn/data/safetensors.dict)
kiln_add_fuzz(json_fuzz LABEL nn
  SOURCES nn/json_fuzz.cpp
  SEEDS ${here}/nn/data/json_fuzz ${here}/models/data/hf/gemma2/config.json
  DICT ${here}/nn/data/json.dict)
kiln_add_fuzz(hf_config_fuzz LABEL models
  SOURCES models/hf_config_fuzz.cpp PARSER ${src}/models/hf_config.cpp
  SEEDS ${here}/models/data/hf/llama/config.json ${here}/models/data/hf/llama3/config.json
    ${here}/models/data/hf/mistral/config.json ${here}/models/data/hf/gemma/config.json
    ${here}/models/data/hf/gemma2/config.json ${here}/models/data/hf_config_fuzz
  DICT ${here}/models/data/hf_config.dict)
kiln_add_fuzz(hf_index_fuzz LABEL models
  SOURCES models/hf_index_fuzz.cpp PARSER ${src}/models/hf_weights.cpp
  SEEDS ${here}/models/data/hf_index_fuzz DICT ${here}/models/data/hf_index.dict)
# read_checkpoint_info lives in one of the trainer's files: all of them are compiled in.
file(GLOB trainer_sources CONFIGURE_DEPENDS ${src}/models/trainer*.cpp)
kiln_add_fuzz(trainer_state_fuzz LABEL models
  SOURCES models/trainer_state_fuzz.cpp PARSER ${trainer_sources} ${src}/pretrain/loader.cpp
  SEEDS ${here}/models/data/trainer_state_fuzz DICT ${here}/models/data/trainer_state.dict)
kiln_add_fuzz(run_config_fuzz LABEL models
  SOURCES models/run_config_fuzz.cpp PARSER ${src}/models/run_config.cpp
  SEEDS ${src}/examples/kiln-tiny.toml ${here}/models/data/run_config_fuzz
  DICT ${here}/models/data/run_config.dict LIBRARIES tomlplusplus::tomlplusplus)
kiln_add_fuzz(tokenizer_fuzz LABEL text
  SOURCES text/tokenizer_fuzz.cpp
  PARSER ${src}/text/tokenizer_json.cpp ${src}/text/tokenizer.cpp ${src}/text/json_value.cpp
    ${src}/text/bpe.cpp ${src}/text/normalize.cpp ${src}/text/decoders.cpp ${src}/text/regex.cpp
    ${src}/text/unicode.cpp
  SEEDS ${here}/text/data/tokenizer_fuzz ${here}/text/data/llama2.json ${here}/text/data/gpt2.json
  DICT ${here}/text/data/tokenizer.dict LIBRARIES PkgConfig::PCRE2)
kiln_add_fuzz(shard_fuzz LABEL pretrain
  SOURCES pretrain/shard_fuzz.cpp PARSER ${src}/pretrain/shard.cpp
  SEEDS ${here}/pretrain/data/shard_fuzz DICT ${here}/pretrain/data/shard.dict)
