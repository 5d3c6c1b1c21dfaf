"""DeepSpeed's import paths, and nothing else: each module here re-exports names implemented in
the zerotrain package of their concern (docs/design.md, "Dependency rule").

Scripts reach these modules under DeepSpeed's names with ``deepspeed`` replaced by ``zerotrain``:
``zerotrain.runtime.zero.stage3`` is the file ``deepspeed_paths/runtime/zero/stage3.py``, loaded
once under that public name (zerotrain._lazy.DeepSpeedPathFinder); ``zerotrain.deepspeed_paths.X``
names the same module object. zerotrain's own code never imports from here.
"""
