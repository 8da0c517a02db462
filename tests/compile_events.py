"""Which threads XLA compiled on while some code ran: to hold warm-up to one build per program."""

import threading

import jax


def compile_threads(fn) -> list[str]:
    """The names of the threads on which a program was compiled (or loaded from the persistent
    cache) while `fn()` ran, one entry per program."""
    where = []

    def listener(name, *args, **kwargs):
        if name.endswith("backend_compile_duration"):
            where.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return where
