"""Which tests run where: the default suite (`make test`, CI) and the slow tier (`make test-all`).

The default suite keeps one representative of every path (each command end to end, each fault class, each
library's matrix at one world size, one real torchrun job); the slow tier adds the same paths exercised many
times over (every offset, every parameter, every release, every world size). A test marked
`@pytest.mark.slow` where it is written is slow by nature (minutes, other releases); the tests below moved
there from the default suite, each with what still covers its path by default (issue 30: the default suite at
most a third of its former time). conftest.py applies this table; tests/test_tiers.py checks that every
entry names a test that exists.
"""

import pytest

COLLECTED = pytest.StashKey[tuple]()
"""(files collected in this session, the MOVED_TO_SLOW prefixes that matched a test): set by conftest.py."""

MOVED_TO_SLOW: dict[str, str] = {
    # signals and processes
    "tests/faults/test_signals.py::test_signals_across_a_runs_lifetime":
        "a signal at every offset of a real run's life; by default: the window before the handler "
        "(test_signals.py) and every safe point (test_signal_safepoints.py)",
    "tests/faults/test_signal_soak.py::test_one_signal_in_each_command":
        "a soak over every command; by default each command's Ctrl-C path once (test_console_facts, "
        "test_parity_robust)",
    "tests/faults/test_processes.py::test_a_sigkilled_parent_is_reported_abandoned_and_leaves_no_temp_folders":
        "a whole run SIGKILLed; by default: test_launch.py::test_sigkilled_parent_leaves_no_orphans and "
        "the abandoned status read back (tests/report)",
    "tests/distributed/test_loopback_only.py::test_a_local_run_listens_on_loopback_only":
        "whole runs watched from outside; by default the launcher's own sockets "
        "(test_the_launchers_sockets_are_on_loopback)",
    "tests/distributed/test_launch.py::test_under_torchrun_a_raising_rank_reaches_every_rank":
        "a second real torchrun job; by default test_under_torchrun_each_process_is_one_rank",
    "tests/distributed/test_launch.py::test_one_stuck_rank_is_named_while_its_peers_time_out":
        "the launcher alone; by default the same case through a check (test_parity_robust.py::"
        "test_a_rank_that_hangs_fails_in_bounded_time_with_its_stack: rank 1 stuck and named, its peers time out)",
    "tests/distributed/test_launch.py::test_spawn_start_method_works":
        "the spawn start method is NCCL's (GPU only); fork is every CPU path",
    # torchrun jobs of the CLI (each starts a real torchrun: seconds of start-up per test)
    "tests/cli/test_torchrun_one_rank_talks.py::test_each_command_prints_its_header_once[args0":
        "one command under torchrun by default (verify-parity); the others print through the same rank filter",
    "tests/cli/test_torchrun_one_rank_talks.py::test_each_command_prints_its_header_once[args1":
        "as above",
    "tests/cli/test_torchrun_one_rank_talks.py::test_each_command_prints_its_header_once[args3":
        "as above",
    "tests/cli/test_console_facts.py::test_under_real_torchrun_a_refusal_is_said_once_by_rank_0":
        "a refusal under a real torchrun; by default the same refusal with the launcher's variables set "
        "(test_a_world_size_that_contradicts_the_launcher_is_refused, with rank 1 silent)",
    "tests/cli/test_console_facts.py::test_bench_under_a_launcher_blames_the_launcher_not_a_flag_never_passed":
        "a subprocess of test_bench.py::test_bench_under_a_launcher_is_refused (in process, by default)",
    "tests/cli/test_console_facts.py::test_a_world_size_that_contradicts_the_launcher_is_refused[command1]":
        "run fastmoe keeps the case by default; the refusal is one function for every command",
    "tests/cli/test_console_facts.py::test_a_world_size_that_contradicts_the_launcher_is_refused[command2]":
        "as above",
    "tests/parity/test_parity_robust.py::test_under_torchrun_a_rank_that_raises_fails_the_check_and_says_why":
        "a real torchrun job of 3; by default a raising rank in moebench's launcher (test_launch.py)",
    "tests/parity/test_parity_robust.py::test_two_concurrent_runs_do_not_clash":
        "two whole suites at once (ports and folders); run ids and ports are drawn per run",
    "tests/parity/test_parity_robust.py::test_interrupting_the_real_command_kills_every_rank[sigterm]":
        "Ctrl-C keeps the case by default; SIGTERM takes the same path (signals.py)",
    # generated hostile input, every value of every key
    "tests/faults/test_generated_ds_config.py::test_generated_hostile_ds_configs[every]":
        "every bounded DeepSpeed key given every hostile value; by default each key 3 of them in turn, every value "
        "still met ([sampled]), and every section, type and file shape",
    # the parity checks many times over
    "tests/parity/test_parity_checks.py::test_every_check_passes_on_the_real_implementations":
        "every check at 4 and 9 ranks; by default every check at 2 ranks "
        "(test_parity.py::test_json_stdout_is_one_document_with_every_default_check)",
    "tests/parity/test_parity_checks.py::test_every_check_passes_with_the_largest_seed":
        "the seed's edge; by default seed 0 and the seed bounds (test_bounds_cases)",
    "tests/parity/test_parity_checks.py::test_world_size_16_oversubscribed_on_two_cores":
        "16 ranks on 2 cores; by default the thread share is tested in test_contention.py",
    "tests/parity/test_impl_named.py::test_the_console_json_and_report_name_the_user_implementation":
        "console, JSON and report at once; by default test_a_run_on_moebench_code_says_so and the --impl tests",
    # library rows many times over
    "tests/libraries/test_repro.py::test_deepspeed_script_reproduces_the_fault_and_passes_unbroken":
        "an engine script with a fault injected, and unbroken; by default the engine script of the pinned "
        "release's finding, run standalone (test_the_tool_and_its_script_print_the_same_figures)",
    "tests/libraries/test_repro.py::test_transformers_script_reproduces_the_fault_and_passes_unbroken":
        "the transformers script's harness is DeepSpeed's; by default it is checked standalone "
        "(test_adapter_contract.py)",
    "tests/libraries/test_repro.py::test_cli_writes_the_script_of_each_failing_row_and_lists_it":
        "fairscale's --repro through the CLI; by default the CLI writes and lists a script "
        "(test_the_tool_and_its_script_print_the_same_figures), the listing at 80 columns "
        "(test_write_scripts_writes_one_per_failing_row_and_lists_them) and fairscale's script run standalone "
        "(test_fairscale_script_reproduces_the_fault_and_passes_unbroken)",
    "tests/libraries/test_repro.py::test_the_tool_and_its_script_print_the_same_figures[deepspeed/engine/zero0/ep=2/w2/"
    "clip+bf16":
        "a second engine script beside the tool (17 s of CPU); by default the fp32 clip row's script and tool "
        "(the same script path), the bf16 row's tool diagnosis (test_ds_half.py)",
    "tests/libraries/test_ds_resume.py::test_repro_script_exits_1_with_the_fault_and_0_without":
        "the resume script run twice; by default the resume rows and their faults",
    "tests/libraries/test_ds_engine.py::test_a_rows_ranks_inherit_what_the_engine_imports_and_the_console_stays":
        "import hygiene of the ranks; by default the engine rows run",
    "tests/libraries/test_transformers_resume.py::test_every_resume_row_passes_at_world_4":
        "world 4; by default world 2",
    "tests/libraries/test_deepspeed_releases.py::test_list_says_why_a_deepspeed_that_does_not_import_cannot_run":
        "an old release side-installed; the releases themselves are in the slow tier too",
    "tests/libraries/test_user_adapter.py::test_a_broken_adapter_is_one_line_exit_2_and_nothing_written[missing":
        "by default: a module that raises at import, a rank that raises, an object that is no adapter",
    "tests/libraries/test_user_adapter.py::test_a_broken_adapter_is_one_line_exit_2_and_nothing_written[norunner":
        "as above",
    "tests/libraries/test_user_adapter.py::test_a_broken_adapter_is_one_line_exit_2_and_nothing_written[clash":
        "as above",
    # the report and the other commands many times over
    "tests/report/test_readback.py::test_every_file_kind_damaged_every_way":
        "every file kind x every damage; by default the issue's cases (test_the_issues_cases)",
    "tests/report/test_generated_damage.py::test_every_damage_renders_or_is_named":
        "every field of every results file of every kind x every damage (about 3,700 cases, minutes); by default one "
        "case of each change drawn with a fixed seed and the issue's own (test_sampled_damage_renders_or_is_named)",
    "tests/report/test_report.py::test_the_chapter_run_is_judged_whatever_the_order_or_a_newer_quick_run":
        "chapter-preset runs; by default the chapter values edited into quick runs (test_verdict_follows_the_"
        "tolerance)",
    "tests/report/test_report.py::test_the_latest_bench_is_shown_whatever_its_date":
        "a real bench run; by default the bench section from a bench folder (tests/report)",
    "tests/test_bench.py::test_quick_sweep_fields":
        "the whole quick sweep; by default test_bench_command_fields runs the command",
    "tests/test_schemas.py::test_real_cli_runs_validate[deepspeed]":
        "every test's files are validated after it (conftest.py); fastmoe keeps the case",
    "tests/envcheck/test_envcheck_cli.py::test_real_cli_with_probe_in_a_subprocess":
        "the probe in a subprocess; by default the probe in test_columns.py's env-check",
    "tests/envcheck/test_envcheck_constraints.py::test_check_is_in_the_real_clis_json":
        "the check through a subprocess; by default in process",
    "tests/gpucheck/test_gpucheck_install.py::test_an_offline_install_from_a_wheel_folder_sees_the_interpreters":
        "a pip install into a throwaway venv; the install plan is tested by default",
    "tests/cli/test_packaging.py::test_installed_wheel_runs_a_preset_outside_the_checkout":
        "a wheel built and installed; by default the wheel's contents (test_wheel_holds_presets_...)",
}
