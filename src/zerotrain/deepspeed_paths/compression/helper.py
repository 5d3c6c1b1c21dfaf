"""``deepspeed.compression.helper``: get and set a submodule by its dotted name (implemented in
``zerotrain.module_paths``).

Only these two helpers are provided: the compression techniques themselves (quantization,
pruning, layer reduction; ``compression_training`` in the config) are not implemented.
"""

from zerotrain.module_paths import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
