"""The memory plan: what each worker holds in each phase of a step (workers.py), from the model's config.json alone
(shape.py), laid onto the devices with the verdict and the change that would make a run fit (estimate.py).
`rlpost plan` shows it, `rlpost plan --json` prints it, and the pre-flight refuses a run that cannot fit."""
