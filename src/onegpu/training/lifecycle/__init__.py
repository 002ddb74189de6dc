"""A run's life beyond its steps: a stop on a signal (:mod:`.interrupt`), the resumable checkpoint and its
state (:mod:`.resume`), out-of-memory recovery (:mod:`.oom`)."""
