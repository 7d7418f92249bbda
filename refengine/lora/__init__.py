"""Multi-LoRA: PEFT adapters (``peft.py``), the lifecycle and its rules (``registry.py``),
and which adapter sits in which device slot (``slots.py``). The batched math is in
``kernels/lora.py`` (torch) and ``kernels/lora_triton.py`` (CUDA)."""
