"""The runtime side of xlakit: what a run ran on, and the fixes below torch_xla.

* `manifest.py`: the stack a run ran on (versions, patches, devices) and its
  drift from the pins, which `pins.py` reads from the baked `VERSIONS.toml`;
* `contract.py`: the run contract (environment a run may start with: libtpu
  flags, `PJRT_DEVICE`, cache paths), checked before the runtime starts;
* `startup.py`: starting the runtime for a report (a failure is a finding);
  `features.py`: which xlakit bindings the running torch_xla carries;
* `memory.py`: memory per raw runtime device;
* `compile_cache.py`: `enable_persistent_cache` (the patched runtime's cache,
  or the PJRT wrapper on stock torch_xla, `pjrt_wrap.py`), with the folder
  judged by `cache_trust.py` and the entries read by `cache_files.py`;
* `doctor.py`: live probes of all of the above.

Nothing here imports the checkpoint package; the command line (`xlakit.cli`)
sits on top of both.
"""
