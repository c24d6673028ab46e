"""Training runs: the DeepSpeed engine, the trainer's loop, its checkpoints and budgets, and the
launcher that spreads a run over processes and nodes. What a step computes (examples, masks,
the loss) is ``peagle.objective``'s."""
