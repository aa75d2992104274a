"""Run-time services every layer may use: console lines, the run log, `_target_` resolution, step timers,
checkpoint files and the metrics logger. Imports only config."""
