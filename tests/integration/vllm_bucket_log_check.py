"""Run by test_vllm_bucket_reload_log.py in a subprocess (an in-process vLLM engine leaves global state behind):
loads seeded weights into the tiny model's engine in two refit buckets through vLLM's reload_weights, then the
same weights in one load, and prints what the test asserts as one JSON line. vLLM's log goes to this process's
stdout/stderr, which the test reads."""

from __future__ import annotations

import json
import os
import sys

import torch


def main(model_dir: str) -> None:
    from safetensors.torch import load_file

    from rlpost.config.schema.generation import VllmConfig
    from rlpost.distributed.shm_buckets import ShmBucketWriter
    from rlpost.models.generation import vllm_generation as vg
    from rlpost.models.generation.vllm_extension import WRITER_ENV
    from rlpost.models.generation.vllm_worker import VllmEngineWorker

    cfg = VllmConfig(max_new_tokens=8)
    os.environ.update(vg.engine_env(cfg.vllm_cfg, False))
    os.environ[WRITER_ENV] = "0"  # every load through vLLM's reload_weights: the path that logs
    cfg.vllm_cfg.kv_cache_space_gb = 0.125
    cfg.vllm_cfg.max_model_len = 64
    worker = VllmEngineWorker(model_dir, vg.engine_kwargs(cfg, 0, False))
    from vllm import SamplingParams

    base = [(n, t) for f in sorted(os.listdir(model_dir)) if f.endswith(".safetensors")
            for n, t in load_file(os.path.join(model_dir, f)).items()]
    g = torch.Generator().manual_seed(5)
    new = [(n, t + 0.3 * torch.randn(t.shape, generator=g)) for n, t in base]
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
    result: dict[str, object] = {"path": worker.last_load_path(), "buckets": generate()}
    worker.update_weights(base)
    result["base"] = generate()
    worker.update_weights(new)
    result["whole"] = generate()
    worker.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
