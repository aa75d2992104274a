"""Run by test_gc_heap.py in a fresh process: counts the garbage collections of one start phase (the driver's
checks, or a DTensor policy worker's construction) and prints them as one JSON line."""

from __future__ import annotations

import gc
import json
import os
import socket
import sys


def main(phase: str, model_dir: str) -> None:
    count = [0]
    gc.callbacks.append(lambda ph, info: count.__setitem__(0, count[0] + (ph == "stop")))
    if phase == "preflight":
        from rlpost import cli

        ok = cli.preflight([f"policy.model_name={model_dir}", "checkpointing=disabled"], False) == 0
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RLPOST_DEVICE="cpu")
        import dataclasses

        from rlpost.config.load import load_master_config
        from rlpost.models.policy.dtensor_policy_worker import DTensorPolicyWorker

        _, cfg = load_master_config(["cluster.gpus_per_node=1"])
        policy = dataclasses.replace(cfg.policy, model_name=model_dir)
        policy.tokenizer.name = model_dir
        count[0] = 0  # the worker's own start, after the config's imports
        worker = DTensorPolicyWorker(policy, init_reference_model=False)
        ok = worker.model is not None
    print("RESULT " + json.dumps({"ok": ok, "collections": count[0], "frozen": gc.get_freeze_count()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
