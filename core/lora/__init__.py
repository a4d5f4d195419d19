"""Multi-LoRA serving (issue #42; docs/lora.md): PEFT adapters loaded beside the base model, mixed in
one batch (each adapter's rows through its own A and B), admitted per batch and evicted LRU."""
