import os
import tempfile

# Tests run on CPU; eight host devices let sharding tests build real meshes on one machine.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# Commands run in-process keep their compiled programs in a cache private to this test session.
os.environ.setdefault(
    "DSPARK_JAX_COMPILATION_CACHE", tempfile.mkdtemp(prefix="dspark-jax-test-xla-")
)
