import os

# Tests run on CPU; eight host devices let sharding tests build real meshes on one machine.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
