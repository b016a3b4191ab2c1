"""What one GRPO step optimises, in one place; the coordinator and the trainer only call it.

    samples.py     generations -> scored samples (each round); `prepare`: scored samples -> the
                   step's training sequences, once per step (KL in reward, advantages)
    shaping.py     reward shaping and sample filtering: overlong penalty, KL in reward, dynamic
                   sampling, truncation mask
    advantages.py  ADVANTAGE_ESTIMATORS (algorithm.advantage_estimator)
    policy_losses/ one module per policy loss (algorithm.policy_loss), registered by name
    losses.py      LOSS_AGGREGATIONS (algorithm.loss_agg_mode) and
                   `micro_batch_loss`: policy loss, TIS, KL loss, entropy bonus
    grpo.py        the pure math they are built from
"""
