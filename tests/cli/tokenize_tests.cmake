# mpipe tokenize: shards, determinism across --threads, bad tokenizer files and inputs.
add_test(NAME cli.tokenize COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/tokenize_test.sh ${MPIPE} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.tokenize PROPERTIES LABELS unit TIMEOUT 120)
mpipe_cli_test(help_lists_tokenize 0 "  tokenize +Encode text files with a tokenizer" --help)
mpipe_cli_test(tokenize_needs_tokenizer 2 "error: --tokenizer is required" tokenize x --out y)
# train --tokenizer (issue 65 item 5): text: data only, the file checked at start-up by name;
# the checkpoint, generate and export side: tests/checkpoint/tokenizer_test.sh.
mpipe_cli_test(train_tokenizer_needs_text 2
  "error: --tokenizer 'tokenizer.model' turns text into ids, and --data 'synthetic' is not text: data; hint: tokens: files are already ids \\(write them with 'mpipe tokenize'\\)"
  train --tokenizer tokenizer.model --steps 1)
mpipe_cli_test(train_tokenizer_config_tokens 2
  "error: --tokenizer 'tokenizer.model' turns text into ids, and --data 'tokens:train.bin' is not text: data"
  train --config ${CMAKE_CURRENT_SOURCE_DIR}/cli/configs/tokenizer_tokens.toml --steps 1)
mpipe_cli_test(train_tokenizer_missing 2 "error: no tokenizer file '/no/such/tokenizer.model'"
  train --data text:${CMAKE_SOURCE_DIR}/README.md --tokenizer /no/such/tokenizer.model --vocab 512 --layers 1 --d-model 8 --heads 1 --steps 1)
mpipe_cli_test(train_tokenizer_not_one 2 "error: '${CMAKE_SOURCE_DIR}/inputs/mlp.toml' is not a tokenizer"
  train --data text:${CMAKE_SOURCE_DIR}/README.md --tokenizer ${CMAKE_SOURCE_DIR}/inputs/mlp.toml --vocab 512 --layers 1 --d-model 8 --heads 1 --steps 1)
mpipe_cli_test(train_help_tokenizer 0 "--tokenizer TEXT +A tokenizer file" train --help)
