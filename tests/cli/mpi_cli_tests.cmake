# mpipe_mpi_test(name ranks exit-code regex args...): the real binary under mpiexec.
set(SMALL train --model gpt --layers 2 --d-model 16 --heads 2 --seq-len 8 --vocab 32 --batch-size 8 --steps 3 --threads 1)
mpipe_mpi_test(trains_k4 4 0 "bubble: measured [0-9.]+%" ${SMALL} --micro-batches 4 --schedule 1f1b)
# ZB-V from the command line: 2 ranks, 4 model stages of the 6 layers, the loss on rank 0.
mpipe_mpi_test(trains_zbv 2 0 "step +3/3 \\| loss [0-9.]+ " ${SMALL} --micro-batches 4 --schedule zbv --log-every 1)
# Updates ahead of the agreement: clip 0 wins every bet.
mpipe_mpi_test(trains_overlap 2 0 "overlap-steps: 3 updates made ahead of their agreement, 0 undone" ${SMALL} --micro-batches 4 --schedule zb-h2 --log-every 1 --overlap-steps --clip-grad 0)
# --sample-every: rank 0 gathers both stages' weights and continues the prompt in the log;
# a model that cannot generate is refused before training.
mpipe_mpi_test(sample_every 2 0 "sample at step 3: \"[^\"]+\"" ${SMALL} --micro-batches 2 --sample-every 3 --sample-tokens 12 --head-chunks 2)
mpipe_mpi_test(sample_every_mlp 2 2 "error: --sample-every: it is not a model of tokens .*; hint" train --model mlp --steps 2 --sample-every 1)
mpipe_mpi_test(world_not_dk 3 2 "error: world size 3 is not divisible by --stages 2; hint" ${SMALL} --stages 2)
mpipe_mpi_test(more_stages_than_layers 8 2 "error: more stages \\(8\\) than layers \\(6\\)" ${SMALL} --stages 8 --replicas 0)
mpipe_mpi_test(batch_not_md 4 2 "error: --batch-size 8 does not split into --micro-batches 3 x 2 replicas" ${SMALL} --micro-batches 3 --stages 2)
mpipe_mpi_test(balance_sum 2 2 "error: --balance adds up to 5 layers, the model has 6" ${SMALL} --balance 2,3)
mpipe_mpi_test(balance_stages 2 2 "error: --balance has 3 stages, the grid has 2" ${SMALL} --balance 2,2,2)
# --partition time on 2 x 2 ranks: both replicas measure the link between their stages.
mpipe_mpi_test(links_measured 4 0 "links \\(measured\\): 0->1 [0-9.]+ GB/s; per micro-batch, ms by stage: compute [0-9.]+ / [0-9.]+, links [0-9.]+ / [0-9.]+" ${SMALL} --micro-batches 2 --stages 2 --partition time)
mpipe_mpi_test(rank_fails 4 1 "error: rank 2 \\(stage 2, replica 0\\) at step 1 during F0: injected failure" ${SMALL} --micro-batches 4)
set_tests_properties(mpi.rank_fails PROPERTIES ENVIRONMENT "${MPI_TEST_ENV};MPIPE_TEST_FAIL=2:1")
# The same with --overlap-steps: step 1's agreement is in flight when rank 2 fails in step 2.
mpipe_mpi_test(rank_fails_overlap 4 1 "error: rank 2 \\(stage 2, replica 0\\) at step 2 during F0: injected failure" ${SMALL} --micro-batches 4 --overlap-steps --clip-grad 0)
set_tests_properties(mpi.rank_fails_overlap PROPERTIES ENVIRONMENT "${MPI_TEST_ENV};MPIPE_TEST_FAIL=2:2")
mpipe_mpi_test(rank_stalls 2 1 "rank 1 \\(stage 1, replica 0\\) at step 1 during RF0: timed out after 2 s waiting for the activation of micro-batch 0 .*; it comes from rank 0 \\(stage 0\\)" ${SMALL} --micro-batches 2 --p2p-timeout 2)
set_tests_properties(mpi.rank_stalls PROPERTIES ENVIRONMENT "${MPI_TEST_ENV};MPIPE_TEST_FAIL=0:1:stall")
mpipe_mpi_test(config_broken 2 2 "error: config file '.*broken_array.toml' line 1, column 12" train --config ${CMAKE_CURRENT_SOURCE_DIR}/cli/configs/broken_array.toml)
# Output files: a full disk (/dev/full) is an error, never a short file and exit 0; a
# directory, a missing directory or two outputs in one file are refused before training.
mpipe_mpi_test(metrics_full 2 2 "error: cannot write metrics file '/dev/full': No space left on device; hint" ${SMALL} --micro-batches 2 --metrics /dev/full)
mpipe_mpi_test(trace_full 2 2 "error: cannot write trace file '/dev/full': No space left on device; hint" ${SMALL} --micro-batches 2 --trace /dev/full)
mpipe_mpi_test(summary_full 2 2 "error: cannot write summary file '/dev/full': No space left on device; hint" ${SMALL} --micro-batches 2 --summary /dev/full)
mpipe_mpi_test(summary_dir 2 2 "error: --summary '.*' is a directory; hint: give a file, e.g. .*summary.json" ${SMALL} --micro-batches 2 --summary ${CMAKE_CURRENT_BINARY_DIR})
mpipe_mpi_test(outputs_same_file 2 2 "error: --metrics and --trace name the same file '.*/out.json'; hint: give each output its own file" ${SMALL} --micro-batches 2 --metrics ${CMAKE_CURRENT_BINARY_DIR}/out.json --trace ${CMAKE_CURRENT_BINARY_DIR}/./out.json)
mpipe_mpi_test(output_no_dir 2 2 "error: --trace '/no/such/dir/t.json': no directory '/no/such/dir'; hint" ${SMALL} --micro-batches 2 --trace /no/such/dir/t.json)
# A schedule file that deadlocks: refused on every rank before training, one line.
mpipe_mpi_test(schedule_file_deadlock 2 2 "error: schedule file '.*deadlock.txt': deadlock: stage 0 waits before B0 for the gradient of micro-batch 0; stage 1 waits before F1 for the activation of micro-batch 1" train --schedule file:${CMAKE_CURRENT_SOURCE_DIR}/cli/schedules/deadlock.txt --micro-batches 2 --steps 1)
# --shard-optimizer: a replica stopped after its update, before the others have its rows
# of the values: its partner names it within --p2p-timeout, one line.
mpipe_mpi_test(gather_stopped 2 1 "error: rank 1 stopped answering .* waiting for replica 1's updated values of layer" ${SMALL} --micro-batches 2 --replicas 2 --shard-optimizer --p2p-timeout 2)
set_tests_properties(mpi.gather_stopped PROPERTIES ENVIRONMENT "${MPI_TEST_ENV};MPIPE_TEST_FAIL=1:1:gather")
# The memory check counts 1/D of the optimizer state with --shard-optimizer: the plan's largest GPT at 32 MiB
# (plan_largest) trains; one block more is refused before anything is allocated. With replicas the weights
# include the gradient sums' buffers, (D-1)/D of the gradients.
set(LARGEST train --config ${CMAKE_SOURCE_DIR}/inputs/quickstart.toml --replicas 2 --remat always --memory-per-rank 32MiB --shard-optimizer --steps 1 --threads 1)
mpipe_mpi_test(sharded_fits 4 0 "adamw state \\(sharded\\), as allocated \\(plan\\): 12.4 MiB \\+ 6.2 MiB \\(12.4 MiB \\+ 6.2 MiB\\)" ${LARGEST} --layers 16)
mpipe_mpi_test(sharded_too_big 4 2 "error: rank 0 \\(stage 0\\) needs about 35.0 MiB \\(parameters, gradients, their sums' buffers and adamw state .* --memory-per-rank gives it 32.0 MiB" ${LARGEST} --layers 17)
# Skips on 2 ranks: a bad model file is refused once, exit 2; the U-Net trains with its
# skips crossing the cut.
mpipe_mpi_test(skip_shapes 2 2 "error: model file '.*skip_shapes.toml', layer 2 \\(concat\\): 'from': the skip 'down' is \\(4, 8, 8\\) a sample and the input \\(4, 4, 4\\)" train --model ${CMAKE_CURRENT_SOURCE_DIR}/cli/models/skip_shapes.toml)
mpipe_mpi_test(skip_from_nothing 2 2 "error: model file '.*skip_from_nothing.toml', layer 1 \\(concat\\): 'from': no layer stashes 'dwon'" train --model ${CMAKE_CURRENT_SOURCE_DIR}/cli/models/skip_from_nothing.toml)
mpipe_mpi_test(unet_trains 2 0 "step +4/4 \\| loss [0-9.]+ " train --model ${PROJECT_SOURCE_DIR}/inputs/unet.toml --batch-size 8 --micro-batches 4 --steps 4 --threads 1 --log-every 4)
# --comm-progress auto (the default) reads Open MPI's shared-memory single-copy mechanism
# and the ranks' nodes, and the header says what it chose and why: a thread where shared
# memory cannot copy by itself or is not used, tests between layers where it can.
mpipe_mpi_test(progress_auto_no_single_copy 2 0 "communication: auto chose thread, shared memory without single-copy \\(none\\): posted messages are tested between layers and by a progress thread" ${SMALL} --micro-batches 2)
set_tests_properties(mpi.progress_auto_no_single_copy PROPERTIES ENVIRONMENT "${MPI_TEST_ENV};OMPI_MCA_btl_vader_single_copy_mechanism=none")
mpipe_mpi_test(progress_auto_no_shared_memory 2 0 "communication: auto chose thread, no shared-memory single-copy found: posted messages are tested between layers and by a progress thread" ${SMALL} --micro-batches 2)
set_tests_properties(mpi.progress_auto_no_shared_memory PROPERTIES ENVIRONMENT "${MPI_TEST_ENV};OMPI_MCA_btl=self,tcp")
mpipe_mpi_test(progress_auto 2 0 "communication: auto chose (layers, every rank on one node with shared memory by single-copy \\((cma|xpmem|knem)\\): posted messages are tested between layers and actions;|thread, shared memory without single-copy \\([a-z]+\\): posted messages are tested between layers and by a progress thread)" ${SMALL} --micro-batches 2)
