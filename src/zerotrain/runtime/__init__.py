"""DeepSpeed's ``deepspeed.runtime`` names that scripts import directly (``runtime.utils``)."""
