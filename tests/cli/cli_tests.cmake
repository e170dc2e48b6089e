# The real binary on good and bad command lines. mpipe_cli_test(name exit-code regex args...)
mpipe_cli_test(version 0 "mpipe [0-9]+\\.[0-9]+\\.[0-9]+ \\(git [0-9a-f]+" --version)
mpipe_cli_test(help 0 "--micro-batches" train --help)
# The commands a user finds in --help: export and generate among them.
mpipe_cli_test(help_lists_export 0 "  export +Write a checkpoint's weights as safetensors" --help)
mpipe_cli_test(help_lists_generate 0 "  generate +Continue a prompt with a GPT checkpoint" --help)
mpipe_cli_test(checkpoint_async_bad 2 "error: --checkpoint-async must be auto, on or off, got 'maybe'; hint" train --checkpoint-async maybe)
mpipe_cli_test(generate_needs_checkpoint 2 "error: --checkpoint is required" generate --prompt x)
mpipe_cli_test(generate_bad_temperature 2 "error: --temperature must be a number from 0, got -1; hint" generate --checkpoint x --temperature -1)
mpipe_cli_test(no_command 2 "error: .*subcommand" )
mpipe_cli_test(unknown_option 2 "error: .*--bogus.*hint" train --bogus 3)
mpipe_cli_test(nonpositive_layers 2 "error: --layers must be positive, got 0; hint" train --layers 0)
mpipe_cli_test(nonpositive_d_model 2 "error: --d-model must be positive" train --d-model -8)
mpipe_cli_test(heads_divide 2 "error: --d-model 30 is not divisible by --heads 4; hint" train --d-model 30 --heads 4)
mpipe_cli_test(batch_divide 2 "error: --batch-size 10 is not divisible by --micro-batches 3; hint" train --batch-size 10 --micro-batches 3)
mpipe_cli_test(missing_data 2 "error: cannot open data file '/no/such/file'; hint" train --data text:/no/such/file)
add_test(NAME cli.empty_data COMMAND bash ${EXPECT} 2 "error: data file '.*' is empty; hint" --
  bash -c "f=$(mktemp) && trap 'rm -f $f' EXIT && ${MPIPE} train --data text:$f")
set_tests_properties(cli.empty_data PROPERTIES LABELS unit TIMEOUT 60)
# Inputs that are no regular file are refused by name, never opened (a FIFO would block).
mpipe_cli_test(data_directory 2 "error: data file '.*' is a directory; hint" train --data text:${CMAKE_CURRENT_SOURCE_DIR})
mpipe_cli_test(data_device 2 "error: data file '/dev/zero' is not a regular file; hint" train --data tokens:/dev/zero)
add_test(NAME cli.data_fifo COMMAND bash ${EXPECT} 2 "error: data file '.*' is not a regular file; hint" --
  bash -c "f=$(mktemp -u) && mkfifo $f && trap 'rm -f $f' EXIT && ${MPIPE} train --data text:$f")
set_tests_properties(cli.data_fifo PROPERTIES LABELS unit TIMEOUT 60)
mpipe_cli_test(short_data 2 "error: data file .* too short for one sample of 100000 tokens" train --data text:${CMAKE_SOURCE_DIR}/inputs/mlp.toml --vocab 256 --layers 1 --d-model 8 --heads 1 --steps 1 --seq-len 100000)
mpipe_cli_test(unwritable_metrics 2 "error: --metrics '/no/such/dir/m.jsonl': no directory '/no/such/dir'; hint" train --metrics /no/such/dir/m.jsonl --steps 1)
mpipe_cli_test(missing_config 2 "error: .*no/such.toml" train --config /no/such.toml)
mpipe_cli_test(quickstart_config 0 "step +3/3 \\| loss" train --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --steps 3 --threads 1)
mpipe_cli_test(mlp_config 0 "step +2/2 \\| loss .* samples/s" train --config ${CMAKE_SOURCE_DIR}/inputs/mlp.toml --steps 2 --threads 1)
mpipe_cli_test(gpt_small_config 0 "gpt model, 19 layer entries \\(mpipe plan lists them\\), 123702528 parameters" train --config ${CMAKE_SOURCE_DIR}/inputs/gpt-small.toml --steps 1 --threads 2 --batch-size 1 --micro-batches 1 --seq-len 64)
# 2.5 GiB and 12-24 s in a release build: not in the sanitizer pass (scripts/test.sh -LE large),
# where it ran into its timeout on a busy machine.
set_tests_properties(cli.gpt_small_config PROPERTIES LABELS "unit;large")
mpipe_cli_test(profile_ops_not_a_step 2 "error: --profile-ops 9 is not a step of this run \\(1 to --steps 3\\); hint" train --steps 3 --profile-ops 9)
mpipe_cli_test(negative_threads 2 "error: --threads must be >= 0, got -1; hint" train --threads -1)
mpipe_cli_test(plan 0 "bubble 20%" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --replicas 2 --schedule 1f1b)
mpipe_cli_test(plan_partition 0 "partition \\(flops\\): 0-2 \\| 3-7" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 2)
mpipe_cli_test(plan_checkpoint_copy 0 "checkpoint copy \\(--checkpoint-async\\) per writing rank: 5.0 MiB 4.9 MiB \\(values and adamw state, in host memory\\)" plan --model gpt --layers 4 --ranks 2 --checkpoint-dir ${CMAKE_CURRENT_BINARY_DIR}/plan-copy --checkpoint-every 10)
# Links under --partition time: a configured bandwidth counts in plan (a slow one pushes
# the cuts to small activations); auto is measured by train only.
mpipe_cli_test(plan_links 0 "links \\(configured\\): 0->1 0.05 GB/s, 1->2 0.05 GB/s, 2->3 0.05 GB/s; per micro-batch, ms by stage: compute [0-9./ ]+, links [0-9./ ]+" plan --model resnet --image 16 --width 4 --classes 10 --batch-size 16 --micro-batches 2 --ranks 4 --partition time --link-bandwidth 0.05)
# GPT-2 small's head as 4 vocabulary chunks over 8 stages: within 5 points of equal stages (60.5% as one layer).
mpipe_cli_test(plan_gpt_small_k8 0 "bubble: 30.4% for equal stages [^,]*, (3[0-4]\\.[0-9]|35\\.[0-4])% predicted" plan --config ${CMAKE_SOURCE_DIR}/inputs/gpt-small.toml --ranks 8 --micro-batches 16)
mpipe_cli_test(head_chunks_zero 2 "error: --head-chunks must be from 1 to the vocabulary's 256, got 0; hint: give from 1 \\(one linear head\\) to --vocab" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --head-chunks 0)
mpipe_cli_test(head_logits_word 2 "error: --head-logits must be keep or recompute, got 'some'; hint: use keep or recompute" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --head-chunks 2 --head-logits some)
mpipe_cli_test(head_logits_one_head 2 "error: --head-logits recompute applies to a head in vocabulary chunks, and --head-chunks is 1; hint: split the head with --head-chunks 2 or more" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --head-logits recompute)
mpipe_cli_test(plan_links_auto 0 "links: not counted \\(plan cannot measure them; give --link-bandwidth GB/s\\)" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 2 --partition time)
mpipe_cli_test(link_bandwidth_word 2 "error: --link-bandwidth 'fast' is not a number; hint: give auto, off, or gigabytes per second" train --link-bandwidth fast)
mpipe_cli_test(link_bandwidth_zero 2 "error: --link-bandwidth must be positive, got 0; hint" plan --ranks 2 --link-bandwidth 0)
mpipe_cli_test(plan_balance 0 "partition \\(balance\\): 0-0 \\| 1-7" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 2 --balance 1,7)
mpipe_cli_test(plan_bad_world 2 "error: world size 3 is not divisible by --stages 2" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 3 --stages 2)
mpipe_cli_test(plan_zb_h1 0 "bubble: 11.1% for equal stages" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --micro-batches 8 --schedule zb-h1)
mpipe_cli_test(plan_zb_h2 0 "bubble: 11.1% for equal stages" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --micro-batches 8 --schedule zb-h2)
# With --overlap-steps ZB-H2's warm-up fills the previous step's cool-down: no bubble left.
mpipe_cli_test(plan_zb_h2_overlap 0 "bubble with --overlap-steps \\(steps back to back, no clipping or skip\\): 0.0% for equal stages" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --micro-batches 8 --schedule zb-h2)
# ZB-V with 3K model stages between F and W (--in-flight 12, 1.5 times 1F1B's memory): no bubble back to back.
mpipe_cli_test(plan_zbv_in_flight 0 "bubble with --overlap-steps \\(steps back to back, no clipping or skip\\): 0.0% for equal stages" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --micro-batches 8 --schedule zbv --in-flight 12)
mpipe_cli_test(in_flight_too_few 2 "error: --in-flight 1 leaves zbv on 4 stages no order that finishes: too few micro-batches between F and W; hint: use --in-flight 2 or more" plan --ranks 4 --micro-batches 8 --schedule zbv --in-flight 1)
# zb-h1 at 1F1B's memory: each stage holds from F to W what 1F1B holds from F to B (stage 3 one micro-batch).
mpipe_cli_test(plan_zb_h1_in_flight_1f1b 0 "bubble: 20.0% for equal stages \\(\\(K-1\\)/\\(1.5M\\+K-1\\)\\)" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --micro-batches 8 --schedule zb-h1 --in-flight 1f1b)
mpipe_cli_test(in_flight_word 2 "error: --in-flight: must be a number of micro-batches \\(0: the schedule's own\\) or 1f1b, got lots; hint" plan --ranks 4 --schedule zb-h1 --in-flight lots)
mpipe_cli_test(in_flight_negative 2 "error: --in-flight: must be a number of micro-batches .* got -1; hint" plan --ranks 4 --schedule zb-h1 --in-flight -1)
mpipe_cli_test(in_flight_1f1b_zbv 2 "error: --in-flight 1f1b with --schedule zbv: the V already holds 1F1B's first rank's memory on every rank; hint" plan --ranks 4 --micro-batches 8 --schedule zbv --in-flight 1f1b)
mpipe_cli_test(in_flight_not_zb 2 "error: --in-flight sets the zero-bubble schedules' memory; --schedule 1f1b has its own; hint" plan --ranks 4 --schedule 1f1b --in-flight 3)
# ZB-V at its bound (K-1)/(6M+K-1) = 3/51; zbv sets --virtual-stages 2 and names its V.
mpipe_cli_test(plan_zbv 0 "bubble: 5.9% for equal stages" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --micro-batches 8 --schedule zbv)
mpipe_cli_test(plan_zbv_placement 0 "virtual stages: 2 per rank, model stages s and 7-s on pipeline stage s \\(a V\\)" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --micro-batches 8 --schedule zbv)
mpipe_cli_test(plan_zbv_virtual 2 "error: --schedule zbv runs two model stages per rank, not --virtual-stages 3; hint" plan --ranks 2 --schedule zbv --virtual-stages 3)
mpipe_cli_test(plan_zbv_too_many 2 "error: more stages \\(10\\) than layers \\(8\\)" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 5 --schedule zbv --batch-size 20 --micro-batches 10)
mpipe_cli_test(plan_interleaved 0 "bubble: 15.8% for equal stages" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --micro-batches 8 --schedule interleaved --virtual-stages 2)
mpipe_cli_test(plan_interleaved_groups 2 "error: --schedule interleaved runs the micro-batches in groups of the 4 stages; 6 is not a multiple of 4; hint: use --micro-batches 8" plan --ranks 4 --batch-size 24 --micro-batches 6 --schedule interleaved --virtual-stages 2)
mpipe_cli_test(plan_virtual_gpipe 2 "error: --schedule gpipe runs one stage per rank, not --virtual-stages 2; hint" plan --ranks 2 --virtual-stages 2)
mpipe_cli_test(plan_virtual_too_many 2 "error: more stages \\(12\\) than layers \\(8\\)" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --schedule interleaved --virtual-stages 3 --micro-batches 8)
mpipe_cli_test(plan_unknown_schedule 2 "error: unknown schedule 'zb'; hint" plan --ranks 2 --schedule zb)
mpipe_cli_test(plan_bad_remat 2 "error: unknown --remat 'sometimes'" plan --ranks 2 --remat sometimes)
mpipe_cli_test(unknown_device 2 "error: unknown --device 'tpu'; hint: use --device cpu, cuda or auto" train --device tpu)
mpipe_cli_test(unknown_precision 2 "error: unknown --precision 'fp8'; hint" train --precision fp8)
mpipe_cli_test(bf16_on_cpu 2 "error: --precision bf16 needs a GPU.*; hint" train --device cpu --precision bf16)
mpipe_cli_test(cuda_graphs_bad 2 "error: unknown --cuda-graphs 'yes'; hint" train --cuda-graphs yes)
mpipe_cli_test(cuda_graphs_on_cpu 2 "error: --cuda-graphs on needs a GPU.*; hint: use --device cuda" train --device cpu --cuda-graphs on)
mpipe_cli_test(channels_last_bad 2 "error: unknown --channels-last 'yes'; hint: use --channels-last on or off" train --channels-last yes)
# Config files are TOML, read by a real parser: a broken one is one line naming the
# file, line and column, exit 2 (a segfault once, for the first), and nothing blocks.
set(CONFIGS ${CMAKE_CURRENT_SOURCE_DIR}/cli/configs)
mpipe_cli_test(config_broken_array 2 "error: config file '.*broken_array.toml' line 1, column 12: .*array.*; hint" train --config ${CONFIGS}/broken_array.toml)
mpipe_cli_test(config_two_values 2 "error: config file '.*two_values.toml' line 2, column 11: .*; hint" train --config ${CONFIGS}/two_values.toml)
mpipe_cli_test(config_duplicate_key 2 "error: config file '.*duplicate_key.toml' line 2, column .*redefine.*'heads'" train --config ${CONFIGS}/duplicate_key.toml)
mpipe_cli_test(config_section 2 "error: config file '.*section.toml' line 1, column 2: sections are not supported \\(\\[model\\]\\)" train --config ${CONFIGS}/section.toml)
mpipe_cli_test(config_list 2 "error: config file '.*list_value.toml' line 1, column 1: balance: lists, dates and times are not option values" train --config ${CONFIGS}/list_value.toml)
mpipe_cli_test(config_directory 2 "error: .*--config.*directory" train --config ${CONFIGS})
add_test(NAME cli.config_fifo COMMAND bash ${EXPECT} 2 "error: config file '.*' is not a regular file; hint" --
  bash -c "f=$(mktemp -u) && mkfifo $f && trap 'rm -f $f' EXIT && ${MPIPE} train --config $f")
set_tests_properties(cli.config_fifo PROPERTIES LABELS unit TIMEOUT 60)
# Numbers that would make a run meaningless are refused; a mistyped command is named.
mpipe_cli_test(unknown_command 2 "error: unknown command 'trian'; hint: use mpipe train, plan, inspect, export, generate or tokenize" trian --steps 3)
mpipe_cli_test(negative_seed 2 "error: --seed: must be an integer from 0 to 2\\^64-1, got -1" train --seed -1)
mpipe_cli_test(infinite_weight_decay 2 "error: --weight-decay must be finite and >= 0, got inf" train --weight-decay inf)
mpipe_cli_test(nan_min_lr_ratio 2 "error: --min-lr-ratio must be in \\[0, 1\\], got nan" train --min-lr-ratio nan)
mpipe_cli_test(negative_trace_steps 2 "error: --trace-steps must be >= 0, got -1" train --trace-steps -1)
mpipe_cli_test(unknown_lr_schedule 2 "error: unknown --lr-schedule 'step'; hint" train --lr-schedule step)
mpipe_cli_test(bad_time_limit 2 "error: --time-limit '2h' is not a duration; hint" train --time-limit 2h)
mpipe_cli_test(unknown_progress 2 "error: unknown --progress 'maybe'; hint" train --progress maybe)
mpipe_cli_test(unknown_comm_wait 2 "error: unknown --comm-wait 'busy'; hint" train --comm-wait busy)
mpipe_cli_test(unknown_prefetch 2 "error: unknown --prefetch 'sometimes'; hint: use --prefetch auto, on or off" train --prefetch sometimes)
# Sizes beyond the machine are refused before anything is allocated; plan allocates nothing.
mpipe_cli_test(layers_beyond 2 "error: --layers 2000000000 is more than mpipe builds \\(100000\\); hint" train --layers 2000000000 --steps 1)
mpipe_cli_test(plan_layers_beyond 2 "error: --layers 2000000000 is more than mpipe builds" plan --layers 2000000000 --ranks 4)
mpipe_cli_test(memory_parameters 2 "error: rank 0 \\(stage 0\\) needs about [0-9.]+ TiB \\(parameters, gradients and adamw state [0-9.]+ TiB, .*\\), this node has [0-9.]+ [GMT]iB per rank for its 1 rank; hint: use more stages" train --model mlp --hidden 10000000 --steps 1)
mpipe_cli_test(memory_activations 2 "error: rank 0 \\(stage 0\\) needs about .*activations of 1 micro-batch [0-9.]+ TiB, inputs [0-9.]+ [GMT]iB\\), this node has" train --layers 2 --d-model 16 --heads 2 --seq-len 64 --vocab 64 --batch-size 200000000 --micro-batches 1 --steps 1)
mpipe_cli_test(plan_huge_model 0 "stage  layers" plan --model mlp --hidden 10000000 --ranks 2)
# Model files (TOML layer lists through the layer registry): one that is not a preset
# trains; a broken one is one line naming the file, the layer and the key, exit 2,
# before anything is allocated.
set(MODELS ${CMAKE_CURRENT_SOURCE_DIR}/cli/models)
mpipe_cli_test(model_file_lm 0 "tiny_lm.toml model, 10 layer entries \\(mpipe plan lists them\\), 25920 parameters" train --model ${MODELS}/tiny_lm.toml --steps 2 --threads 1 --batch-size 4 --micro-batches 2)
mpipe_cli_test(model_file_classifier 0 "classifier.toml model, 6 layer entries \\(mpipe plan lists them\\), 1157 parameters" train --model ${MODELS}/classifier.toml --steps 2 --threads 1 --batch-size 4 --micro-batches 2)
mpipe_cli_test(model_file_plan 0 "partition \\(flops\\): 0-1 \\| 2-9" plan --model ${MODELS}/tiny_lm.toml --ranks 2)
mpipe_cli_test(print_model 0 "^kind = \"cross_entropy\"$" plan --model gpt --layers 2 --d-model 32 --heads 4 --seq-len 16 --vocab 64 --print-model)
mpipe_cli_test(layer_kinds 0 "^  out +output features \\(required\\)$" plan --layer-kinds)
mpipe_cli_test(model_file_missing 2 "error: model file '/no/such.toml' does not exist; hint" train --model /no/such.toml)
mpipe_cli_test(model_file_preset_option 2 "error: --layers sizes the presets \\(gpt, mlp, resnet\\); model file '.*classifier.toml' has its own; hint" train --model ${MODELS}/classifier.toml --layers 3)
mpipe_cli_test(model_file_broken 2 "error: model file '.*broken.toml' line 2, column 1: .*; hint" plan --model ${MODELS}/broken.toml)
mpipe_cli_test(model_file_unknown_kind 2 "error: model file '.*unknown_kind.toml', layer 1 \\(line [0-9]+\\): unknown layer kind 'conv9'; hint: the kinds are embedding, block" train --model ${MODELS}/unknown_kind.toml)
mpipe_cli_test(model_file_unknown_key 2 "error: model file '.*', layer 0 \\(linear\\): unknown key 'outs'; hint: linear takes out, bias, init-std, tie" train --model ${MODELS}/unknown_key.toml)
mpipe_cli_test(model_file_wrong_type 2 "error: model file '.*', layer 0 \\(linear\\): 'out' must be an integer; hint" train --model ${MODELS}/wrong_type.toml)
mpipe_cli_test(model_file_negative 2 "error: model file '.*', layer 0 \\(linear\\): 'out': must be from 1 to 2147483648, got -4; hint" train --model ${MODELS}/negative.toml)
mpipe_cli_test(model_file_missing_option 2 "error: model file '.*', layer 1 \\(block\\): 'heads' is required .*; hint" train --model ${MODELS}/missing_option.toml)
mpipe_cli_test(model_file_no_loss 2 "error: model file '.*', layer 1 \\(relu\\): the last layer must be the loss \\(cross_entropy\\); hint" train --model ${MODELS}/no_loss.toml)
mpipe_cli_test(model_file_bad_tie 2 "error: model file '.*', layer 1 \\(linear\\): 'tie': the embedding's table is 32 x 16, this weight 30 x 16; hint" train --model ${MODELS}/bad_tie.toml)
mpipe_cli_test(model_file_heads 2 "error: model file '.*', layer 1 \\(block\\): 'heads': 3 does not divide the 16 channels coming in; hint" train --model ${MODELS}/heads_divide.toml)
mpipe_cli_test(model_file_both_inputs 2 "error: model file '.*both_inputs.toml' has both 'tokens' and 'input'; hint" train --model ${MODELS}/both_inputs.toml)
# Skips: a join's name stashed nowhere, one name stashed twice, shapes that do not
# concatenate or add, a join before its stash, a stash never taken; one line, exit 2.
mpipe_cli_test(skip_from_empty 2 "error: model file '.*skip_from_empty.toml', layer 1 \\(concat\\): 'from' is empty; hint: give the name an earlier layer stashes" train --model ${MODELS}/skip_from_empty.toml)
mpipe_cli_test(upsample_scale_zero 2 "error: model file '.*upsample_scale_zero.toml', layer 0 \\(upsample2d\\): 'scale': must be from 1 to 64, got 0; hint" train --model ${MODELS}/upsample_scale_zero.toml)
mpipe_cli_test(skip_from_nothing 2 "error: model file '.*skip_from_nothing.toml', layer 1 \\(concat\\): 'from': no layer stashes 'dwon'; hint: stash it first" train --model ${MODELS}/skip_from_nothing.toml)
mpipe_cli_test(skip_stashed_twice 2 "error: model file '.*skip_stashed_twice.toml', layer 1 \\(relu\\): 'stash': 'down' is stashed already by layer 0; hint" train --model ${MODELS}/skip_stashed_twice.toml)
mpipe_cli_test(skip_shapes 2 "error: model file '.*skip_shapes.toml', layer 2 \\(concat\\): 'from': the skip 'down' is \\(4, 8, 8\\) a sample and the input \\(4, 4, 4\\): they do not concatenate along the channels; hint" train --model ${MODELS}/skip_shapes.toml)
mpipe_cli_test(skip_add_shapes 2 "error: model file '.*skip_add_shapes.toml', layer 2 \\(add\\): 'from': the skip 'down' is \\(4, 8, 8\\) a sample and the input \\(6, 8, 8\\): add needs equal shapes; hint" train --model ${MODELS}/skip_add_shapes.toml)
mpipe_cli_test(skip_backwards 2 "error: model file '.*skip_backwards.toml', layer 1 \\(concat\\): 'from': 'later' is stashed by layer 2, not an earlier layer; hint: a skip goes forward" train --model ${MODELS}/skip_backwards.toml)
mpipe_cli_test(skip_unused 2 "error: model file '.*skip_unused.toml', layer 0: 'down' is stashed but no layer takes it; hint" train --model ${MODELS}/skip_unused.toml)
mpipe_cli_test(skip_plan 0 "skip 'level1': layer 5 -> 29, stage 0 -> 2 \\(pipeline stage 0 -> 2\\), 256.0 KiB a micro-batch each way, past 1 stage" plan --model ${PROJECT_SOURCE_DIR}/inputs/unet.toml --ranks 3 --batch-size 16 --micro-batches 4)
mpipe_cli_test(model_file_loss_shape 2 "error: model file '.*loss_shape.toml': the loss gets \\(1, 3, 4\\); a model of inputs needs \\(batch, classes\\) or \\(batch, classes, height, width\\) there; hint" train --model ${MODELS}/loss_shape.toml)
mpipe_cli_test(model_file_embedding_late 2 "error: model file '.*', layer 0 \\(embedding\\): takes token ids.*; hint" train --model ${MODELS}/embedding_late.toml)
mpipe_cli_test(model_file_text_data 2 "error: --data text: files of tokens are for models of tokens \\(gpt\\); hint" train --model ${MODELS}/classifier.toml --data text:${MODELS}/classifier.toml)
mpipe_cli_test(cnn_model 0 "step +2/2 \\| loss .* samples/s" train --model ${CMAKE_SOURCE_DIR}/inputs/cnn.toml --steps 2 --threads 1 --batch-size 8 --micro-batches 2)
# Residual blocks: [[layer.layer]] tables inside a residual only, one level deep, no dropout
# inside (its masks are keyed by the layer), an identity skip only where the shape stays.
mpipe_cli_test(model_file_nested_residual 2 "error: model file '.*', layer 0 \\(residual\\), inner layer 0 \\(residual\\): a residual cannot be inside a residual block; hint" plan --model ${MODELS}/nested_residual.toml)
mpipe_cli_test(model_file_dropout_in_residual 2 "error: model file '.*', layer 0 \\(residual\\), inner layer 1 \\(dropout\\): a dropout cannot be inside a residual block; hint" plan --model ${MODELS}/dropout_in_residual.toml)
mpipe_cli_test(model_file_identity_skip 2 "error: model file '.*', layer 0 \\(residual\\): 'skip': is the identity, but the block maps \\(1, 2, 6, 6\\) to \\(1, 4, 6, 6\\); hint" plan --model ${MODELS}/identity_skip.toml)
mpipe_cli_test(model_file_children 2 "error: model file '.*', layer 0 \\(conv2d\\): a conv2d has inner layers; hint: only a residual block" plan --model ${MODELS}/children_not_residual.toml)
# The resnet preset: trains (CIFAR-sized, a narrow ResNet-18), plans an ImageNet ResNet-50
# without allocating it, and takes only ResNet depths.
mpipe_cli_test(resnet_train 0 "resnet model, 22 layer entries \\(mpipe plan lists them\\), 177602 parameters" train --model resnet --width 8 --image 16 --classes 10 --steps 2 --threads 1 --batch-size 8 --micro-batches 2)
mpipe_cli_test(resnet_plan 0 "7      31-38     relu,residual,global-avgp... +10.99M" plan --model resnet --layers 50 --image 224 --classes 1000 --ranks 8 --micro-batches 32 --batch-size 256)
mpipe_cli_test(resnet_depth 2 "error: --layers 20 is not a ResNet depth; hint: give --layers 18, 34, 50, 101 or 152" train --model resnet --layers 20)
mpipe_cli_test(resnet_image 2 "error: --image must be from 8 to 4096, got 4; hint" plan --model resnet --image 4 --ranks 2)
mpipe_cli_test(batchnorm_unknown 2 "error: unknown --batchnorm 'later'; hint: use --batchnorm micro or deferred" train --batchnorm later)
# No output may overwrite an input (model file, --config, schedule file, data) or a
# checkpoint; each test works on copies in its own directory and checks they are intact.
set(TINY --model gpt --layers 2 --d-model 16 --heads 2 --seq-len 8 --vocab 32 --batch-size 8 --micro-batches 2 --threads 1)
string(REPLACE ";" " " TINY_ARGS "${TINY}")
add_test(NAME cli.output_over_model COMMAND bash ${EXPECT} 2 "error: --summary '.*/m.toml' is the --model file: the run would overwrite its input; hint" --
  bash -c "d=$(mktemp -d) && trap 'rm -rf $d' EXIT && cp ${CMAKE_SOURCE_DIR}/inputs/cnn.toml $d/m.toml && ${MPIPE} train --model $d/m.toml --steps 1 --threads 1 --summary $d/m.toml; rc=$?; cmp -s $d/m.toml ${CMAKE_SOURCE_DIR}/inputs/cnn.toml || exit 99; exit $rc")
add_test(NAME cli.output_over_config COMMAND bash ${EXPECT} 2 "error: --trace '.*/run.toml' is the --config file: the run would overwrite its input; hint" --
  bash -c "d=$(mktemp -d) && trap 'rm -rf $d' EXIT && printf 'steps = 1\\n' > $d/run.toml && ${MPIPE} train ${TINY_ARGS} --config $d/run.toml --trace $d/run.toml; rc=$?; [ \"$(cat $d/run.toml)\" = 'steps = 1' ] || exit 99; exit $rc")
add_test(NAME cli.output_over_schedule COMMAND bash ${EXPECT} 2 "error: --metrics '.*/s.txt' is the --schedule file: the run would overwrite its input; hint" --
  bash -c "d=$(mktemp -d) && trap 'rm -rf $d' EXIT && ${MPIPE} plan ${TINY_ARGS} --ranks 1 --write-schedule $d/s.txt > /dev/null && cp $d/s.txt $d/kept && ${MPIPE} train ${TINY_ARGS} --steps 1 --schedule file:$d/s.txt --metrics $d/s.txt; rc=$?; cmp -s $d/s.txt $d/kept || exit 99; exit $rc")
add_test(NAME cli.output_over_checkpoint COMMAND bash ${EXPECT} 2 "error: --metrics '.*/ckpt-00000001.h5' is a checkpoint's name in --checkpoint-dir '.*'; hint" --
  bash -c "d=$(mktemp -d) && trap 'rm -rf $d' EXIT && ${MPIPE} train ${TINY_ARGS} --steps 1 --checkpoint-dir $d/ck > /dev/null && cp $d/ck/ckpt-00000001.h5 $d/kept && ${MPIPE} train ${TINY_ARGS} --steps 2 --checkpoint-dir $d/ck --metrics $d/ck/ckpt-00000001.h5; rc=$?; cmp -s $d/ck/ckpt-00000001.h5 $d/kept || exit 99; exit $rc")
add_test(NAME cli.output_over_hdf5 COMMAND bash ${EXPECT} 2 "error: --summary '.*/copy.h5' is an HDF5 file; hint" --
  bash -c "d=$(mktemp -d) && trap 'rm -rf $d' EXIT && ${MPIPE} train ${TINY_ARGS} --steps 1 --checkpoint-dir $d/ck > /dev/null && cp $d/ck/ckpt-00000001.h5 $d/copy.h5 && cp $d/copy.h5 $d/kept && ${MPIPE} train ${TINY_ARGS} --steps 1 --summary $d/copy.h5; rc=$?; cmp -s $d/copy.h5 $d/kept || exit 99; exit $rc")
set_tests_properties(cli.output_over_model cli.output_over_config cli.output_over_schedule cli.output_over_checkpoint
  cli.output_over_hdf5 PROPERTIES LABELS unit TIMEOUT 120)
# A model file's unknown kind is named even where the file has too few layers; control
# bytes of model and schedule files come back as '?' (one printable line); a standard
# deviation is at least 0, or -1 where that is the kind's rule.
mpipe_cli_test(unknown_kind_alone 2 "error: model file '.*unknown_kind_alone.toml', layer 0 \\(line 3\\): unknown layer kind 'warp-drive'; hint: the kinds are" plan --model ${MODELS}/unknown_kind_alone.toml --ranks 1)
mpipe_cli_test(control_byte_kind 2 "unknown layer kind 'relu\\?'; hint" plan --model ${MODELS}/control_byte_kind.toml --ranks 1)
mpipe_cli_test(control_byte_schedule 2 "error: schedule file '.*control_bytes.txt' line 1: 'F0\\?\\?' is not an action; hint" train ${TINY} --micro-batches 1 --steps 1 --schedule file:${CMAKE_CURRENT_SOURCE_DIR}/cli/schedules/control_bytes.txt)
mpipe_cli_test(negative_init_std 2 "'init-std': must be a standard deviation, at least 0 \\(or -1: the default rule\\), got -5; hint" plan --model ${MODELS}/negative_init_std.toml --ranks 1)
mpipe_cli_test(negative_init_std_linear 2 "'init-std': must be a standard deviation, at least 0, got -0.5; hint: e.g. init-std = 0.02" plan --model ${MODELS}/negative_init_std_linear.toml --ranks 1)
# Sizes no allocation could take end as that one line too, not as std::bad_alloc: a
# model file's input, and the ResNet preset's head.
mpipe_cli_test(memory_input_size 2 "error: rank 0 \\(stage 0\\) needs about [0-9.]+ TiB \\(.*inputs [0-9.]+ TiB\\), this node has" train --model ${MODELS}/huge_input.toml --steps 1 --threads 1 --batch-size 4 --micro-batches 2)
mpipe_cli_test(memory_classes 2 "error: rank 0 \\(stage 0\\) needs about [0-9.]+ TiB \\(parameters, gradients and adamw state [0-9.]+ TiB" train --model resnet --classes 2000000000 --batch-size 4 --micro-batches 2 --steps 1 --threads 1)
mpipe_cli_test(help_data_hdf5 0 "hdf5:PATH \\(/inputs and /labels" train --help)
# --memory-per-rank: the largest GPT of the quickstart's width on D = 2 x K = 2 under remat always, unsharded and
# sharded (docs/memory.md: trained at 18 blocks sharded it reports 31.5-31.8 MiB per rank; at 19 it is refused).
mpipe_cli_test(plan_largest 0 "largest GPT of this width within --memory-per-rank 32.0 MiB: --layers 12 \\(2.42M parameters\\); with --shard-optimizer over 2 replicas: --layers 16 \\(3.21M parameters\\)" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --replicas 2 --remat always --memory-per-rank 32MiB)
# A size no model of this width fills: the search stops at 4096 blocks and says so (it
# planned models of up to 2^16 blocks, minutes), and one beyond 64 bits is refused.
mpipe_cli_test(plan_largest_huge 0 "largest GPT of this width within --memory-per-rank 16.0 GiB: --layers 4096 or more \\(the search stops there\\)" plan --model gpt --layers 2 --d-model 32 --heads 2 --vocab 64 --seq-len 16 --batch-size 8 --micro-batches 2 --ranks 2 --memory-per-rank 16GiB)
set_tests_properties(cli.plan_largest_huge PROPERTIES TIMEOUT 20)
mpipe_cli_test(plan_memory_overflow 2 "error: --memory-per-rank '1e20GiB' is more than a 64-bit machine addresses \\(16 EiB\\); hint" plan --memory-per-rank 1e20GiB)
# Messages (issue 48 I): each names what is wrong and where, in one printable line.
mpipe_cli_test(time_limit_seconds 2 "error: --time-limit '1:99': 99 is not below 60 in its place; hint" train --time-limit 1:99 --checkpoint-dir /tmp)
mpipe_cli_test(time_limit_hours 2 "error: --time-limit '1-25:00': 25 is not below 24 in its place; hint" train --time-limit 1-25:00 --checkpoint-dir /tmp)
mpipe_cli_test(time_limit_needs_checkpoints 2 "error: --time-limit stops the run in time to write a checkpoint, and there is no --checkpoint-dir; hint" train --time-limit 90)
mpipe_cli_test(eval_data_missing 2 "error: cannot open --eval-data file '/no/such.h5'; hint: no such file: check the path given to --eval-data" train --model ${CMAKE_SOURCE_DIR}/inputs/cnn.toml --eval-data hdf5:/no/such.h5 --steps 1)
mpipe_cli_test(eval_data_text_missing 2 "error: cannot open --eval-data file '/no/such.txt'; hint: no such file: check the path given to --eval-data" train --eval-data text:/no/such.txt --vocab 256 --steps 1)
add_test(NAME cli.summary_dangling_link COMMAND bash ${EXPECT} 2 "error: --summary '.*' is a link to nothing \\('.*/nowhere/s.json'\\); hint" --
  bash -c "d=$(mktemp -d) && trap 'rm -rf $d' EXIT && ln -s $d/nowhere/s.json $d/s.json && ${MPIPE} train --steps 1 --layers 1 --summary $d/s.json")
set_tests_properties(cli.summary_dangling_link PROPERTIES LABELS unit TIMEOUT 60)
# Bytes that are not UTF-8 (a byte-order mark of UTF-16) are never echoed raw.
add_test(NAME cli.schedule_file_binary COMMAND bash ${EXPECT} 2 "error: schedule file '.*' line 1: expected 'stage N:', got '\\?\\?stage 0:'; hint" --
  bash -c "d=$(mktemp -d) && trap 'rm -rf $d' EXIT && printf '\\377\\376stage 0: F0\\n' > $d/s.txt && ${MPIPE} plan --schedule file:$d/s.txt --ranks 2")
set_tests_properties(cli.schedule_file_binary PROPERTIES LABELS unit TIMEOUT 60)
mpipe_cli_test(plan_sharded_columns 0 "grads +optimizer +opt. 1/2\\* +act" plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --replicas 2 --shard-optimizer)
# On nodes of 2 ranks: each rank order's bytes between nodes, and auto's choice (the
# wide model's replica sums outweigh its boundaries; the long one's the reverse), which
# the plan then follows (the ranks' line).
set(WIDE_GPT --model gpt --layers 4 --d-model 256 --heads 4 --seq-len 16 --vocab 256 --batch-size 8 --micro-batches 4)
set(LONG_GPT --model gpt --layers 4 --d-model 32 --heads 4 --seq-len 512 --vocab 64 --batch-size 32 --micro-batches 4)
mpipe_cli_test(plan_nodes_data 0 "^nodes: 2 of 2 ranks; bytes a step sends out of its busiest node: pipeline order 13.2 MB \\(boundaries 0 MB, replica sums 13.2 MB\\); data order 0.1 MB .*; --rank-order auto chooses data$" plan ${WIDE_GPT} --ranks 4 --replicas 2 --ranks-per-node 2)
mpipe_cli_test(plan_nodes_data_ranks 0 "^ranks: 0=s0/r0 1=s0/r1 2=s1/r0 3=s1/r1$" plan ${WIDE_GPT} --ranks 4 --replicas 2 --ranks-per-node 2)
mpipe_cli_test(plan_nodes_pipeline_ranks 0 "^ranks: 0=s0/r0 1=s1/r0 2=s0/r1 3=s1/r1$" plan ${LONG_GPT} --ranks 4 --replicas 2 --ranks-per-node 2)
mpipe_cli_test(plan_nodes_given 0 "^nodes: 2 of 2 ranks; .*data order 0.1 MB[^;]*\\)$" plan ${WIDE_GPT} --ranks 4 --replicas 2 --ranks-per-node 2 --rank-order pipeline)
# The Llama family's options: one line naming the file, layer and key, or the flag.
mpipe_cli_test(model_file_kv_heads 2 "error: model file '.*', layer 1 \\(block\\): 'kv-heads': 3 does not divide the 4 heads; hint" plan --model ${MODELS}/kv_heads_divide.toml)
mpipe_cli_test(model_file_rope_odd 2 "error: model file '.*', layer 1 \\(block\\): 'positions': RoPE needs an even head size, and 16 channels over 16 heads give 1; hint" plan --model ${MODELS}/rope_odd_head.toml)
mpipe_cli_test(model_file_bad_norm 2 "error: model file '.*', layer 1 \\(block\\): 'norm': must be \"layer\" or \"rms\", got \"batch\"; hint" plan --model ${MODELS}/bad_norm.toml)
mpipe_cli_test(model_file_bad_mlp 2 "error: model file '.*', layer 1 \\(block\\): 'mlp': must be \"gelu\" or \"swiglu\", got \"relu\"; hint" plan --model ${MODELS}/bad_mlp.toml)
mpipe_cli_test(model_file_bad_eps 2 "error: model file '.*', layer 1 \\(block\\): 'eps': must be in \\(0, 0.1\\], got -1; hint" plan --model ${MODELS}/bad_eps.toml)
mpipe_cli_test(model_file_llama 0 "layers \\(5\\): 0:embedding 1:block 2:rmsnorm 3:linear 4:cross_entropy" plan --model ${MODELS}/llama_tiny.toml)
mpipe_cli_test(llama_kv_heads 2 "error: --kv-heads 3 does not divide --heads 4; hint" plan --model llama --kv-heads 3)
mpipe_cli_test(llama_tie_word 2 "error: unknown --tie-embeddings 'maybe'; hint: use --tie-embeddings on or off" plan --model llama --tie-embeddings maybe)
mpipe_cli_test(llama_odd_head 2 "error: RoPE needs an even head size, and --d-model 128 over --heads 128 gives 1; hint" plan --model llama --heads 128 --d-model 128)
# Llama 3.2 1B's shape: Hugging Face's parameter count (the tied head once), sized on 8 ranks.
mpipe_cli_test(llama_1b_count 0 "parameters: 1,235,814,400 \\(a tied weight once\\)" plan --model llama --layers 16 --d-model 2048 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --tie-embeddings on --ranks 8)
mpipe_cli_test(layer_kinds_llama 0 "mlp +\"gelu\" \\(fc, GELU, proj\\) or \"swiglu\"" plan --layer-kinds)
mpipe_cli_test(llama_trains 0 "step +3/3 \\| loss" train --model llama --layers 2 --d-model 32 --heads 4 --kv-heads 2 --seq-len 16 --vocab 64 --batch-size 4 --micro-batches 2 --steps 3 --threads 1)
# --ffn 0: Llama's rule, int(8C/3) rounded up to a multiple of 256 (C 2048: 5461 -> 5632; C 4096, Llama 2 7B: 11008).
mpipe_cli_test(llama_ffn_rule 0 "ffn = 5632" plan --model llama --d-model 2048 --heads 32 --print-model)
mpipe_cli_test(llama_ffn_rule_7b 0 "ffn = 11008" plan --model llama --d-model 4096 --heads 32 --print-model)
# Issue 66: a mistyped option names the nearest known one; every --help ends with examples;
# the bf16 refusal names the device that was asked for (auto here, where there is no GPU).
mpipe_cli_test(did_you_mean_typo 2 "error: .*--micro-batchs.*; hint: did you mean --micro-batches\\? see 'mpipe train --help'"
  train --micro-batchs 4)
mpipe_cli_test(did_you_mean_prefix 2 "hint: did you mean --checkpoint-dir\\? see 'mpipe train --help'" train --checkpoint-di x)
mpipe_cli_test(did_you_mean_plan 2 "hint: did you mean --ranks\\? see 'mpipe plan --help'" plan --rank 4)
mpipe_cli_test(did_you_mean_generate 2 "hint: did you mean --temperature\\? see 'mpipe generate --help'"
  generate --checkpoint x --temprature 0)
mpipe_cli_test(did_you_mean_none 2 "error: .*--zzzzzzzzzz.*; hint: see 'mpipe train --help'" train --zzzzzzzzzz 1)
mpipe_cli_test(help_examples 0 "^Examples \\(as root, first: export OMPI_ALLOW_RUN_AS_ROOT=1" --help)
mpipe_cli_test(help_examples_train 0 "^  mpipe train --config inputs/quickstart.toml --steps 100$" train --help)
mpipe_cli_test(help_examples_plan 0 "^  mpipe plan --model gpt --layers 12 --print-model" plan --help)
mpipe_cli_test(help_examples_inspect 0 "^  mpipe inspect runs/ckpt/ckpt-00000100.h5 --stats --verify$" inspect --help)
mpipe_cli_test(help_examples_export 0 "^  mpipe export runs/ckpt runs/model.safetensors$" export --help)
mpipe_cli_test(help_examples_generate 0 "^  mpipe generate --checkpoint runs/text --prompt" generate --help)
mpipe_cli_test(bf16_auto_no_gpu 2 "error: --precision bf16 needs a GPU, and --device auto found none on every rank, so it chose the CPU; hint"
  train --precision bf16 --steps 1)
mpipe_cli_test(plan_optimizer_footnote 0 "^\\* the optimizer state this run keeps per rank: whole, or 1/2 of it with --shard-optimizer \\(off\\)"
  plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 4 --replicas 2)
mpipe_cli_test(one_stage_no_bubble 0 "^bubble: none, one pipeline stage"
  train --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --steps 2 --threads 1)
# The plan's bubble line on one pipeline stage: 'none', not a percentage of 0.0 (the
# plan's form ends at the parenthesis; the end-of-run table's goes on).
mpipe_cli_test(plan_one_stage_no_bubble 0 "^bubble: none, one pipeline stage \\(no stage waits on another\\)$"
  plan --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --ranks 1)
