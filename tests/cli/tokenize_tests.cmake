# mpipe tokenize: shards, determinism across --threads, bad tokenizer files and inputs.
add_test(NAME cli.tokenize COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/tokenize_test.sh ${MPIPE} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.tokenize PROPERTIES LABELS unit TIMEOUT 120)
mpipe_cli_test(help_lists_tokenize 0 "  tokenize +Encode text files with a tokenizer" --help)
mpipe_cli_test(tokenize_needs_tokenizer 2 "error: --tokenizer is required" tokenize x --out y)
