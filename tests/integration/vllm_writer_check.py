"""Run by test_vllm_cpu_writer.py in a subprocess (an in-process vLLM engine leaves global state behind):
loads seeded weights into the tiny model's engine through rlpost's CPU writer and through vLLM's
reload_weights, and prints what the test asserts as one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch


def main(model_dir: str) -> None:
    from vllm import SamplingParams
    from vllm_scripts import cpu_engine  # this script's folder is on sys.path

    from rlpost.models.generation.vllm_extension import WRITER_ENV

    worker, base, new = cpu_engine(model_dir, 12, 128, seed=3)
    prompts = [[1, 5, 7, 9, 11, 3], [4, 4, 8, 15, 16, 23, 42], [2, 3]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)

    def generate() -> list[tuple[list[int], list[float]]]:
        worker.reset_prefix_cache()
        outs = worker.engine.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                for o in outs]

    def load(named: list[tuple[str, torch.Tensor]], writer: bool) -> tuple[str, str]:
        os.environ[WRITER_ENV] = "1" if writer else "0"
        fp = worker.update_weights(named)
        return fp, worker.last_load_path()

    result: dict[str, object] = {}
    result["fp_reload"], result["path_reload"] = load(new, writer=False)
    by_reload = generate()
    load(base, writer=False)
    result["base_differs"] = generate() != by_reload
    sources = [(n, t.clone()) for n, t in new]
    result["fp_writer"], result["path_writer"] = load(sources, writer=True)
    result["writer_equals_reload"] = generate() == by_reload
    for _, t in sources:  # the engine must own what it loaded: a reused transfer buffer is overwritten next
        t.fill_(float("nan"))
    result["survives_overwritten_sources"] = generate() == by_reload

    # A refit bucket in shared memory (q, k, v back to back: read in place), then the segment reused.
    from rlpost.distributed.shm_buckets import ShmBucketWriter

    load(base, writer=False)
    shm = ShmBucketWriter()
    os.environ[WRITER_ENV] = "1"
    worker.load_bucket(shm.write(new), None, True)
    result["shm_bucket_equals_reload"] = generate() == by_reload
    shm.write([(n, torch.full_like(t, float("nan"))) for n, t in new])
    result["survives_reused_segment"] = generate() == by_reload
    shm.close()

    def split_plan(self: object) -> list[bool]:
        writer = self._rlpost_cpu_writer()  # type: ignore[attr-defined]
        layer = "model.layers.0.self_attn."
        only_qk = [(n, t) for n, t in new if n.startswith(layer) and ("q_proj" in n or "k_proj" in n)]
        unknown = [("model.layers.0.not_a_module.weight", torch.zeros(2))]
        return [writer.plan(only_qk) is None, writer.plan(unknown) is None]

    result["split_fused_refused"], result["unknown_refused"] = worker.engine.collective_rpc(split_plan)[0]
    worker.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
