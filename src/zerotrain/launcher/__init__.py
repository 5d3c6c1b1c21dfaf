"""The ``zerotrain`` launcher: one process per device on torch's elastic agent.

Programmatic use::

    from zerotrain.launcher import LaunchOptions, launch_local
    exit_code = launch_local(LaunchOptions(script="train.py", script_args=["--deepspeed", "ds.json"], nproc=2))

Names are imported lazily so the per-rank entry shim does not pay for torch.
"""

__all__ = ["LaunchOptions", "LaunchError", "launch_local", "build_launch_config", "worker_command"]


def __getattr__(name: str):
    if name == "LaunchError":
        from zerotrain.launcher.errors import LaunchError

        return LaunchError
    if name in __all__:
        import zerotrain.launcher.launch as launch_module

        return getattr(launch_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
