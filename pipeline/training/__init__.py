"""What runs inside each Ray Train worker: DeepSpeed engine, batch arithmetic, data, checkpoints."""
