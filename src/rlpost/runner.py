"""Run one validated job in its run directory: setup -> grpo_train -> summary, always releasing
Ray, process groups and worker processes (also between the jobs of a multirun)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlpost.config.schema.master import MasterConfig


def run(cfg: MasterConfig, run_dir: Path) -> Dict[str, Any]:
    """Train with GRPO; returns a summary (final reward, accuracy, where the outputs are)."""
    import ray

    from rlpost.algorithms.grpo import grpo_train, setup

    console = Console(stderr=True)
    t0 = time.perf_counter()
    last: Dict[str, float] = {}
    comps = None
    try:
        comps = setup(cfg, run_dir)
        start = comps.save_state.total_steps
        if start:
            console.print(f"[bold]rlpost[/]: resuming from step {start} ({comps.checkpointer.latest()})")
        total = cfg.grpo.max_num_steps
        with Progress(
            TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), console=console, disable=not cfg.logger.console_progress,
        ) as progress:
            task = progress.add_task("train", total=total, completed=start, info="")

            def on_step(step: int, m: Dict[str, float]) -> None:
                last.update(m)
                info = f"reward {m.get('train/reward', float('nan')):.3f}  step {m.get('timing/train/total_step_time', 0):.2f}s"
                if "validation/accuracy" in m:
                    info += f"  val acc {m['validation/accuracy']:.3f}"
                progress.update(task, completed=step, info=info)

            state = grpo_train(comps, on_step=on_step)
        summary = {
            "run_dir": str(run_dir),
            "steps": state.total_steps,
            "final_reward": last.get("train/reward"),
            "val_accuracy": last.get("validation/accuracy", state.val_reward),
            "wall_s": time.perf_counter() - t0,
            "metrics": str(comps.logger.dir / "metrics.jsonl"),
            "tensorboard": str(comps.logger.tb_dir),
        }
        console.print(
            f"[bold green]done[/]: {summary['steps']} steps in {summary['wall_s']:.0f}s, final train/reward "
            f"{summary['final_reward'] if summary['final_reward'] is not None else float('nan'):.3f}\n"
            f"  metrics:     {summary['metrics']}\n  tensorboard: {summary['tensorboard']}\n"
            f"  checkpoints: {comps.checkpointer.dir if cfg.checkpointing.enabled else '(disabled)'}"
        )
        return summary
    finally:
        if comps is not None:
            comps.close()
        if ray.is_initialized():
            ray.shutdown()
