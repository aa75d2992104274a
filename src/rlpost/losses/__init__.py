"""Every loss beside the interface the workers call (`interface.LossFunction`): the clipped policy gradient and NLL
(`clipped_pg`), CISPO, distillation, DPO and Bradley-Terry (`preference`), PPO's value loss, and the packed-batch
wrapper that applies any of them sequence by sequence."""
