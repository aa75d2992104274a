"""rlpost's benchmarks: each measures a part of a run beside its limit, measured in the same run on the same host.

    make bench                                        # the standard set, one table (benchmarks.suite)
    .venv/bin/python -m benchmarks.grpo --steps 10    # one benchmark; extra arguments are Hydra overrides

- grpo: GRPO steps (sync, or sync against async) beside bare generation + bare training, refit beside memcpy;
- refit: the colocated refit alone beside the engine's bare in-place load and memcpy;
- start: `rlpost train` to its first step beside a bare engine's start;
- generation: rlpost's engines beside the bare engines they wrap;
- learning: whether a real model learns in a wall-clock budget (before / after evaluation);
- ab: alternating A/B runs of the GRPO benchmark (configurations or git revisions);
- timeline_gaps: a run's Ray timeline summed up per actor;
- limits: the bare measurements; harness: results files, the process tree's memory and CPU, the table.

Results: results/bench_<name>.json, the latest run per configuration (benchmarks.harness).
"""
