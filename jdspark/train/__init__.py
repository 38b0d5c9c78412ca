"""Training the embedded model: a hand-written AdamW, token batches, the target's and the DSpark
drafter's losses and steps, and the drafter's confidence calibration (STS)."""
