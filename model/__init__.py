"""A small model of the trainer's architecture (Gated DeltaNet + gated attention layers, each followed by a MoE of
SwiGLU experts) on a ``("fsdp", "context", "expert")`` mesh, with the trainer's tuning flags as real code paths."""
