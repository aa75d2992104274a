"""Run by test_vllm_bucket_reload_log.py in a subprocess (an in-process vLLM engine leaves global state behind):
loads seeded weights into the tiny model's engine in two refit buckets through vLLM's reload_weights, then the
same weights in one load, and prints what the test asserts as one JSON line. vLLM's log goes to this process's
stdout/stderr, which the test reads."""

from __future__ import annotations

import json
import sys


def main(model_dir: str) -> None:
    from vllm import SamplingParams
    from vllm_scripts import cpu_engine  # this script's folder is on sys.path

    from rlpost.distributed.shm_buckets import ShmBucketWriter

    worker, base, new = cpu_engine(model_dir, 8, 64, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)

    def generate() -> list[list[int]]:
        worker.reset_prefix_cache()
        outs = worker.engine.generate([{"prompt_token_ids": [1, 5, 7, 9, 11, 3]}], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    layer0 = [(n, t) for n, t in new if n.startswith("model.layers.0.")]
    rest = [(n, t) for n, t in new if not n.startswith("model.layers.0.")]
    shm = ShmBucketWriter()
    print("BUCKETS-BEGIN", flush=True)
    worker.load_bucket(shm.write(layer0), None, False)
    worker.load_bucket(shm.write(rest), None, True)
    print("BUCKETS-END", flush=True)
    shm.close()
    result: dict[str, object] = {"buckets": generate()}
    worker.update_weights(base)
    result["base"] = generate()
    worker.update_weights(new)
    result["whole"] = generate()
    worker.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
